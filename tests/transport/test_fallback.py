"""Client fallback lists: ``--connect tcp://A:5555,tcp://B:5555`` parsed in one place (config.split_endpoints),
tried round robin by the link (fallback.Brokers) with the capped backoff between full passes, data endpoints on
the host of the broker that welcomed the link, and `zddrl status` asking each broker in turn."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import zmq
from click.testing import CliRunner
from test_client import WAIT_S, FakeBroker, params, welcome

from broker_clients import trajectory
from conftest import Bus, wait_for
from zddrl import protocol as P
from zddrl.actor.host import ActorHost
from zddrl.actor.rollout import Collected
from zddrl.cli import main
from zddrl.config import ConfigError, split_endpoints
from zddrl.proc import free_ports
from zddrl.transport.fallback import RECONNECT_INITIAL_S, RECONNECT_MAX_S, Brokers
from zddrl.transport.link import BrokerLink
from zddrl.transport.status import request_status

# ------------------------------------------------------------------------------------------------
# Parsing: config.split_endpoints
# ------------------------------------------------------------------------------------------------


def test_one_endpoint_is_a_list_of_one() -> None:
    assert split_endpoints("tcp://10.0.0.1:5555") == ("tcp://10.0.0.1:5555",)


def test_a_fallback_list_keeps_its_order_and_drops_blanks_around_entries() -> None:
    assert split_endpoints("tcp://b:6000, tcp://a:5555 ,tcp://[::1]:7000") == (
        "tcp://b:6000",
        "tcp://a:5555",
        "tcp://[::1]:7000",
    )


@pytest.mark.parametrize(
    ("connect", "says"),
    [
        ("", "empty entry"),
        ("tcp://a:5555,", "empty entry"),
        ("tcp://a:5555,,tcp://b:5555", "empty entry"),
        ("a:5555", "must be tcp://HOST:PORT"),
        ("tcp://a:5555,udp://b:5555", "must be tcp://HOST:PORT"),
        ("tcp://a", "must be tcp://HOST:PORT"),
        ("tcp://:5555", "names no host"),
        ("tcp://a:*", "the port must be 1..65535"),
        ("tcp://a:0", "the port must be 1..65535"),
        ("tcp://a:65536", "the port must be 1..65535"),
        ("tcp://a:55x", "the port must be 1..65535"),
        ("tcp://a:5555,tcp://b:5555,tcp://a:5555", "listed twice"),
    ],
)
def test_a_bad_entry_is_refused_with_its_reason(connect: str, says: str) -> None:
    with pytest.raises(ConfigError, match=says.replace("*", r"\*").replace(".", r"\.")):
        split_endpoints(connect)


@pytest.mark.parametrize("command", ["actor", "status"])
def test_the_cli_says_which_entry_is_bad_in_one_line(command: str) -> None:
    result = CliRunner().invoke(main, [command, "--connect", "tcp://a:5555,tcp://b"])
    assert result.exit_code == 2
    errors = [line for line in result.output.splitlines() if line.startswith("Error")]
    assert errors == ["Error: Invalid value for '--connect': endpoint 'tcp://b' must be tcp://HOST:PORT"]


def test_the_cli_checks_zddrl_connect_too() -> None:
    result = CliRunner().invoke(main, ["status"], env={"ZDDRL_CONNECT": "tcp://a:5555,tcp://a:5555"})
    assert result.exit_code == 2 and "listed twice" in result.output


# ------------------------------------------------------------------------------------------------
# Which broker next: fallback.Brokers
# ------------------------------------------------------------------------------------------------


def test_one_broker_keeps_the_reconnect_backoff_of_section_5_2() -> None:
    brokers = Brokers("tcp://a:5555")
    waits = [brokers.next(served=False) for _ in range(7)]
    assert waits == [0.5, 1.0, 2.0, 4.0, RECONNECT_MAX_S, RECONNECT_MAX_S, RECONNECT_MAX_S]
    assert brokers.next(served=True) == RECONNECT_INITIAL_S
    assert brokers.next(served=False) == 0.5
    assert brokers.current == "tcp://a:5555"
    assert brokers.moving("tcp://a:5555", 0.5) == "broker at tcp://a:5555 silent; reconnecting in 0.50 s"


def test_a_list_is_tried_round_robin_with_the_backoff_between_full_passes() -> None:
    brokers = Brokers("tcp://a:1,tcp://b:2,tcp://c:3")
    tried = []
    for _ in range(6):  # nobody answers: two full passes, a wait after each
        wait = brokers.next(served=False)
        tried.append((brokers.current, wait))
    assert tried == [
        ("tcp://b:2", 0.0),
        ("tcp://c:3", 0.0),
        ("tcp://a:1", 0.5),
        ("tcp://b:2", 0.0),
        ("tcp://c:3", 0.0),
        ("tcp://a:1", 1.0),
    ]


def test_a_pass_begins_at_the_broker_that_welcomed_us_last() -> None:
    brokers = Brokers("tcp://a:1,tcp://b:2,tcp://c:3")
    assert (brokers.next(served=True), brokers.current) == (0.0, "tcp://b:2")  # a died: b at once
    assert (brokers.next(served=True), brokers.current) == (0.0, "tcp://c:3")  # b served, then died: c at once
    assert (brokers.next(served=False), brokers.current) == (0.0, "tcp://a:1")
    # Back at b, which welcomed us in this pass: the short wait, as after a welcome with one broker.
    assert (brokers.next(served=False), brokers.current) == (RECONNECT_INITIAL_S, "tcp://b:2")
    assert brokers.endpoint("params", {"params": 7}) == "tcp://b:7", "the data sockets are on the current one's host"
    line = brokers.moving("tcp://a:1", RECONNECT_INITIAL_S)
    assert line == "broker at tcp://a:1 silent; moving to the broker at tcp://b:2 in 0.25 s"
    brokers.next(served=False)
    assert brokers.moving("tcp://b:2", 0.0) == "broker at tcp://b:2 silent; moving to the broker at tcp://c:3"


# ------------------------------------------------------------------------------------------------
# The link moves to the next broker (two fake brokers)
# ------------------------------------------------------------------------------------------------


def link_to(fake: FakeBroker, connect: str, role: str = "actor") -> BrokerLink:
    """A started link to ``connect`` (a list), owned by ``fake``'s bus."""
    hello = P.Hello(role=role, peer_id="peer-0", run_id="run-a" if role == "learner" else "")
    return Bus.link(fake, connect, hello)


