"""Replay services at a real broker (docs/protocol.md section 5.9): a member of role replay follows the current run,
takes its data by credit like a learner shard, is re-welcomed (with zero credit) when a new run starts, publishes
nothing, and a relay sends it to the root."""

from __future__ import annotations

import zmq

from broker_clients import WAIT_S, Pusher, Shard, collect, counters, run_spec, start_run, status, trajectory
from conftest import BrokerHandle, Bus, wait_for
from zddrl import protocol as P


class Replay(Shard):
    """A replay service's side of the broker: hello with role replay (no run), a DEALER on the learners socket."""

    def __init__(self, bus: Bus, broker: BrokerHandle, peer_id: str = "replay-0") -> None:
        self.peer_id, self.run_id = peer_id, ""
        self.link = bus.link(broker.connect, P.Hello(role="replay", peer_id=peer_id))
        assert self.link.wait_welcome(WAIT_S) is not None, f"{peer_id}: no welcome"
        self.sock = bus.socket(zmq.DEALER, identity=peer_id.encode(), rcvhwm=0)
        self.sock.connect(self.link.endpoint("learners"))
        self.received: list[P.Message] = []


def test_a_replay_takes_the_runs_data_by_credit_and_follows_a_new_run(broker: BrokerHandle, bus: Bus) -> None:
    start_run(bus, broker, run_id="run-1", mode="apex")  # the learner grants no credit: the replay gets the data
    replay = Replay(bus, broker)
    assert replay.link.welcome.run_id == "run-1" and replay.link.welcome.run["algo"]["name"] == "apex"
    replay.grant(8)
    actor = Pusher(bus, broker, "actor-0")
    for seq in range(5):
        assert actor.send(trajectory("run-1", "actor-0", seq))
    collect([replay], 5)
    body = status(broker, bus)
    c = body["broker"]
    assert c["members_by_role"]["replay"] == 1 and body["members"]["replay-0"]["role"] == "replay"
    assert c["forwarded"] == 5 and c["received"] == c["forwarded"] + sum(c["dropped"].values()) + c["in_flight"]

    generation = replay.link.generation
    learner2 = Shard(bus, broker, "learner-9", "run-2", run_spec(mode="apex"))
    learner2.publish(0)
    wait_for(lambda: replay.link.generation > generation, WAIT_S, "the replay's re-welcome")
    assert replay.link.welcome.run_id == "run-2"
    for seq in range(5, 8):  # its credit of run-1 is gone: nothing comes before it grants again
        assert actor.send(trajectory("run-2", "actor-0", seq))
    assert replay.recv(300) is None
    replay.grant(8)
    collect([replay], 8)
    assert {t.run_id for t in replay.trajectories()[5:]} == {"run-2"}


def test_a_replay_publishes_no_parameters(broker: BrokerHandle, bus: Bus) -> None:
    start_run(bus, broker, run_id="run-1", mode="apex")
    replay = Replay(bus, broker)
    before = counters(broker, bus)
    replay.publish(7, run_id="run-1")
    wait_for(
        lambda: counters(broker, bus).get("learner_malformed", 0) > before.get("learner_malformed", 0),
        WAIT_S,
        "the replay's parameters refused",
    )
    assert counters(broker, bus)["policy_version"] == 0
