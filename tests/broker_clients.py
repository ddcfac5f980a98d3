"""Test-side clients of a real `zddrl broker` process, for tests/broker/ and tests/transport/test_params.py.

Learner shards and actors join with a ``BrokerLink`` (hello, heartbeats) and talk data over their own
sockets (a DEALER whose identity is the peer id, a PUSH). Every wait is on a condition with a deadline.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from conftest import BrokerHandle, Bus, Procs, wait_for
from zddrl import protocol as P
from zddrl.broker.broker import Broker
from zddrl.config import BrokerConfig, Config, run_kind
from zddrl.keys import new_key
from zddrl.protocol.rules import BUS_KEYS
from zddrl.transport.status import request_status

WAIT_S = 10.0
"""Upper bound of any single wait; a healthy broker answers in milliseconds."""


def run_spec(**algo: Any) -> dict:
    """A real run spec, as a learner announces it (``Config.to_dict()``); ``algo``: keys of ``[algo]`` or of
    ``[bus]`` (``max_in_flight``, ``max_staleness``)."""
    kind = run_kind(algo.pop("mode")) if "mode" in algo else {}  # a run_kinds label: sync, async, impala, apex, sac
    dotted = {f"{'bus' if k in BUS_KEYS else 'algo'}.{k}": v for k, v in algo.items()}
    return Config().replace({**kind, **dotted}).to_dict()


def bus_of(run: dict | None) -> dict | None:
    """The hello's ``bus`` of a run spec, as the learner fills it from its config (learner/node.py)."""
    if run is None or "algo" not in run:
        return None
    return Config.from_dict(run).hello_bus()


def learner_hello(peer_id: str = "learner-0", run_id: str = "", run: dict | None = None, **fields: Any) -> P.Hello:
    """A learner's hello announcing ``run`` (with its ``bus``, as LearnerNode sends it, unless ``fields`` has one)."""
    fields.setdefault("bus", bus_of(run))
    return P.Hello(role="learner", peer_id=peer_id, run_id=run_id, run=run, **fields)