@pytest.fixture
def fakes() -> Iterator[tuple[FakeBroker, FakeBroker]]:
    a, b = FakeBroker(), FakeBroker()
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def test_a_silent_broker_makes_the_link_move_to_the_next_one(fakes: tuple[FakeBroker, FakeBroker]) -> None:
    a, b = fakes
    # b by another name of the same host: the data endpoints must follow the host of the broker that welcomed.
    b_connect = b.connect.replace("127.0.0.1", "localhost")
    link = link_to(a, f"{a.connect},{b_connect}", role="learner")
    identity, hello = a.recv(kind=P.Hello)
    a.send(identity, welcome(interval=0.1, liveness=2))
    wait_for(lambda: link.generation == 1, WAIT_S, "a's welcome")
    assert link.endpoint("learners") == "tcp://127.0.0.1:3"
    # a falls silent: after 0.2 s the link says hello to b (the same hello: a learner's carries its run).
    identity_b, hello_b = b.recv(kind=P.Hello)
    assert hello_b == hello and link.connect == b_connect and link.reconnects == 1
    b.send(identity_b, welcome(interval=0.1, liveness=50))
    wait_for(lambda: link.generation == 2, WAIT_S, "b's welcome")
    assert link.endpoint("learners") == "tcp://localhost:3"
    b.recv(kind=P.Heartbeat)


