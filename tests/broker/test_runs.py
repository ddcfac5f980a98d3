"""Staleness (async and sync modes) and runs: what the broker drops, and a new run's rewelcome.

The broker runs as a real `zddrl broker` process, driven over raw pyzmq sockets by the test-side clients of
tests/broker_clients.py. Every wait is on a condition with a deadline; the fixtures clean up every socket, link
and process.
"""

from __future__ import annotations

import pytest

from broker_clients import WAIT_S, Pusher, Shard, collect, counters, run_spec, start_run, status, trajectory
from conftest import BrokerHandle, Bus, wait_for
from zddrl import protocol as P

pytestmark = pytest.mark.slow  # every test here starts real zddrl processes

# ------------------------------------------------------------------------------------------------
# 6. Staleness (async mode) and runs
# ------------------------------------------------------------------------------------------------


def test_async_mode_drops_data_older_than_max_staleness(broker: BrokerHandle, bus: Bus) -> None:
    shard = start_run(bus, broker, mode="async", max_staleness=1)
    for v in (1, 2, 3):
        shard.publish(v)
    wait_for(lambda: counters(broker, bus)["policy_version"] == 3, WAIT_S, "version 3")
    shard.grant(100)
    actor = Pusher(bus, broker, "actor-0")
    for seq, version in enumerate((0, 1, 2, 3, 4, 3, 1)):
        assert actor.send(trajectory("run-a", "actor-0", seq, version=version))
    wait_for(lambda: counters(broker, bus)["received"] == 7, WAIT_S, "all seven to be read")
    collect([shard], 3, regrant=False)
    assert [(t.seq, t.policy_version) for t in shard.trajectories()] == [(2, 2), (3, 3), (5, 3)]
    b = counters(broker, bus)
    assert b["dropped"]["stale"] == 3 and b["dropped"]["unknown_version"] == 1 and b["accounted"]
    assert status(broker, bus)["members"]["actor-0"]["dropped_stale"] == 3


def test_sync_mode_drops_anything_but_the_latest_version(broker: BrokerHandle, bus: Bus) -> None:
    shard = start_run(bus, broker)  # default run spec: sync
    shard.publish(1)
    wait_for(lambda: counters(broker, bus)["policy_version"] == 1, WAIT_S, "version 1")
    shard.grant(10)
    actor = Pusher(bus, broker, "actor-0")
    for seq, version in enumerate((0, 1)):
        assert actor.send(trajectory("run-a", "actor-0", seq, version=version))
    collect([shard], 1, regrant=False)
    wait_for(lambda: counters(broker, bus)["dropped"]["stale"] == 1, WAIT_S, "the stale drop")
    assert [t.seq for t in shard.trajectories()] == [1]


def test_without_a_run_trajectories_are_dropped_as_unknown_run(broker: BrokerHandle, bus: Bus) -> None:
    shard = Shard(bus, broker, "learner-0")  # a shard that announced no run yet
    shard.grant(10)
    wait_for(lambda: status(broker, bus)["members"]["learner-0"]["credit"] == 10, WAIT_S, "the grant")
    actor = Pusher(bus, broker, "actor-0")
    assert actor.send(trajectory("", "actor-0", 0, version=0))
    wait_for(lambda: counters(broker, bus)["dropped"]["unknown_run"] == 1, WAIT_S, "the unknown_run drop")
    assert shard.recv(0) is None


def test_a_new_run_rewelcomes_actors_and_resets_versions(broker: BrokerHandle, bus: Bus) -> None:
    learner = start_run(bus, broker, run_id="run-1")
    learner.publish(5)
    wait_for(lambda: counters(broker, bus)["policy_version"] == 5, WAIT_S, "version 5 at the broker")
    link = bus.link(broker.connect, P.Hello(role="actor", peer_id="actor-0"), subscribe_params=True)
    got = link.wait_params(4, WAIT_S)
    assert got is not None and got.policy_version == 5
    generation = link.generation
    learner2 = Shard(bus, broker, "learner-9", "run-2", run_spec())
    wait_for(lambda: link.generation > generation and link.welcome.run_id == "run-2", WAIT_S, "the re-welcome")
    assert link.latest_params() is None, "versions restart with a run: nothing may be kept across runs"
    learner2.publish(0)
    got = link.wait_params(-1, WAIT_S)
    assert got is not None and got.run_id == "run-2" and got.policy_version == 0
    learner.publish(6)  # the old run's learner: ignored
    wait_for(lambda: counters(broker, bus).get("params_unknown_run") == 1, WAIT_S, "the old run's params ignored")
    assert link.latest_params().run_id == "run-2"