def trajectory(
    run_id: str, peer_id: str, seq: int, version: int = 0, nbytes: int = 32, **declared: np.ndarray
) -> P.Trajectory:
    """A one-step, one-env trajectory whose observation takes about ``nbytes``; its reward is ``seq``; with the run's
    ``declared`` arrays (docs/protocol.md section 7.1)."""
    f32 = np.float32
    arrays = {
        "obs": np.zeros((1, 1, max(nbytes // 4, 1)), f32),
        "actions": np.zeros((1, 1), np.int64),
        "logp": np.zeros((1, 1), f32),
        "values": np.zeros((1, 1), f32),
        "rewards": np.full((1, 1), seq, f32),
        "terminated": np.zeros((1, 1), bool),
        "truncated": np.zeros((1, 1), bool),
        "next_obs": np.zeros((1, max(nbytes // 4, 1)), f32),
        "next_value": np.zeros(1, f32),
        **declared,
    }
    return P.Trajectory(
        run_id=run_id, peer_id=peer_id, seq=seq, policy_version=version, param_hash="h", env_steps=1, arrays=arrays
    )


def parameters(run_id: str, version: int, peer_id: str = "learner-0") -> P.Parameters:
    flat = np.arange(16, dtype=np.float32) + version
    return P.Parameters(
        run_id=run_id,
        peer_id=peer_id,
        policy_version=version,
        param_hash=P.param_hash(flat),
        layout=[["w", "float32", [16], 0]],
        arrays={"flat": flat},
    )


class Shard:
    """A learner shard: control link (hello with role=learner) + DEALER (identity = peer id)."""

    def __init__(
        self,
        bus: Bus,
        broker: BrokerHandle,
        peer_id: str,
        run_id: str = "",
        run: dict | None = None,
        run_bus: dict | None = None,
    ):
        """``run_bus``: the hello's ``bus`` (default: as the learner fills it from ``run``)."""
        self.peer_id, self.run_id = peer_id, run_id
        hello = learner_hello(peer_id, run_id, run, **({"bus": run_bus} if run_bus is not None else {}))
        self.link = bus.link(broker.connect, hello)
        assert self.link.wait_welcome(WAIT_S) is not None, f"{peer_id}: no welcome"
        self.sock = bus.socket(zmq.DEALER, identity=peer_id.encode(), rcvhwm=0)
        self.sock.connect(self.link.endpoint("learners"))
        self.received: list[P.Message] = []

    def grant(self, n: int) -> None:
        self.sock.send_multipart(P.encode(P.Credit(peer_id=self.peer_id, credit=n)))

    def publish(self, version: int, run_id: str | None = None) -> P.Parameters:
        params = parameters(self.run_id if run_id is None else run_id, version, self.peer_id)
        self.sock.send_multipart(P.encode(params))
        return params

    def recv(self, timeout_ms: int = 0) -> P.Message | None:
        if not self.sock.poll(timeout_ms):
            return None
        return P.decode(self.sock.recv_multipart())

    def trajectories(self) -> list[P.Trajectory]:
        return [m for m in self.received if isinstance(m, P.Trajectory)]


class Pusher:
    """An actor: control link (hello with role=actor) + PUSH on the trajectory port."""

    def __init__(self, bus: Bus, broker: BrokerHandle, peer_id: str, sndhwm: int = 1000) -> None:
        self.peer_id = peer_id
        self.link = bus.link(broker.connect, P.Hello(role="actor", peer_id=peer_id, num_envs=2))
        assert self.link.wait_welcome(WAIT_S) is not None, f"{peer_id}: no welcome"
        self.sock = bus.socket(zmq.PUSH, sndhwm=sndhwm)
        self.sock.connect(self.link.endpoint("trajectories"))

    def send(self, frames: P.Message | list, timeout_ms: int = int(WAIT_S * 1000)) -> bool:
        """Send unless the socket stays unwritable (backpressure) for ``timeout_ms``."""
        if not self.sock.poll(timeout_ms, zmq.POLLOUT):
            return False
        self.sock.send_multipart(frames.encode() if isinstance(frames, P.Message) else frames, copy=False)
        return True


@contextmanager
def in_process_broker() -> Iterator[Broker]:
    """A broker object bound on random loopback ports and never run: for tests that fill its state by hand."""
    broker = Broker(BrokerConfig(bind="tcp://127.0.0.1:*"), zmq.Context())
    broker.bind()
    try:
        yield broker
    finally:
        broker.close()
        broker.ctx.term()


def status(broker: BrokerHandle, bus: Bus) -> dict:
    body = request_status(broker.connect, WAIT_S, bus.ctx)
    assert body is not None, "the broker did not answer a status request"
    return body


def counters(broker: BrokerHandle, bus: Bus) -> dict:
    return status(broker, bus)["broker"]


def cli(*args: str, timeout_s: float = 20.0) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "zddrl", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def collect(shards: list[Shard], until: int, regrant: bool = True, timeout_s: float = WAIT_S) -> None:
    """Receive on every shard (granting one credit back per message) until ``until`` trajectories arrived."""
    poller = zmq.Poller()
    for s in shards:
        poller.register(s.sock, zmq.POLLIN)
    deadline = time.monotonic() + timeout_s
    while sum(len(s.trajectories()) for s in shards) < until:
        if time.monotonic() > deadline:
            got = {s.peer_id: len(s.trajectories()) for s in shards}
            pytest.fail(f"timed out waiting for {until} trajectories, got {got}")
        events = dict(poller.poll(50))
        for s in shards:
            if s.sock in events:
                msg = s.recv()
                s.received.append(msg)
                if regrant and isinstance(msg, P.Trajectory):
                    s.grant(1)


def start_run(bus: Bus, broker: BrokerHandle, run_id: str = "run-a", **algo: Any) -> Shard:
    """First learner shard: announces the run and publishes version 0."""
    shard = Shard(bus, broker, "learner-0", run_id, run_spec(**algo))
    shard.publish(0)
    wait_for(lambda: counters(broker, bus)["policy_version"] == 0, WAIT_S, "version 0 to be published")
    return shard


class ProfiledBroker(BrokerHandle):
    """A real `zddrl broker` started with a profile (short heartbeats make expiry tests fast)."""

    def __init__(self, procs: Procs, tmp_path: Path, **settings: Any) -> None:
        super().__init__(procs, tmp_path)
        self.profile = tmp_path / "broker.toml"
        self.profile.write_text("[broker]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in settings.items()))

    def start(self, *options: str) -> ProfiledBroker:
        super().start("--profile", str(self.profile), *options)
        return self


def recv_control(sock: zmq.Socket, timeout_ms: int = int(WAIT_S * 1000)) -> P.Message:
    assert sock.poll(timeout_ms), "no message from the broker"
    return P.decode(sock.recv_multipart())


def relay_key_dirs(
    root: Path, where: Path, relay: str = "r", broker: str = "edge", actor: str = "a"
) -> tuple[Path, Path]:
    """The key directories of a relay host and of one of its actor hosts, laid out as docs/security.md says, under
    ``where``: the relay's holds its own broker pair ``broker``, the root's public key (the only broker key of
    ``root``), its relay key ``relay`` (whose public file the root gets), its actors' public key and the learners'
    pins; the actor host's holds the relay's broker public key, its own key ``actor`` and the pins. Nothing
    secret leaves the directory it was made in. Returns (relay's directory, actor host's directory)."""
    relay_dir, actor_dir = where / "relay-keys", where / "actor-keys"
    new_key(relay_dir, "broker", broker)
    (root_public,) = (root / "broker").glob("*.key")
    shutil.copy(root_public, relay_dir / "broker")
    new_key(relay_dir, "relay", relay)
    (root / "relays").mkdir(exist_ok=True)
    shutil.copy(relay_dir / "relays" / f"{relay}.key", root / "relays")
    new_key(actor_dir, "actor", actor)
    (relay_dir / "actors").mkdir(exist_ok=True)
    shutil.copy(actor_dir / "actors" / f"{actor}.key", relay_dir / "actors")
    (actor_dir / "broker").mkdir()
    shutil.copy(relay_dir / "broker" / f"{broker}.key", actor_dir / "broker")
    for host in (relay_dir, actor_dir):
        (host / "learners").mkdir(exist_ok=True)
        for pin in (root / "learners").glob("*.sign.pub"):
            shutil.copy(pin, host / "learners")
    return relay_dir, actor_dir


@contextmanager
def running(broker: Broker) -> Iterator[str]:
    """``broker`` bound and serving on a thread; yields its control endpoint."""
    broker.bind()
    stop = threading.Event()
    thread = threading.Thread(target=broker.run, args=(stop,), daemon=True)
    thread.start()
    try:
        yield f"tcp://127.0.0.1:{broker.ports['control']}"
    finally:
        stop.set()
        thread.join(timeout=WAIT_S)
        broker.close()
