"""The fleet message (docs/protocol.md section 5.5): which actors are joined, broker -> learner shards.

Round trip and rules of the message; its bound (a fleet of 10,000 actors fits a header); and, on a real
broker, what a learner's BrokerLink sees when actors join, leave and expire, that a burst of joins is
coalesced, that a learner gets the fleet right after its welcome, and that only the current run's learners
get it.
"""

from __future__ import annotations

import time

import msgpack
import pytest
import zmq

from broker_clients import WAIT_S, ProfiledBroker, counters, learner_hello, run_spec, status
from conftest import BrokerHandle, Bus, Procs, wait_for
from contract_clients import Control, Learner, wire
from zddrl import protocol as P
from zddrl.broker.roster import FLEET_COALESCE_S, Roster
from zddrl.transport.link import BrokerLink

# ------------------------------------------------------------------------------------------------
# The message
# ------------------------------------------------------------------------------------------------

FLEET = P.Fleet(
    run_id="run-a",
    seq=1764547200000,
    actors={"actor-0": {"num_envs": 8, "host": "node1"}, "actor-1": {"num_envs": 0, "host": ""}},
)


def test_fleet_round_trips_byte_identical() -> None:
    frames = wire(FLEET)
    assert len(frames) == 2 and frames[0] == P.PREAMBLE
    back = P.decode(frames)
    assert back == FLEET and wire(back) == frames
    assert msgpack.unpackb(frames[1]) == {
        "kind": "fleet",
        "run_id": "run-a",
        "seq": 1764547200000,
        "actors": FLEET.actors,
    }


def fleet_header(**changes) -> list[bytes]:
    header = {"kind": "fleet", "run_id": "r", "seq": 1, "actors": {"a": {"num_envs": 2, "host": "h"}}, **changes}
    return [P.PREAMBLE, msgpack.packb(header)]


@pytest.mark.parametrize(
    "frames,error",
    [
        (fleet_header(seq=-1), "seq must be >= 0"),
        (fleet_header(seq=True), "field 'seq' has the wrong type"),
        (fleet_header(actors=[["a", 2, "h"]]), "field 'actors' has the wrong type"),
        (fleet_header(actors={"a": [2, "h"]}), "actor 'a' must map to"),
        (fleet_header(actors={"a": {"num_envs": 2}}), "actor 'a' must map to"),
        (fleet_header(actors={"a": {"num_envs": 2, "host": "h", "gpu": 1}}), "actor 'a' must map to"),
        (fleet_header(actors={"a": {"num_envs": True, "host": "h"}}), "actor 'a' must map to"),
        (fleet_header(actors={"a": {"num_envs": -1, "host": "h"}}), "actor 'a' must map to"),
        (fleet_header(actors={"a": {"num_envs": 2, "host": b"h"}}), "actor 'a' must map to"),
        (fleet_header(actors={"a": {"num_envs": 2, "envs": "h"}}), "actor 'a' must map to"),
        ([*fleet_header(), b"an array frame"], "fleet carries no arrays"),
    ],
)
def test_malformed_fleets_are_refused(frames: list[bytes], error: str) -> None:
    with pytest.raises(P.ProtocolError, match=error):
        P.decode(frames)


def test_a_fleet_of_10000_actors_fits_a_header_and_the_broker_bounds_the_worst_case() -> None:
    """docs/protocol.md section 5.5: 10,000 actors with ids like actor-1234 on hosts like node-0123 take about
    a third of MAX_HEADER_BYTES; the broker refuses the actor whose entry would not fit, so the longest ids
    allowed (MAX_ID_BYTES, MAX_HOST_BYTES) still make a message every decoder accepts."""
    typical = P.Fleet(
        run_id="x" * P.MAX_ID_BYTES,
        seq=2**62,
        actors={f"actor-{i}": {"num_envs": 16, "host": f"node-{i // 8:04d}"} for i in range(10_000)},
    )
    size = len(P.encode(typical)[1])
    assert size < 0.4 * P.MAX_HEADER_BYTES, size
    assert P.decode(P.encode(typical)) == typical

    fleet = Roster(seq=0)
    host = "h" * P.MAX_HOST_BYTES
    n = 0
    while fleet.room_for(f"{n:0{P.MAX_ID_BYTES}d}", P.MAX_NUM_ENVS, host):
        fleet.joined(f"{n:0{P.MAX_ID_BYTES}d}", P.MAX_NUM_ENVS, host)
        n += 1
    assert 2000 < n < 3000  # ~407 bytes an entry
    fleet.announce(time.monotonic())
    frames = fleet.frames("x" * P.MAX_ID_BYTES)
    assert len(frames[1]) <= P.MAX_HEADER_BYTES
    assert len(P.decode(frames).actors) == n and fleet.nbytes <= P.MAX_FLEET_ACTORS_BYTES
    fleet.left(f"{0:0{P.MAX_ID_BYTES}d}")
    assert fleet.room_for("another", 1, "h") and fleet.changed