def test_a_link_comes_back_to_the_first_broker_after_a_full_pass(fakes: tuple[FakeBroker, FakeBroker]) -> None:
    a, b = fakes
    dead = f"tcp://127.0.0.1:{free_ports(1)[0]}"
    link = link_to(a, f"{dead},{a.connect}")
    # Nothing at the first: after 3 s (the default silence before any welcome) the link tries a.
    identity, _ = a.recv(timeout_s=WAIT_S, kind=P.Hello)
    a.send(identity, welcome(interval=0.1, liveness=50))
    wait_for(lambda: link.generation == 1, WAIT_S, "a's welcome")
    assert link.connect == a.connect


# ------------------------------------------------------------------------------------------------
# zddrl status asks each broker in turn
# ------------------------------------------------------------------------------------------------


def answer_status(fake: FakeBroker, body: dict) -> threading.Thread:
    def serve() -> None:
        identity, _ = fake.recv(kind=P.StatusRequest)
        fake.send(identity, P.Status(body=body))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


def test_status_asks_each_broker_in_turn_until_one_answers(fakes: tuple[FakeBroker, FakeBroker]) -> None:
    a, b = fakes
    dead = f"tcp://127.0.0.1:{free_ports(1)[0]}"
    thread = answer_status(b, {"broker": {"host": "b"}})
    assert request_status(f"{dead},{b.connect},{a.connect}", 0.5, a.ctx) == {"broker": {"host": "b"}}
    thread.join(WAIT_S)
    assert not a.control.poll(100), "a broker after the one that answered is not asked"
    assert request_status(dead, 0.2, a.ctx) is None


def test_status_with_a_list_fails_only_when_no_broker_answers() -> None:
    ctx = zmq.Context()
    try:
        ports = free_ports(2)
        assert request_status(",".join(f"tcp://127.0.0.1:{p}" for p in ports), 0.2, ctx) is None
    finally:
        ctx.destroy(linger=0)


# ------------------------------------------------------------------------------------------------
# An actor's send does not wait forever on a broker gone for good
# ------------------------------------------------------------------------------------------------


def test_a_send_stuck_on_a_broker_gone_for_good_ends_at_the_next_welcome() -> None:
    """The PUSH to a killed broker keeps its queue, full, forever: the send must give up once another broker
    of the list welcomed the link (the caller then opens a PUSH to the new one)."""
    ctx = zmq.Context()
    try:
        link = BrokerLink("tcp://127.0.0.1:1,tcp://127.0.0.1:2", P.Hello(role="actor", peer_id="actor-0"), context=ctx)
        link.accept_welcome(welcome())  # never started: the test plays the link thread
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.SNDHWM, 1)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(f"tcp://127.0.0.1:{free_ports(1)[0]}")  # nobody there, as after a kill -9
        for _ in range(100):
            if not push.poll(50, zmq.POLLOUT):
                break
            push.send(b"queued for a broker that never reads it", zmq.NOBLOCK)
        assert not push.poll(50, zmq.POLLOUT), "the queue to the dead broker should be full"
        host = ActorHost("tcp://127.0.0.1:1", 0, context=ctx)
        rollout = Collected(trajectory("run-a", "actor-0", 0).arrays, [], [])
        stop = threading.Event()
        args = (link, push, "run-a", params("run-a", 0), rollout, 1, stop, 100)
        sender = threading.Thread(target=host._send, args=args, daemon=True)
        sender.start()
        sender.join(0.5)
        assert sender.is_alive(), "nothing could be sent: the send waits"
        link.accept_welcome(welcome())  # the next broker of the list welcomed the link
        sender.join(WAIT_S)
        stuck = sender.is_alive()
        stop.set()
        assert not stuck, "the send kept waiting on the dead broker's queue after a new welcome"
        push.close(linger=0)
    finally:
        ctx.destroy(linger=0)
