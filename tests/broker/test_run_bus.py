"""The bus is blind to training: what a broker and its relays know of a run is the learner hello's ``bus``
(docs/protocol.md section 5.1), never the run spec, which they pass on untouched.

In-process brokers fed control messages by hand (``Broker.handle_control``) and a relay whose upstream is a bare
ROUTER socket driven by the test (``Upstream.serve``): no loop, no subprocess.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import zmq

from broker_clients import WAIT_S, in_process_broker, learner_hello, run_spec
from conftest import Bus, wait_for
from zddrl import protocol as P
from zddrl.broker.broker import Broker
from zddrl.config import BrokerConfig
from zddrl.protocol.rules import RunBus, bus_refusal, run_bus

ASYNC_BUS = {"sync": False, "max_staleness": 3, "max_in_flight": 8}


def welcomes(b: Broker) -> list[tuple[bytes, P.Welcome]]:
    """The broker's welcomes from now on, recorded instead of sent (the identities are made up)."""
    sent: list[tuple[bytes, P.Welcome]] = []

    def record(identity: bytes, frames: list) -> None:
        msg = P.decode(frames)
        if isinstance(msg, P.Welcome):
            sent.append((identity, msg))

    b.replies.send_frames = record  # type: ignore[method-assign]
    return sent


def test_the_bus_field_has_exact_keys_and_bounds() -> None:
    assert bus_refusal(None) == "" and run_bus(None) == RunBus(sync=True, max_staleness=0, max_in_flight=2)
    assert bus_refusal(ASYNC_BUS) == "" and run_bus(ASYNC_BUS).staleness == 3
    assert run_bus({**ASYNC_BUS, "sync": True}).staleness == 0, "sync: only the newest version passes"
    assert RunBus(False, 3, 8).to_wire() == ASYNC_BUS
    for bad in (
        {"sync": True},
        {**ASYNC_BUS, "extra": 1},
        {**ASYNC_BUS, "sync": 1},
        {**ASYNC_BUS, "max_staleness": -1},
        {**ASYNC_BUS, "max_staleness": True},
        {**ASYNC_BUS, "max_in_flight": 0},
        {**ASYNC_BUS, "max_in_flight": 2.0},
    ):
        assert bus_refusal(bad), bad
    welcome = P.Welcome(
        peer_id="a", run_id="r", run={}, ports={}, heartbeat_interval_s=1.0, heartbeat_liveness=3,
        max_message_bytes=1 << 20, bus={**ASYNC_BUS, "max_in_flight": 0},
    )  # fmt: skip
    with pytest.raises(P.ProtocolError, match="welcome: bus: max_in_flight"):
        P.decode(P.encode(welcome))


def test_the_broker_goes_by_the_bus_and_passes_the_run_spec_on_unread() -> None:
    with in_process_broker() as b:
        sent = welcomes(b)
        spec = {"algo": [1, 2], "anything": {"at": "all"}}  # no algo table the broker could read
        hello = P.Hello(role="learner", peer_id="learner-0", run_id="run-a", run=spec, bus=ASYNC_BUS)
        b.handle_control(b"L", P.encode(hello))
        run = b.current
        assert (run.run_id, run.spec, run.bus) == ("run-a", spec, run_bus(ASYNC_BUS))
        assert (run.staleness, run.credit_batch) == (3, 4) and b.health.stuck_versions == 3
        b.handle_control(b"A", P.encode(P.Hello(role="actor", peer_id="actor-0")))
        welcome = sent[-1][1]
        assert sent[-1][0] == b"A" and welcome.run == spec and welcome.bus == ASYNC_BUS
        assert b.counters["control_malformed"] == 0


def test_a_hello_without_bus_gets_the_defaults_and_every_welcome_says_them() -> None:
    with in_process_broker() as b:
        sent = welcomes(b)
        b.handle_control(b"A", P.encode(P.Hello(role="actor", peer_id="actor-0")))
        assert sent[-1][1].bus is None, "no run, no bus"
        b.handle_control(b"L", P.encode(P.Hello(role="learner", peer_id="learner-0", run_id="run-a", run={})))
        assert (b.current.staleness, b.current.credit_batch) == (0, 1)
        assert sent[-1][1].bus == RunBus().to_wire(), "the actor, welcomed into the run: the defaults, filled in"
        b.handle_control(b"L2", P.encode(learner_hello("learner-1", "run-b", run_spec(mode="impala"))))
        assert b.current.bus == RunBus(sync=False, max_staleness=4, max_in_flight=2)


def test_a_malformed_bus_is_refused_with_a_reason_and_the_run_stays() -> None:
    with in_process_broker() as b:
        b.handle_control(b"L", P.encode(learner_hello("learner-0", "run-a", run_spec())))
        rejects: list[P.Reject] = []
        b.replies.send = lambda identity, msg: rejects.append(msg)  # type: ignore[method-assign,assignment,misc]
        bad = P.Hello(role="learner", peer_id="z", run_id="run-b", run={}, bus={**ASYNC_BUS, "max_staleness": -2})
        b.handle_control(b"Z", P.encode(bad))
        assert b.current.run_id == "run-a" and b.counters["control_malformed"] == 1 and "z" not in b.members
        assert rejects and rejects[0].reason.startswith(P.REFUSED_PREFIX + "hello: bus: max_staleness")


@pytest.fixture
def relay_and_upstream(bus: Bus) -> Iterator[tuple[Broker, zmq.Socket]]:
    upstream = bus.socket(zmq.ROUTER)
    port = upstream.bind_to_random_port("tcp://127.0.0.1")
    relay = Broker(BrokerConfig(bind="tcp://127.0.0.1:*", upstream=f"tcp://127.0.0.1:{port}"))
    relay.bind()
    try:
        yield relay, upstream
    finally:
        relay.close()


def test_a_relay_reads_the_bus_of_its_upstreams_welcome(relay_and_upstream: tuple[Broker, zmq.Socket]) -> None:
    relay, upstream = relay_and_upstream
    side = relay.upstream
    assert side is not None
    side.serve({}, time.monotonic())  # the session opens: a hello goes up
    assert upstream.poll(int(WAIT_S * 1000))
    identity = upstream.recv_multipart()[0]
    ports = {"trajectories": 1, "learners": 2, "params": 3}

    def welcome(bus: dict) -> list:
        msg = P.Welcome(
            peer_id="relay", run_id="run-a", run={"algo": "opaque"}, ports=ports, heartbeat_interval_s=1.0,
            heartbeat_liveness=3, max_message_bytes=1 << 20, bus=bus,
        )  # fmt: skip
        return [identity, *P.encode(msg)]

    control = side.uplink.control
    assert control is not None
    upstream.send_multipart(welcome({**ASYNC_BUS, "sync": "no"}))  # refused by decode: counted, the run not taken
    upstream.send_multipart(welcome(ASYNC_BUS))
    wait_for(lambda: control.poll(0), WAIT_S, "the welcomes")
    time.sleep(0.05)  # both of them
    side.serve({control: zmq.POLLIN}, time.monotonic())
    assert relay.counters["upstream_malformed"] == 1
    assert relay.current.run_id == "run-a" and relay.current.bus == run_bus(ASYNC_BUS)
    assert side.outlet.window == 2 * 8, "2 x the actors' window (8) x one actor at least"
    sent = welcomes(relay)
    relay.handle_control(b"A", P.encode(P.Hello(role="actor", peer_id="actor-0")))
    assert sent[-1][1].bus == ASYNC_BUS and sent[-1][1].run == {"algo": "opaque"}, "passed on as it came"