def test_fleet_seq_grows_by_one_per_announced_change_and_not_for_a_round_trip() -> None:
    fleet = Roster(seq=10)
    fleet.joined("a", 1, "h")
    fleet.joined("b", 2, "h")
    assert fleet.due(0.0)
    fleet.announce(0.0)
    assert (fleet.seq, fleet.actors) == (11, {"a": {"num_envs": 1, "host": "h"}, "b": {"num_envs": 2, "host": "h"}})
    assert not fleet.changed
    fleet.left("b")
    assert not fleet.due(FLEET_COALESCE_S / 2), "within the coalescing interval"
    fleet.joined("b", 2, "h")  # back before anyone was told: nothing to announce
    fleet.announce(FLEET_COALESCE_S)
    assert fleet.seq == 11
    fleet.joined("b", 4, "h")  # a new env count is a change
    fleet.announce(2 * FLEET_COALESCE_S)
    assert fleet.seq == 12 and fleet.actors["b"] == {"num_envs": 4, "host": "h"}


# ------------------------------------------------------------------------------------------------
# The link keeps the newest fleet of its run
# ------------------------------------------------------------------------------------------------


def welcome(run_id: str) -> P.Welcome:
    return P.Welcome(
        peer_id="learner-0",
        run_id=run_id,
        run={},
        ports={"trajectories": 2, "learners": 3, "params": 4},
        heartbeat_interval_s=1.0,
        heartbeat_liveness=3,
        max_message_bytes=1 << 20,
    )


def test_the_link_keeps_the_newest_fleet_of_its_run_only() -> None:
    link = BrokerLink("tcp://127.0.0.1:1", P.Hello(role="learner", peer_id="learner-0"))  # never started
    assert link.fleet() is None
    link.accept_welcome(welcome("run-a"))
    link.accept_fleet(P.Fleet(run_id="run-b", seq=7, actors={"x": {"num_envs": 1, "host": ""}}))
    assert link.fleet() is None and link.fleet_ignored == 1
    link.accept_fleet(FLEET)
    assert link.fleet() == (FLEET.seq, FLEET.actors)
    assert link.fleet()[1] is link.fleet()[1], "no copy per call"
    link.accept_welcome(welcome(""))  # a restarted broker that has no run yet: same run, keep it
    assert link.fleet() == (FLEET.seq, FLEET.actors)
    link.accept_welcome(welcome("run-b"))
    assert link.fleet() is None, "the fleet of another run"


# ------------------------------------------------------------------------------------------------
# A real broker
# ------------------------------------------------------------------------------------------------


@pytest.fixture
def fast_broker(procs: Procs, tmp_path) -> ProfiledBroker:
    """Heartbeats every 0.2 s, expiry after 3 missed beats (0.6 s)."""
    return ProfiledBroker(procs, tmp_path, heartbeat_interval_s=0.2, heartbeat_liveness=3).start()


def wait_fleet(link: BrokerLink, actors: dict, what: str, keep_alive: Control | None = None) -> int:
    """Wait until the link's fleet is ``actors`` (``keep_alive`` heartbeating meanwhile); returns its seq."""

    def seen() -> bool:
        if keep_alive is not None:
            keep_alive.heartbeat("early", -1)
        return link.fleet() is not None and link.fleet()[1] == actors

    wait_for(seen, WAIT_S, what)
    return link.fleet()[0]


