"""The broker's four sockets, made and bound in one place, the one-line error of a port that cannot be bound, and
``Replies``, the way out of a ROUTER socket.

Ports: control at the bind port, the trajectories, learners and params sockets at the next three unless the
profile or the CLI sets them (docs/protocol.md section 1).
"""

from __future__ import annotations

import errno
from collections.abc import Sequence
from typing import Any, NamedTuple

import zmq

from zddrl import protocol as P
from zddrl.broker.auth import BrokerAuth
from zddrl.brokerconf import BrokerConfig, split_endpoint
from zddrl.tomlconf import ConfigError
from zddrl.transport.io import NOBLOCK, send_frames

PORT_OPTIONS = {
    "control": "--bind tcp://HOST:PORT (the profile's bind) moves it, and with it every port not set on its own "
    "(PORT+1, +2, +3)",
    "trajectories": "--trajectory-port (the profile's trajectory_port) moves it; --bind tcp://HOST:PORT moves all "
    "four (PORT, PORT+1, +2, +3)",
    "learners": "--learner-port (the profile's learner_port) moves it; --bind tcp://HOST:PORT moves all four "
    "(PORT, PORT+1, +2, +3)",
    "params": "--params-port (the profile's params_port) moves it; --bind tcp://HOST:PORT moves all four "
    "(PORT, PORT+1, +2, +3)",
}
"""How to choose another port for each broker socket (the CLI option, the profile key)."""


class BindError(RuntimeError):
    """A broker socket could not be bound. The message is one line: which port, whose, and how to choose others."""


class BrokerSockets(NamedTuple):
    control: zmq.Socket
    """ROUTER: hello/welcome, heartbeats, stats, status, snapshots, fleet messages."""
    trajectories: zmq.Socket
    """PULL: the actors' trajectories."""
    learners: zmq.Socket
    """ROUTER: the learner shards' credit and parameters in, trajectories out."""
    params: zmq.Socket
    """PUB: parameter versions to every actor."""
    ports: dict[str, int]
    """The bound port of each socket, by name."""


def bind_error(role: str, host: str, port: str, exc: zmq.ZMQError) -> str:
    """The one-line error of a socket that could not be bound: which port, whose, and how to choose another."""
    why = "is in use by another process" if exc.errno == errno.EADDRINUSE else f"cannot be bound ({exc.strerror})"
    return f"broker: port {port} on {host} (the {role} socket) {why}: {PORT_OPTIONS[role]}"


CONTROL_SNDHWM = 1000
"""Replies queued per control connection before more are dropped (counted control_unroutable): ZeroMQ's default,
said out loud. A parameter snapshot goes out in one burst of up to this many chunks, so it cannot be much
smaller; a peer that never reads its status replies is held to the status rates (membership.Limits) instead."""
LEARNERS_RCVHWM = 10_000
"""Messages read ahead per learner connection: past it libzmq stops reading that connection (TCP pushes back,
nothing is dropped); credit and parameter chunks are far fewer than this between two polls."""


def open_sockets(ctx: zmq.Context, c: BrokerConfig, auth: BrokerAuth | None = None) -> BrokerSockets:
    """Every socket made, configured and bound (CURVE servers of their ZAP domains when ``auth`` is given);
    ConfigError for a bad bind port, BindError for a port that is taken (the sockets made so far are closed
    first)."""
    host, port = split_endpoint(c.bind)
    # BrokerConfig checks only the tcp://HOST:PORT shape: name the bad setting, not a bare int() error.
    if port != "*" and not (port.isdigit() and 0 < int(port) < 65536):
        raise ConfigError(f"broker.bind port must be 1..65535 or *, got {c.bind!r}")
    made: list[zmq.Socket] = []

    def socket(kind: int, domain: str) -> zmq.Socket:
        sock = ctx.socket(kind)
        made.append(sock)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, c.max_message_bytes + P.MAX_HEADER_BYTES + 4096)
        if auth is not None:
            auth.serve(sock, domain)
        return sock

    control = socket(zmq.ROUTER, "control")
    control.setsockopt(zmq.ROUTER_MANDATORY, 1)
    control.setsockopt(zmq.SNDHWM, CONTROL_SNDHWM)
    trajectories = socket(zmq.PULL, "trajectories")
    trajectories.setsockopt(zmq.RCVHWM, c.trajectory_hwm)
    learners = socket(zmq.ROUTER, "learners")
    learners.setsockopt(zmq.ROUTER_MANDATORY, 1)
    learners.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a reconnecting shard reuses its identity
    learners.setsockopt(zmq.SNDHWM, 0)  # bounded by credit, not by HWM
    learners.setsockopt(zmq.RCVHWM, LEARNERS_RCVHWM)  # a full pipe pushes back over TCP: nothing is lost
    params = socket(zmq.PUB, "params")
    params.setsockopt(zmq.SNDHWM, c.params_hwm)
    base = None if port == "*" else int(port)
    plan = [
        ("control", control, base),
        ("trajectories", trajectories, c.trajectory_port),
        ("learners", learners, c.learner_port),
        ("params", params, c.params_port),
    ]
    ports: dict[str, int] = {}
    for offset, (name, sock, wanted) in enumerate(plan):
        port_text = str(wanted) if wanted else ("*" if base is None else str(base + offset))
        try:
            sock.bind(f"tcp://{host}:{port_text}")
        except zmq.ZMQError as exc:  # one line that says which port, whose, and how to choose others
            for made_sock in made:
                made_sock.close(linger=0)
            raise BindError(bind_error(name, host, port_text, exc)) from None
        ports[name] = int(sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
    return BrokerSockets(control, trajectories, learners, params, ports)


class Replies:
    """Messages out of one ROUTER socket (control, or learners) to a peer's identity, never blocking: a peer gone,
    or whose queue is full, is counted (``control_unroutable``) and skipped; it will reconnect or ask again."""

    def __init__(self, sock: zmq.Socket, counters: dict[str, int]) -> None:
        self.sock = sock
        self.counters = counters

    def send(self, identity: bytes, msg: P.Message) -> None:
        self.send_frames(identity, P.encode(msg))

    def send_frames(self, identity: bytes, frames: Sequence[Any]) -> None:
        try:  # io.send_frames: ~1.3 us a message where send_multipart takes ~8.5 (bench fleet's heartbeat pass)
            send_frames(self.sock, frames, NOBLOCK, prefix=identity)
        except zmq.ZMQError:
            self.counters["control_unroutable"] += 1
