"""Test-side clients of a real `zddrl broker` for the contract tests (broker/test_fleet.py, broker/test_contract.py,
protocol/test_status_doc.py): raw pyzmq sockets that speak docs/protocol.md, so that every message the broker
sends can be seen and counted. Every wait is on a condition with a deadline (conftest.wait_for)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
import zmq

from broker_clients import WAIT_S, learner_hello, run_spec
from conftest import BrokerHandle, Bus
from zddrl import protocol as P


def trajectory(run_id: str, peer_id: str, seq: int, version: int = 0) -> P.Trajectory:
    """A valid one-step, one-env trajectory."""
    f32 = np.float32
    arrays = {
        "obs": np.zeros((1, 1, 2), f32),
        "actions": np.zeros((1, 1), np.int64),
        "logp": np.zeros((1, 1), f32),
        "values": np.zeros((1, 1), f32),
        "rewards": np.full((1, 1), seq, f32),
        "terminated": np.zeros((1, 1), bool),
        "truncated": np.zeros((1, 1), bool),
        "next_obs": np.zeros((1, 2), f32),
        "next_value": np.zeros(1, f32),
    }
    return P.Trajectory(
        run_id=run_id, peer_id=peer_id, seq=seq, policy_version=version, param_hash="0" * 16, env_steps=1, arrays=arrays
    )


def wire(msg: P.Message) -> list[bytes]:
    return [bytes(P.flat_buffer(f)) for f in P.encode(msg)]


class Control:
    """A client's control DEALER by hand: hello, then every message the broker sends, kept in order."""

    def __init__(self, bus: Bus, broker: BrokerHandle, hello: P.Hello) -> None:
        self.sock = bus.socket(zmq.DEALER)
        self.sock.connect(broker.connect)
        self.received: list[P.Message] = []
        self.send(hello)
        self.welcome = self.next(P.Welcome)

    def send(self, msg: P.Message | list) -> None:
        self.sock.send_multipart(msg.encode() if isinstance(msg, P.Message) else msg)

    def poll(self, timeout_ms: int) -> P.Message | None:
        if not self.sock.poll(timeout_ms):
            return None
        msg = P.decode(self.sock.recv_multipart())
        self.received.append(msg)
        return msg

    def next(self, kind: type, timeout_s: float = WAIT_S) -> Any:
        """The next message of ``kind`` (others are kept in ``received``)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            msg = self.poll(50)
            if isinstance(msg, kind):
                return msg
        pytest.fail(f"no {kind.KIND} from the broker within {timeout_s} s")

    def of(self, kind: type) -> list[Any]:
        return [m for m in self.received if isinstance(m, kind)]

    def credits(self) -> int:
        return sum(m.credit for m in self.of(P.Credit))

    def heartbeat(self, peer_id: str, version: int) -> None:
        self.send(P.Heartbeat(peer_id=peer_id, policy_version=version))


class Learner:
    """A learner shard by hand: a control DEALER (hello with the run) and a data DEALER (identity = peer id)."""

    def __init__(
        self, bus: Bus, broker: BrokerHandle, peer_id: str = "learner-0", run_id: str = "run-a", run: dict | None = None
    ) -> None:
        self.peer_id, self.run_id = peer_id, run_id
        self.control = Control(bus, broker, learner_hello(peer_id, run_id, run_spec() if run is None else run))
        self.data = bus.socket(zmq.DEALER, identity=peer_id.encode(), rcvhwm=0)
        self.data.connect(f"tcp://127.0.0.1:{self.control.welcome.ports['learners']}")

    def send(self, msg: P.Message | list) -> None:
        self.data.send_multipart(msg.encode() if isinstance(msg, P.Message) else msg)

    def grant(self, n: int) -> None:
        self.send(P.Credit(peer_id=self.peer_id, credit=n))

    def trajectories(self, n: int, timeout_s: float = WAIT_S) -> list[P.Trajectory]:
        """The next ``n`` trajectories forwarded to this shard."""
        got, deadline = [], time.monotonic() + timeout_s
        while len(got) < n:
            assert time.monotonic() < deadline, f"only {len(got)} of {n} trajectories arrived"
            if self.data.poll(50):
                msg = P.decode(self.data.recv_multipart())
                if isinstance(msg, P.Trajectory):
                    got.append(msg)
        return got


def params_port(broker: BrokerHandle) -> int:
    return broker.bound_ports["params"]