def test_a_learner_link_sees_joins_leaves_and_expiry(fast_broker: ProfiledBroker, bus: Bus) -> None:
    broker = fast_broker
    early = Control(bus, broker, P.Hello(role="actor", peer_id="early", host="h-e", num_envs=1))
    learner = bus.link(broker.connect, learner_hello("learner-0", "run-a", run_spec()))
    assert learner.wait_welcome(WAIT_S) is not None
    # Right after its welcome: the actors already there (what a learner sizes its first rollouts from).
    first = learner.wait_fleet(WAIT_S)
    assert first is not None and first[1] == {"early": {"num_envs": 1, "host": "h-e"}}
    seq = wait_fleet(learner, {"early": {"num_envs": 1, "host": "h-e"}}, "the fleet after the welcome", early)

    joiner = bus.link(broker.connect, P.Hello(role="actor", peer_id="actor-a", host="h-a", num_envs=3))
    assert joiner.wait_welcome(WAIT_S) is not None
    both = {"early": {"num_envs": 1, "host": "h-e"}, "actor-a": {"num_envs": 3, "host": "h-a"}}
    assert wait_fleet(learner, both, "the join", early) == seq + 1

    # "early" heartbeats no more: it expires (0.6 s of silence); actor-a's link keeps it alive.
    assert wait_fleet(learner, {"actor-a": both["actor-a"]}, "the expiry") == seq + 2
    joiner.close("done")  # bye
    assert wait_fleet(learner, {}, "the bye") == seq + 3
    b = counters(broker, bus)
    assert b["fleet_seq"] == seq + 3 and b["fleet_actors"] == 0
    assert early.of(P.Fleet) == [], "actors never get fleet messages"


def test_a_burst_of_joins_is_coalesced(broker: BrokerHandle, bus: Bus) -> None:
    learner = Learner(bus, broker)
    first = learner.control.next(P.Fleet)  # right after the welcome
    assert first.actors == {} and first.run_id == "run-a"
    n = 40
    actors = [bus.socket(zmq.DEALER) for _ in range(n)]
    for i, sock in enumerate(actors):
        sock.connect(broker.connect)
        sock.send_multipart(P.encode(P.Hello(role="actor", peer_id=f"actor-{i}", num_envs=2, host="h")))
    fleets = []
    while not fleets or len(fleets[-1].actors) < n:
        fleets.append(learner.control.next(P.Fleet))
    assert len(fleets) <= 6, f"{len(fleets)} fleet messages for a burst of {n} joins"
    assert [f.seq for f in fleets] == list(range(first.seq + 1, first.seq + 1 + len(fleets)))
    assert fleets[-1].actors == {f"actor-{i}": {"num_envs": 2, "host": "h"} for i in range(n)}
    assert counters(broker, bus)["fleet_sent"] == 1 + len(fleets)


def test_only_the_current_runs_learners_get_the_fleet(broker: BrokerHandle, bus: Bus) -> None:
    old = Learner(bus, broker, "learner-a", "run-a")
    assert old.control.next(P.Fleet).run_id == "run-a"
    new = Learner(bus, broker, "learner-b", "run-b")  # a new run starts
    assert new.control.next(P.Fleet).run_id == "run-b"
    Control(bus, broker, P.Hello(role="actor", peer_id="actor-0", num_envs=2))
    assert new.control.next(P.Fleet).actors == {"actor-0": {"num_envs": 2, "host": ""}}
    old.control.send(P.StatusRequest(peer_id="learner-a"))  # its answer comes after anything sent to learner-a
    old.control.next(P.Status)
    assert len(old.control.of(P.Fleet)) == 1, "an old run's learner was told of the new run's fleet"


def test_hellos_with_names_too_long_for_the_fleet_are_refused(broker: BrokerHandle, bus: Bus) -> None:
    for hello, why in [
        (P.Hello(role="actor", peer_id="a" * (P.MAX_ID_BYTES + 1)), "peer_id must be 1..128 bytes"),
        (P.Hello(role="actor", peer_id=""), "peer_id must be 1..128 bytes"),
        (P.Hello(role="actor", peer_id="a", host="h" * 256), "host must be at most 255 bytes"),
        (P.Hello(role="actor", peer_id="a", num_envs=-1), "num_envs must be in 0..1048576"),
        (learner_hello("l", "r" * 129, run_spec()), "run_id must be at most 128 bytes"),
    ]:
        sock = bus.socket(zmq.DEALER)
        sock.connect(broker.connect)
        sock.send_multipart(P.encode(hello))
        assert sock.poll(int(WAIT_S * 1000))
        reject = P.decode(sock.recv_multipart())
        assert isinstance(reject, P.Reject) and reject.reason.startswith(P.REFUSED_PREFIX) and why in reject.reason
    assert status(broker, bus)["members"] == {}
