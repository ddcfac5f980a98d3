"""The broker's settings (the ``[broker]`` table of a profile in brokers/) and the parsing of endpoints.

Apart from ``config.py`` (a run's settings), which re-exports every name here: callers read every config name
from ``zddrl.config``.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zddrl.tomlconf import ConfigError
from zddrl.tomlconf import build as _build
from zddrl.tomlconf import require as _require

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


@dataclass(frozen=True)
class BrokerConfig:
    """Settings of `zddrl broker`; the `[broker]` table of a profile in brokers/."""

    bind: str = ""
    """Control endpoint: ``tcp://HOST:PORT`` (port ``*`` binds random free ports for every socket; without keys only
    with ``insecure``), or ``ipc://DIR/control``, a local bus: the four sockets are the files ``control``,
    ``trajectories``, ``learners`` and ``params`` in DIR, which, owner-only (0700), only its owner (and root) can
    connect to; the ``*_port`` settings do not apply there. Empty: `zddrl broker` makes a local bus in a fresh
    owner-only directory (``private_bus_dir``) and removes it at exit."""
    trajectory_port: int = 0
    """Port actors PUSH trajectories to; 0 = control port + 1."""
    learner_port: int = 0
    """Port learner shards connect their DEALER to; 0 = control port + 2."""
    params_port: int = 0
    """Port of the parameter PUB socket; 0 = control port + 3."""
    trajectory_hwm: int = 16
    """Trajectory messages queued per connection before senders block (backpressure)."""
    params_hwm: int = 32
    """Parameter messages queued per subscriber (a version is one per ``learner.param_chunk_bytes``); older ones
    are superseded anyway."""
    max_message_bytes: int = 1 << 28
    """Largest message accepted (array bytes); bigger ones are dropped as malformed."""
    heartbeat_interval_s: float = 1.0
    """Seconds between heartbeats, both ways (clients take it from the welcome), while the fleet is small (see
    heartbeat_rate); also how often the broker checks liveness, health and keys."""
    heartbeat_liveness: int = 3
    """Beats a peer may miss before it is expired."""
    heartbeat_rate: float = 300.0
    """Heartbeats per second the broker takes from its members together, at most: past that many members per
    heartbeat_interval_s the interval doubles (2, 4, 8 ... x heartbeat_interval_s) and members learn it from the
    broker's heartbeats; actors send stats at the same interval. Bounds the control plane's cost at any fleet size
    (docs/benchmarks.md, bench fleet) at the price of noticing a dead member later (interval x liveness). 0: the
    interval never grows."""
    keys: str = ""
    """Key directory (docs/security.md): CURVE on every socket, ZAP against each role's allow-list, signed runs
    and parameters. Empty: no keys, which only a loopback bind accepts unless ``insecure``."""
    insecure: bool = False
    """Allow a TCP bind without keys (the open TCP bus; a loud warning at each start off loopback): anyone who can
    reach the ports (on loopback: every local user) can join, inject, read and exhaust. `zddrl broker` refuses a
    TCP bind without keys or this; over ``ipc://`` the directory's owner-only mode closes the bus instead."""
    peer: str = ""
    """The control endpoint of the other broker of a standby pair (``tcp://HOST:PORT``; docs/deploying.md, "A standby
    broker"): only the active one of the two takes clients. Empty: no pair, the broker is always active."""
    peer_role: str = "primary"
    """With ``peer``: ``primary`` starts active unless its peer answers as active, ``backup`` starts passive and takes
    over when its peer has been silent for heartbeat_interval_s x heartbeat_liveness."""
    upstream: str = ""
    """Run as a relay: the control endpoint of the broker above (``tcp://ROOT:PORT``, or a fallback list
    ``tcp://A:5555,tcp://B:5555``). The relay's actors' trajectories go there with credit end to end, parameters
    come from there; its subtree is reported there (docs/architecture.md). Empty: a root broker."""
    upstream_window: int = 0
    """Relay: trajectories forwarded upstream and not yet acknowledged (credit returned) at most. 0 = twice the
    sum of its actors' windows (2 x the run's bus.max_in_flight x actors joined, at least 2 x bus.max_in_flight),
    which keeps the pipe full: the relay is then never the narrowest window, yet a stalled learner stops its
    actors."""
    memory_limit_mib: int = 0
    """The broker's memory budget: past this resident set (read every 0.1 s) it closes and binds again its sockets,
    which frees what libzmq holds for them (messages still arriving, replies nobody reads); clients reconnect and
    say hello again (docs/security.md, "Bounded resources"). 0 = half the memory the broker may use (its cgroup's
    limit, else the host's) above what its process holds at start. Size it above the honest peak: actor hosts x
    trajectory_hwm x trajectory size queued, plus twice the model."""

    def __post_init__(self) -> None:
        if is_ipc(self.bind):
            ipc_dir(self.bind)
        elif not self.bind:
            pass  # the command makes a local bus  # ConfigError naming what is wrong with it
        else:
            _require(
                self.bind.startswith("tcp://") and ":" in self.bind[6:],
                f"broker.bind must look like tcp://HOST:PORT or ipc://DIR/control, got {self.bind!r}",
            )
        for name in ("trajectory_port", "learner_port", "params_port"):
            _require(0 <= getattr(self, name) < 65536, f"broker.{name} must be a port number or 0")
        _require(self.trajectory_hwm >= 1 and self.params_hwm >= 1, "broker HWMs must be >= 1")
        _require(self.max_message_bytes >= 1024, "broker.max_message_bytes must be >= 1024")
        _require(
            self.heartbeat_interval_s > 0 and self.heartbeat_liveness >= 1,
            "broker.heartbeat_interval_s must be > 0 and heartbeat_liveness >= 1",
        )
        _require(0.01 <= self.heartbeat_interval_s <= 3600, "broker.heartbeat_interval_s must be in 0.01..3600")
        _require(0 <= self.heartbeat_rate <= 1e6, "broker.heartbeat_rate must be in 0..1e6 (0: a fixed interval)")
        if self.peer:
            _require(len(split_endpoints(self.peer)) == 1, "broker.peer names one broker: tcp://HOST:PORT")
            _require(self.peer != self.bind, "broker.peer must be the other broker's endpoint, not this one's bind")
        _require(
            self.peer_role in ("primary", "backup"),
            f"broker.peer_role must be primary or backup, got {self.peer_role!r}",
        )
        if self.upstream:
            split_endpoints(self.upstream)  # ConfigError naming the bad entry
        _require(0 <= self.upstream_window <= 1 << 20, "broker.upstream_window must be in 0..2**20 (0 = automatic)")
        _require(
            self.memory_limit_mib == 0 or self.memory_limit_mib >= 64,
            "broker.memory_limit_mib must be 0 (half the memory) or at least 64 (MiB)",
        )


