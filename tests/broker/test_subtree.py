"""The root's side of relays (broker/subtree.py) on a broker object fed control messages by hand
(``Broker.handle_control``, one message as its loop handles it): no loop, no clients."""

from __future__ import annotations

import time

from broker_clients import in_process_broker
from zddrl import protocol as P

RELAY = P.Hello(role="relay", peer_id="relay-1", host="rack1", pid=5)


def entry(pid: int = 7) -> dict:
    return {"num_envs": 2, "host": "node", "pid": pid}


def report(b, identity: bytes, full: bool, actors: dict, left: tuple[str, ...] = ()) -> None:
    msg = P.Subtree(peer_id="relay-1", seq=1, full=full, actors=actors, left=list(left), counters={"received": 0})
    b.handle_control(identity, P.encode(msg))


def test_relayed_actors_join_the_fleet_leave_by_report_and_leave_with_their_relay() -> None:
    with in_process_broker() as b:
        b.handle_control(b"session-1", P.encode(RELAY))
        report(b, b"session-1", False, {"actor-0": entry(), "actor-1": entry(8)})
        relayed = {p: m.relay for p, m in b.members.items() if m.role == "actor"}
        assert relayed == {"actor-0": "relay-1", "actor-1": "relay-1"}
        roster = b.membership.roster
        assert len(roster) == 2 and b.members["actor-0"].identity == b"session-1"
        relay = b.membership.of_identity(b"session-1")
        assert relay is not None and relay.peer_id == "relay-1", "a relayed actor never takes its relay's index"

        versions = {"actor-0": 3, "actor-1": 3}
        b.handle_control(
            b"session-1", P.encode(P.Subtree(peer_id="relay-1", seq=2, full=True, actors={}, versions=versions))
        )
        assert set(b.members) == {"relay-1"}, "a full report naming no actor: all of them left"
        report(b, b"session-1", False, {"actor-0": entry(), "actor-1": entry(8)})
        full = P.Subtree(peer_id="relay-1", seq=3, full=True, actors={"actor-0": entry()}, versions={"actor-0": 3})
        b.handle_control(b"session-1", P.encode(full))
        assert b.members["actor-0"].policy_version == 3, "the version its relay heard"
        report(b, b"session-1", True, {"actor-0": entry()})  # a full report without actor-1: it left
        assert "actor-1" not in b.members and len(roster) == 1
        report(b, b"session-1", False, {}, left=("actor-0",))
        assert "actor-0" not in b.members
        report(b, b"session-1", False, {"actor-0": entry()})

        roster.announce(time.monotonic())
        seq = roster.seq
        b.handle_control(b"session-2", P.encode(RELAY))  # the same relay process, a new session
        assert b.members["actor-0"].identity == b"session-2", "credit goes to the new connection"
        roster.announce(time.monotonic() + 1)
        assert roster.seq == seq, "a relay's new session does not churn the learners' fleet"

        b.handle_control(b"session-2", P.encode(P.Bye(peer_id="relay-1", reason="stopping")))
        assert set(b.members) == set() and len(roster) == 0 and not b.subtrees.relays
        departures = b.membership.departures.rows(0.0)
        assert any(d["member"] == "actor-0" and "relay-1 left" in d["reason"] for d in departures)
        assert b.counters["control_malformed"] == 0


def test_only_a_relay_reports_a_subtree_and_a_direct_actor_keeps_its_id() -> None:
    with in_process_broker() as b:
        b.handle_control(b"actor", P.encode(P.Hello(role="actor", peer_id="actor-0", host="node", pid=1)))
        b.handle_control(b"actor", P.encode(P.Subtree(peer_id="actor-0", seq=0, full=True, actors={})))
        assert b.counters["control_malformed"] == 1, "an actor's subtree message: not a relay's"
        b.handle_control(b"relay", P.encode(RELAY))
        report(b, b"relay", False, {"actor-0": entry(pid=2)})  # another process's claim on a live direct id
        assert b.counters["relayed_refused"] == 1 and not b.members["actor-0"].relay
        report(b, b"relay", False, {"actor-0": entry(pid=1)})  # the same process, now behind the relay: it moved
        assert b.members["actor-0"].relay == "relay-1"
