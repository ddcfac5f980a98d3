"""BrokerLink: parameter bookkeeping (units) and the control conversation against a fake broker.

The fake broker is a ROUTER in the test process, so each test decides exactly what the link sees.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import zmq

from conftest import Bus, wait_for
from zddrl import protocol as P
from zddrl.transport.link import BrokerLink

WAIT_S = 10.0


def welcome(
    run_id: str = "run-a", params_port: int = 1, interval: float = 1.0, liveness: int = 3, peer_id: str = "actor-0"
) -> P.Welcome:
    return P.Welcome(
        peer_id=peer_id,
        run_id=run_id,
        run={} if run_id else None,
        ports={"trajectories": 2, "learners": 3, "params": params_port},
        heartbeat_interval_s=interval,
        heartbeat_liveness=liveness,
        max_message_bytes=1 << 20,
    )


def params(run_id: str, version: int, corrupt: bool = False) -> P.Parameters:
    flat = np.arange(8, dtype=np.float32) * (version + 1)
    digest = P.param_hash(flat)
    return P.Parameters(
        run_id=run_id,
        peer_id="learner-0",
        policy_version=version,
        param_hash=("0" * 16 if corrupt else digest),
        layout=[["w", "float32", [8], 0]],
        arrays={"flat": flat},
    )


def wire(msg: P.Message) -> P.Message:
    """What the link gets: the message encoded and decoded again (arrays are views over frames)."""
    return P.decode([bytes(f) for f in P.encode(msg)])


@pytest.fixture
def link() -> BrokerLink:
    """A link that is never started: its handlers are driven directly."""
    return BrokerLink("tcp://127.0.0.1:1", P.Hello(role="actor", peer_id="actor-0"))


# ------------------------------------------------------------------------------------------------
# Units: which parameters a link keeps
# ------------------------------------------------------------------------------------------------


def test_params_with_a_wrong_hash_are_rejected(link: BrokerLink) -> None:
    link.accept_welcome(welcome())
    link.accept_params(wire(params("run-a", 0, corrupt=True)))
    assert link.latest_params() is None and link.params_rejected == 1
    no_flat = P.Parameters(
        run_id="run-a",
        peer_id="l",
        policy_version=1,
        param_hash="x",
        layout=[],
        arrays={"other": np.zeros(2, np.float32)},
    )
    link.accept_params(wire(no_flat))
    assert link.latest_params() is None and link.params_rejected == 2
    link.accept_params(wire(params("run-a", 0)))
    assert link.latest_params().policy_version == 0


def test_latest_wins_never_an_older_version(link: BrokerLink) -> None:
    link.accept_welcome(welcome())
    held = -1
    for v in (2, 5, 3, 5, 1):
        link.accept_params(wire(params("run-a", v)))
        held = max(held, v)
        assert link.latest_params().policy_version == held
    assert link.latest_params().policy_version == 5 and link.params_rejected == 0


def test_params_before_a_welcome_or_of_another_run_are_ignored(link: BrokerLink) -> None:
    link.accept_params(wire(params("run-a", 0)))
    assert link.latest_params() is None
    link.accept_welcome(welcome("run-a"))
    link.accept_params(wire(params("run-b", 9)))
    assert link.latest_params() is None


def test_a_run_change_resets_the_latest_params(link: BrokerLink) -> None:
    link.accept_welcome(welcome("run-a"))
    link.accept_params(wire(params("run-a", 7)))
    generation = link.generation
    link.accept_welcome(welcome("run-b"))
    assert link.generation == generation + 1
    assert link.latest_params() is None, "versions of different runs must never be compared"
    link.accept_params(wire(params("run-a", 8)))  # late broadcast of the old run
    assert link.latest_params() is None
    link.accept_params(wire(params("run-b", 0)))
    assert link.latest_params().run_id == "run-b" and link.latest_params().policy_version == 0


def test_a_welcome_without_a_run_keeps_what_is_held(link: BrokerLink) -> None:
    """A restarted broker welcomes before the learner re-announces the run; the same run coming back
    must not let an older version in."""
    link.accept_welcome(welcome("run-a"))
    link.accept_params(wire(params("run-a", 7)))
    link.accept_welcome(welcome(""))
    link.accept_params(wire(params("run-a", 8)))  # no run at the broker: nothing is taken
    link.accept_welcome(welcome("run-a"))
    assert link.latest_params().policy_version == 7
    link.accept_params(wire(params("run-a", 3)))
    assert link.latest_params().policy_version == 7


def test_wait_params_returns_on_arrival_or_times_out(link: BrokerLink) -> None:
    link.accept_welcome(welcome())
    t0 = time.monotonic()
    assert link.wait_params(newer_than=-1, timeout_s=0.05) is None
    assert time.monotonic() - t0 < 2.0
    feeder = threading.Timer(0.05, lambda: link.accept_params(wire(params("run-a", 4))))
    feeder.start()
    try:
        got = link.wait_params(newer_than=3, timeout_s=WAIT_S)
    finally:
        feeder.join()
    assert got is not None and got.policy_version == 4
    assert link.wait_params(newer_than=4, timeout_s=0.01) is None


# ------------------------------------------------------------------------------------------------
# The control conversation, against a fake broker
# ------------------------------------------------------------------------------------------------


class FakeBroker(Bus):
    """A ROUTER (control) and PUB sockets bound on loopback, driven by the test."""

    def __init__(self) -> None:
        super().__init__()
        self.control = self._bind(zmq.ROUTER)

    def _bind(self, kind: int) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind("tcp://127.0.0.1:*")
        return sock

    @staticmethod
    def port(sock: zmq.Socket) -> int:
        return int(sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])

    def pub(self) -> zmq.Socket:
        return self._bind(zmq.PUB)

    @property
    def connect(self) -> str:
        return f"tcp://127.0.0.1:{self.port(self.control)}"

    def link(self, role: str = "actor", **kw: Any) -> BrokerLink:  # type: ignore[override]
        return super().link(self.connect, P.Hello(role=role, peer_id="actor-0"), **kw)

    def recv(self, timeout_s: float = WAIT_S, kind: type[P.Message] | None = None) -> tuple[bytes, P.Message]:
        """Next message (of ``kind``, skipping others) from any link."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            assert left > 0 and self.control.poll(int(left * 1000)), f"no {kind.__name__ if kind else 'message'}"
            identity, msg = P.split_routed(self.control.recv_multipart())
            msg = P.decode(msg)
            if kind is None or isinstance(msg, kind):
                return identity, msg

    def send(self, identity: bytes, msg: P.Message) -> None:
        self.control.send_multipart([identity, *P.encode(msg)])