def load_broker_config(profile: str | Path | None, overrides: dict[str, Any] | None = None) -> BrokerConfig:
    """Read the ``[broker]`` table of a profile (or defaults) and apply non-None overrides."""
    data: dict[str, Any] = {}
    if profile is not None:
        p = Path(profile)
        _require(p.is_file(), f"broker profile {str(p)!r} does not exist")
        try:
            doc = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{p}: not valid TOML: {exc}") from None
        _require(set(doc) <= {"broker"}, f"{p}: a broker profile holds one [broker] table")
        data = dict(doc.get("broker", {}))
    data.update({k: v for k, v in (overrides or {}).items() if v is not None})
    return _build(BrokerConfig, data, "broker.")


SOCKET_NAMES = ("control", "trajectories", "learners", "params")
"""The broker's four sockets; over ipc, also the names of their files in the bus directory."""
IPC_PATH_MAX = 107
"""Bytes of a Unix socket's path at most (``sun_path`` is 108 bytes on Linux, with its terminating NUL)."""


def is_ipc(endpoint: str) -> bool:
    """Whether ``endpoint`` is a local bus endpoint (``ipc://``), not TCP."""
    return endpoint.startswith("ipc://")


def ipc_dir(control: str) -> Path:
    """The bus directory of a local control endpoint ``ipc://DIR/control``; ConfigError if it is not one (an
    absolute DIR, the file named ``control``, every socket's path within IPC_PATH_MAX bytes)."""
    path = control[len("ipc://") :]
    _require(
        is_ipc(control) and path.startswith("/") and path.endswith("/control") and len(path) > len("/control"),
        f"a local bus endpoint must be ipc://DIR/control with an absolute DIR, got {control!r}",
    )
    directory = Path(path).parent
    longest = max(len(os.fsencode(str(directory / name))) for name in SOCKET_NAMES)
    _require(
        longest <= IPC_PATH_MAX,
        f"{control!r}: its sockets' paths would be {longest} bytes, past the {IPC_PATH_MAX} a Unix socket takes; "
        "choose a shorter directory",
    )
    return directory


