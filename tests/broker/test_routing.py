"""Routing: every trajectory exactly once, shared by shards by their credit (not round-robin), accounted.

The broker runs as a real `zddrl broker` process, driven over raw pyzmq sockets by the test-side clients of
tests/broker_clients.py. Every wait is on a condition with a deadline; the fixtures clean up every socket, link
and process.
"""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import zmq

from broker_clients import (
    WAIT_S,
    Pusher,
    Shard,
    bus_of,
    cli,
    collect,
    counters,
    learner_hello,
    parameters,
    run_spec,
    start_run,
    status,
    trajectory,
)
from conftest import BrokerHandle, Bus, wait_for
from zddrl import protocol as P

pytestmark = pytest.mark.slow  # every test here starts real zddrl processes

# ------------------------------------------------------------------------------------------------
# 1. Routing: every trajectory exactly once, shared by two shards, accounted in `zddrl status`
# ------------------------------------------------------------------------------------------------


def test_a_shards_credit_window_shrinks_to_its_byte_budget_for_big_trajectories(broker: BrokerHandle, bus: Bus) -> None:
    """DataChannel grants at most ``window`` trajectories ahead, and once they are big, as many as fit in
    WINDOW_BYTES (never fewer than MIN_WINDOW): everything still arrives, exactly once, in order."""
    from zddrl.transport.channel import MIN_WINDOW, WINDOW_BYTES, DataChannel

    link = bus.link(broker.connect, learner_hello("learner-0", "run-a", run_spec()))
    assert link.wait_welcome(WAIT_S) is not None
    channel = DataChannel(link, "learner-0", link.welcome.max_message_bytes, window=8)
    try:
        channel.send(parameters("run-a", 0))
        wait_for(lambda: status(broker, bus)["members"]["learner-0"]["credit"] == 8, WAIT_S, "the first grant")
        actor = Pusher(bus, broker, "actor-0")
        big = 3 << 20  # obs and next_obs of 3 MiB each: ~6 MiB a trajectory, 2 would fit in 16 MiB
        for seq in range(16):
            assert actor.send(trajectory("run-a", "actor-0", seq, nbytes=big))
        got, deadline, ahead = [], time.monotonic() + 4 * WAIT_S, []
        while len(got) < 16:
            assert time.monotonic() < deadline, f"only {len(got)} of 16 arrived"
            msg = channel.recv(50)
            if isinstance(msg, P.Trajectory):
                got.append(msg.seq)
                channel.ack()
                ahead.append(channel.outstanding)
        assert got == list(range(16))
        assert channel.window == MIN_WINDOW == max(MIN_WINDOW, WINDOW_BYTES // channel.last_bytes)
        assert ahead[0] == 7 and max(ahead[7:]) <= MIN_WINDOW  # the first window runs out, no new one is as big
        wait_for(
            lambda: status(broker, bus)["members"]["learner-0"]["credit"] == channel.outstanding,
            WAIT_S,
            "the broker to hold exactly the credit the channel granted and has not used",
        )
        b = counters(broker, bus)
        assert b["received"] == b["forwarded"] == 16 and b["accounted"] is True
    finally:
        channel.close()


def test_two_actors_two_shards_deliver_every_trajectory_exactly_once(broker: BrokerHandle, bus: Bus) -> None:
    n = 60
    l0 = start_run(bus, broker)
    l1 = Shard(bus, broker, "learner-1", "run-a")  # joins the announced run: no spec needed
    actors = [Pusher(bus, broker, "actor-0"), Pusher(bus, broker, "actor-1")]
    for shard in (l0, l1):
        shard.grant(4)
    wait_for(
        lambda: [status(broker, bus)["members"][s.peer_id]["credit"] for s in (l0, l1)] == [4, 4],
        WAIT_S,
        "both grants to reach the broker",
    )
    for seq in range(n):
        for a in actors:
            assert a.send(trajectory("run-a", a.peer_id, seq))
    collect([l0, l1], 2 * n)
    wait_for(lambda: counters(broker, bus)["forwarded"] == 2 * n, WAIT_S, "the broker to count every forward")
    for shard in (l0, l1):
        assert shard.recv(0) is None, "more trajectories than were sent"

    got = [(t.peer_id, t.seq) for s in (l0, l1) for t in s.trajectories()]
    assert len(got) == len(set(got)) == 2 * n
    assert set(got) == {(a.peer_id, seq) for a in actors for seq in range(n)}
    assert l0.trajectories() and l1.trajectories(), "both shards must get a share"

    out = cli("status", "--connect", broker.connect, "--json")
    assert out.returncode == 0, out.stderr
    body = json.loads(out.stdout)
    b = body["broker"]
    assert b["run_id"] == "run-a" and b["policy_version"] == 0
    assert b["received"] == b["forwarded"] == 2 * n
    assert b["dropped"] == {r: 0 for r in b["dropped"]} and b["in_flight"] == 0 and b["accounted"] is True
    m = body["members"]
    for a in actors:
        assert m[a.peer_id]["role"] == "actor" and m[a.peer_id]["messages"] == n
        assert m[a.peer_id]["env_steps"] == n and m[a.peer_id]["num_envs"] == 2  # one step each
    for s in (l0, l1):
        assert m[s.peer_id]["role"] == "learner" and m[s.peer_id]["messages"] == len(s.trajectories())


def test_a_trajectory_must_carry_the_arrays_its_run_declares(broker: BrokerHandle, bus: Bus) -> None:
    """The learner's hello declares an array (docs/protocol.md section 7.1): the broker forwards the trajectories that
    carry it as declared and drops the rest as malformed, charged to their actor, with the reason in its log."""
    run = run_spec()
    declared = [["actor_td", "float32", [], "step"], ["h0", "float32", [3], "rollout"]]
    shard = Shard(bus, broker, "learner-0", "run-a", run, run_bus={**bus_of(run), "arrays": declared})
    shard.publish(0)
    wait_for(lambda: counters(broker, bus)["policy_version"] == 0, WAIT_S, "version 0 to be published")
    shard.grant(10)
    actor = Pusher(bus, broker, "actor-0")
    td, h0 = np.zeros((1, 1), np.float32), np.zeros((1, 3), np.float32)
    sent = [
        trajectory("run-a", "actor-0", 0, actor_td=td, h0=h0),  # as declared: forwarded
        trajectory("run-a", "actor-0", 1, h0=h0),  # a declared array missing
        trajectory("run-a", "actor-0", 2, actor_td=td.astype(np.float64), h0=h0),  # of another dtype
        trajectory("run-a", "actor-0", 3, actor_td=td, h0=np.zeros((1, 1, 3), np.float32)),  # of another shape
        trajectory("run-a", "actor-0", 4, actor_td=td, h0=h0, q_taken=td),  # an array nobody declared
        trajectory("run-a", "actor-0", 5, actor_td=td, h0=h0),
    ]
    for msg in sent:
        assert actor.send(msg)
    collect([shard], 2)
    wait_for(lambda: counters(broker, bus)["received"] == len(sent), WAIT_S, "every trajectory to be read")
    assert [t.seq for t in shard.trajectories()] == [0, 5]
    np.testing.assert_array_equal(shard.trajectories()[0].arrays["h0"], h0)
    body = status(broker, bus)
    assert body["broker"]["dropped"]["malformed"] == 4 and body["broker"]["accounted"]
    assert body["members"]["actor-0"]["dropped_malformed"] == 4


# ------------------------------------------------------------------------------------------------
# 3. Distribution follows readiness (credit), not round-robin
# ------------------------------------------------------------------------------------------------


def test_the_shard_that_grants_more_gets_more(broker: BrokerHandle, bus: Bus) -> None:
    fast = start_run(bus, broker)
    slow = Shard(bus, broker, "learner-1", "run-a")
    fast.grant(10)
    slow.grant(2)  # and never again: a shard busy training
    wait_for(
        lambda: (
            {p: m["credit"] for p, m in status(broker, bus)["members"].items() if m["role"] == "learner"}
            == {"learner-0": 10, "learner-1": 2}
        ),
        WAIT_S,
        "both grants to reach the broker",
    )
    actor = Pusher(bus, broker, "actor-0")
    for seq in range(40):
        assert actor.send(trajectory("run-a", "actor-0", seq))
    poller_shards = [fast, slow]
    # The fast shard grants one back per message; the slow one does not.
    poller = zmq.Poller()
    for s in poller_shards:
        poller.register(s.sock, zmq.POLLIN)
    deadline = time.monotonic() + WAIT_S
    while len(fast.trajectories()) + len(slow.trajectories()) < 40:
        assert time.monotonic() < deadline, f"fast {len(fast.trajectories())}, slow {len(slow.trajectories())}"
        events = dict(poller.poll(50))
        if fast.sock in events:
            fast.received.append(fast.recv())
            fast.grant(1)
        if slow.sock in events:
            slow.received.append(slow.recv())
    assert len(slow.trajectories()) <= 2, "the broker sent beyond the slow shard's credit"
    assert len(fast.trajectories()) >= 38
    members = status(broker, bus)["members"]
    assert members["learner-1"]["credit"] == 2 - len(slow.trajectories())
    assert members["learner-1"]["messages"] == len(slow.trajectories())