@pytest.fixture
def fake() -> Iterator[FakeBroker]:
    f = FakeBroker()
    try:
        yield f
    finally:
        f.close()


def test_heartbeats_follow_the_welcomed_interval(fake: FakeBroker) -> None:
    link = fake.link()
    identity, hello = fake.recv(kind=P.Hello)
    assert hello.peer_id == "actor-0"
    fake.send(identity, welcome(interval=0.1, liveness=50))
    assert link.wait_welcome(WAIT_S) is not None
    t0 = time.monotonic()
    for _ in range(3):
        fake.recv(kind=P.Heartbeat)
    # On the default 1 s schedule the first beat alone would take up to 1 s.
    assert time.monotonic() - t0 < 0.9


def test_a_rehello_reject_makes_the_link_say_hello_again(fake: FakeBroker) -> None:
    link = fake.link()
    identity, _ = fake.recv(kind=P.Hello)
    fake.send(identity, welcome())
    assert link.wait_welcome(WAIT_S) is not None
    fake.send(identity, P.Reject(reason="unknown peer: send hello first", rehello=True))
    identity2, hello = fake.recv(kind=P.Hello)
    assert identity2 == identity and hello.peer_id == "actor-0"
    fake.send(identity, welcome())
    wait_for(lambda: link.generation == 2, WAIT_S, "the second welcome")


def test_a_silent_broker_makes_the_link_reconnect(fake: FakeBroker) -> None:
    link = fake.link()
    identity, _ = fake.recv(kind=P.Hello)
    fake.send(identity, welcome(interval=0.1, liveness=2))
    assert link.wait_welcome(WAIT_S) is not None
    # The fake broker now says nothing: after 0.2 s of silence the link opens a new connection.
    identity2, hello = fake.recv(kind=P.Hello)
    assert identity2 != identity and hello.peer_id == "actor-0"
    assert link.reconnects >= 1
    fake.send(identity2, welcome(interval=0.1, liveness=50))
    wait_for(lambda: link.generation == 2, WAIT_S, "the welcome after reconnecting")


def test_close_delivers_the_bye(fake: FakeBroker) -> None:
    link = fake.link()
    identity, _ = fake.recv(kind=P.Hello)
    fake.send(identity, welcome())
    assert link.wait_welcome(WAIT_S) is not None
    link.close("shutting down")
    assert not link.alive
    _, bye = fake.recv(kind=P.Bye)
    assert bye.peer_id == "actor-0" and bye.reason == "shutting down"


def test_stats_are_sent_through_the_link(fake: FakeBroker) -> None:
    link = fake.link()
    identity, _ = fake.recv(kind=P.Hello)
    fake.send(identity, welcome())
    link.send(P.Stats(peer_id="actor-0", role="actor", stats={"sps": 10.0}))
    _, stats = fake.recv(kind=P.Stats)
    assert stats.stats == {"sps": 10.0}


def publish_until_received(link: BrokerLink, pub: zmq.Socket, msg: P.Parameters) -> None:
    """PUB subscriptions take a moment to propagate: publish until the link holds the version."""
    deadline = time.monotonic() + WAIT_S
    while link.wait_params(newer_than=msg.policy_version - 1, timeout_s=0.05) is None:
        assert time.monotonic() < deadline, f"version {msg.policy_version} never reached the link"
        pub.send_multipart(P.encode(msg))


def test_subscription_follows_the_params_port_of_each_welcome(fake: FakeBroker) -> None:
    pub_a, pub_b = fake.pub(), fake.pub()
    link = fake.link(subscribe_params=True)
    identity, _ = fake.recv(kind=P.Hello)
    fake.send(identity, welcome(params_port=fake.port(pub_a)))
    publish_until_received(link, pub_a, params("run-a", 0))
    # The broker restarted with another params port and welcomed the same session again.
    fake.send(identity, welcome(params_port=fake.port(pub_b)))
    wait_for(lambda: link.generation == 2, WAIT_S, "the second welcome")
    publish_until_received(link, pub_b, params("run-a", 1))
    assert link.latest_params().policy_version == 1


def test_params_snapshots_on_the_control_socket_are_taken(fake: FakeBroker) -> None:
    link = fake.link(subscribe_params=True)
    identity, _ = fake.recv(kind=P.Hello)
    fake.send(identity, welcome(params_port=fake.port(fake.pub())))
    fake.send(identity, params("run-a", 3))  # the broker's snapshot right behind the welcome
    got = link.wait_params(newer_than=-1, timeout_s=WAIT_S)
    assert got is not None and got.policy_version == 3
    _, beat = fake.recv(kind=P.Heartbeat)
    assert beat.policy_version == 3, "heartbeats report the version held"
