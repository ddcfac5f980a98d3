"""One hello per reconnection, and a fallback list left early when the transport tells (transport.session.Session).

The rules on their own, on a made-up clock; then a link against fake brokers on loopback: a burst of "send hello
first" rejects gets one hello, a broker that closed its connection is left after one heartbeat interval, and one
that comes back within the interval keeps the link.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import zmq
from test_client import WAIT_S, FakeBroker, welcome

from conftest import Bus, wait_for
from zddrl import protocol as P
from zddrl.broker.uplink import Uplink
from zddrl.transport.fallback import Brokers
from zddrl.transport.session import HEARTBEAT_INTERVAL_S, HEARTBEAT_LIVENESS, SILENT, Session

REHELLO = P.Reject(reason="unknown peer: send hello first", rehello=True)

# ------------------------------------------------------------------------------------------------
# The rules (a made-up clock)
# ------------------------------------------------------------------------------------------------


def test_a_burst_of_rejects_gets_one_hello_and_the_next_reconnection_one_more() -> None:
    s = Session(0.0, fallback=False)  # its hello went out at 0
    assert [s.wants_hello(t) for t in (0.1, 0.2, 0.3)] == [False, False, False], "the session's own hello is on its way"
    s.welcomed(welcome(interval=2.0, liveness=5), 0.4)
    # The broker restarts: every heartbeat queued meanwhile comes back rejected, in one burst.
    assert [s.wants_hello(20.0 + i * 0.01) for i in range(5)] == [True, False, False, False, False]
    s.welcomed(welcome(interval=2.0, liveness=5), 20.1)
    assert s.wants_hello(40.0), "a broker that lost us again is answered again"


def test_a_hello_unanswered_for_an_interval_was_lost_and_the_next_reject_gets_another() -> None:
    s = Session(0.0, fallback=False)
    s.welcomed(welcome(interval=2.0, liveness=5), 0.1)
    assert s.wants_hello(10.0)
    assert not s.wants_hello(11.9)
    assert s.wants_hello(12.0), "no welcome for an interval: that hello went to a dying broker"


def test_silence_ends_a_session_after_interval_times_liveness() -> None:
    s = Session(0.0, fallback=True)
    assert s.ended(HEARTBEAT_INTERVAL_S * HEARTBEAT_LIVENESS) == ""
    assert s.ended(HEARTBEAT_INTERVAL_S * HEARTBEAT_LIVENESS + 0.01) == SILENT
    s.welcomed(welcome(interval=2.0, liveness=5), 1.0)
    s.heard(3.0)
    assert s.ended(12.9) == "" and s.ended(13.1) == SILENT


def test_a_connection_down_for_an_interval_ends_the_session_only_with_a_fallback_list() -> None:
    alone, listed = Session(0.0, fallback=False), Session(0.0, fallback=True)
    for s in (alone, listed):
        s.welcomed(welcome(interval=2.0, liveness=5), 0.0)
        s.connection(False, 1.0)  # the broker's process died: its kernel closed the connection
        s.heard(1.5)  # something it sent before dying, read only now: no sign that the connection is back
        s.connection(False, 2.0)  # the reconnects are refused: still down since 1.0
    assert listed.ended(2.9) == "" and listed.ended(3.0) == "no connection to it for 2.0 s"
    assert alone.ended(3.0) == "" and alone.ended(11.4) == "", "one broker: its DEALER reconnects by itself"
    assert alone.ended(11.6) == SILENT


def test_a_connection_back_within_the_interval_keeps_the_session() -> None:
    s = Session(0.0, fallback=True)
    s.welcomed(welcome(interval=2.0, liveness=5), 0.0)
    s.connection(False, 1.0)
    s.connection(None, 1.5)  # nothing new
    s.connection(True, 2.5)  # a broker restarted in place: the handshake succeeded again
    assert s.ended(3.5) == "" and s.ended(10.0) == ""


def test_the_interval_of_the_broker_heartbeat_sets_the_beat_and_the_deadline() -> None:
    s = Session(0.0, fallback=False)
    s.welcomed(welcome(interval=1.0, liveness=3), 0.0)
    assert not s.beat_due(0.5) and s.beat_due(1.0) and not s.beat_due(1.5)
    s.retimed(4.0, 1.6)  # the fleet grew
    assert s.ended(1.6 + 11.9) == "" and s.ended(1.6 + 12.1) == SILENT
    assert s.beat_due(2.01), "the beat already due on the old interval"
    assert not s.beat_due(5.9) and s.beat_due(6.02), "then every 4 s"


def test_the_line_that_moves_on_says_why_beyond_silence() -> None:
    brokers = Brokers("tcp://a:1,tcp://b:2")
    brokers.next(served=True)
    line = brokers.moving("tcp://a:1", 0.0, "no connection to it for 2.0 s")
    assert line == "broker at tcp://a:1 silent; moving to the broker at tcp://b:2 (no connection to it for 2.0 s)"


def test_a_relay_answers_a_burst_of_rejects_with_one_hello_too() -> None:
    ctx = zmq.Context()
    try:
        up = Uplink("tcp://127.0.0.1:1", P.Hello(role="relay", peer_id="relay-x"), ctx)
        up.open(0.0)
        assert not up.rehello(0.1), "its first hello is on its way"
        up.welcomed(welcome(interval=1.0, liveness=5), 0.2)
        assert [up.rehello(5.0 + i / 100) for i in range(4)] == [True, False, False, False]
        assert up.hellos == 2
        up.close(6.0)
    finally:
        ctx.destroy(linger=0)


# ------------------------------------------------------------------------------------------------
# A link against fake brokers
# ------------------------------------------------------------------------------------------------


@pytest.fixture
def fakes() -> Iterator[tuple[FakeBroker, FakeBroker]]:
    a, b = FakeBroker(), FakeBroker()
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def hellos_within(fake: FakeBroker, seconds: float) -> int:
    """Hellos ``fake`` receives within ``seconds`` (other messages skipped)."""
    n, deadline = 0, time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        if fake.control.poll(int(left * 1000)):
            _, msg = P.split_routed(fake.control.recv_multipart())
            n += isinstance(P.decode(msg), P.Hello)
    return n


def bound(sock: zmq.Socket, endpoint: str) -> bool:
    try:
        sock.bind(endpoint)
        return True
    except zmq.ZMQError:
        return False


def test_the_link_answers_a_burst_of_rejects_with_one_hello(fakes: tuple[FakeBroker, FakeBroker]) -> None:
    fake, _ = fakes
    link = fake.link()
    identity, _ = fake.recv(kind=P.Hello)
    fake.send(identity, welcome(interval=1.0, liveness=50))
    wait_for(lambda: link.generation == 1, WAIT_S, "the welcome")
    for _ in range(5):  # what a restarted broker answers to five queued heartbeats
        fake.send(identity, REHELLO)
    assert hellos_within(fake, 0.8) == 1
    assert link.hellos == 2 and link.hellos_held == 4
    fake.send(identity, welcome(interval=1.0, liveness=50))
    wait_for(lambda: link.generation == 2, WAIT_S, "the second welcome")
    fake.send(identity, REHELLO)  # the broker lost us once more: a new reconnection, a new hello
    assert hellos_within(fake, 0.5) == 1 and link.hellos == 3


def test_a_list_is_left_one_interval_after_the_connection_closed(fakes: tuple[FakeBroker, FakeBroker]) -> None:
    a, b = fakes
    link = Bus.link(a, f"{a.connect},{b.connect}", P.Hello(role="actor", peer_id="actor-0"))
    identity, _ = a.recv(kind=P.Hello)
    a.send(identity, welcome(interval=0.3, liveness=100))  # silence alone would take 30 s
    wait_for(lambda: link.generation == 1, WAIT_S, "a's welcome")
    a.control.close(linger=0)  # as a killed broker's kernel does
    closed = time.monotonic()
    b.recv(timeout_s=WAIT_S, kind=P.Hello)
    took = time.monotonic() - closed
    assert 0.3 <= took < 2.0, f"moved to b {took:.2f} s after a's connection closed (one interval: 0.3 s)"
    assert link.connect == b.connect


def test_a_broker_back_within_the_interval_keeps_the_link(fakes: tuple[FakeBroker, FakeBroker]) -> None:
    a, b = fakes
    link = Bus.link(a, f"{a.connect},{b.connect}", P.Hello(role="actor", peer_id="actor-0"))
    identity, _ = a.recv(kind=P.Hello)
    a.send(identity, welcome(interval=2.0, liveness=100))
    wait_for(lambda: link.generation == 1, WAIT_S, "a's welcome")
    endpoint = a.connect
    a.control.close(linger=0)
    a.control = a.ctx.socket(zmq.ROUTER)  # restarted in place, on the same port, well within the interval
    a.control.setsockopt(zmq.LINGER, 0)
    wait_for(lambda: bound(a.control, endpoint), 1.0, "the port to be free again")  # ZeroMQ closes asynchronously
    a.recv(timeout_s=WAIT_S, kind=P.Heartbeat)  # the link's DEALER reconnected by itself
    assert not b.control.poll(2500), "the link moved to b although a came back within the interval"
    assert link.connect == endpoint and link.reconnects == 0