def ipc_endpoint(directory: str | Path, name: str = "control") -> str:
    """The endpoint of the broker socket ``name`` on the local bus in ``directory``."""
    return f"ipc://{Path(directory) / name}"


def private_bus_dir() -> Path:
    """A fresh owner-only (0700) directory for one local bus, under the temporary directory (short: a Unix
    socket's path is at most IPC_PATH_MAX bytes), else under /tmp when that is too long. The caller removes it."""
    base = tempfile.gettempdir()
    if len(os.fsencode(base)) > IPC_PATH_MAX - len("/zddrl-XXXXXXXX/trajectories"):
        base = "/tmp"
    return Path(tempfile.mkdtemp(prefix="zddrl-", dir=base))  # mkdtemp makes it 0700


def socket_endpoint(control: str, name: str, ports: Mapping[str, int]) -> str:
    """Where a client reaches the broker socket ``name`` (trajectories, learners, params) of the broker it reached
    on ``control``: over ipc the file ``name`` beside ``control`` (its welcome names no ports), over TCP the port
    its welcome names (``ports``) on ``control``'s host."""
    if is_ipc(control):
        return ipc_endpoint(ipc_dir(control), name)
    return f"tcp://{split_endpoint(control)[0]}:{ports[name]}"


def split_endpoint(endpoint: str) -> tuple[str, str]:
    """``tcp://host:port`` -> ``("host", "port")`` (port may be ``*``)."""
    _require(endpoint.startswith("tcp://") and ":" in endpoint[6:], f"endpoint {endpoint!r} must be tcp://HOST:PORT")
    host, _, port = endpoint[6:].rpartition(":")
    return host, port


def split_endpoints(connect: str) -> tuple[str, ...]:
    """A client's ``--connect``: one broker endpoint, or a comma-separated fallback list, in the order to try
    them (``"tcp://a:5555,tcp://b:5555"`` -> ``("tcp://a:5555", "tcp://b:5555")``). Each entry must be
    ``tcp://HOST:PORT`` with a port in 1..65535 (a client connects: no ``*``) or a local bus's ``ipc://DIR/control``,
    and none may repeat."""
    entries = tuple(entry.strip() for entry in connect.split(","))
    for entry in entries:
        _require(bool(entry), f"empty entry in the broker list {connect!r}")
        _require(entries.count(entry) == 1, f"endpoint {entry!r} is listed twice")
        if is_ipc(entry):
            ipc_dir(entry)
            continue
        host, port = split_endpoint(entry)
        _require(bool(host), f"endpoint {entry!r} names no host")
        _require(port.isdigit() and 0 < int(port) < 65536, f"endpoint {entry!r}: the port must be 1..65535")
    return entries
