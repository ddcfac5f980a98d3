"""The broker as a real `zddrl broker` process, driven from the test over raw pyzmq sockets.

Test-side clients: learner shards and actors join with a ``BrokerLink`` (hello, heartbeats) and
talk data over their own sockets (a DEALER whose identity is the peer id, a PUSH); malformed
input is crafted frame by frame. Every wait is on a condition with a deadline; every socket,
link and process is cleaned up by the fixtures.
"""
from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from broker_clients import (WAIT_S, ProfiledBroker, Pusher, Shard, cli, collect, counters, parameters,
                            recv_control, run_spec, start_run, status, trajectory)
from conftest import BrokerHandle, Bus, Procs, wait_for
from zddrl import protocol as P
from zddrl.proc import free_ports

@pytest.fixture
def fast_broker(procs: Procs, tmp_path: Path) -> ProfiledBroker:
    """Heartbeats every 0.2 s, expiry after 3 missed beats (0.6 s)."""
    return ProfiledBroker(procs, tmp_path, heartbeat_interval_s=0.2, heartbeat_liveness=3).start()


# ------------------------------------------------------------------------------------------------
# 1. Routing: every trajectory exactly once, shared by two shards, accounted in `zddrl status`
# ------------------------------------------------------------------------------------------------


def test_a_shards_credit_window_shrinks_to_its_byte_budget_for_big_trajectories(broker: BrokerHandle,
                                                                                bus: Bus) -> None:
    """DataChannel grants at most ``window`` trajectories ahead, and once they are big, as many as fit in
    WINDOW_BYTES (never fewer than MIN_WINDOW): everything still arrives, exactly once, in order."""
    from zddrl.transport.channel import MIN_WINDOW, WINDOW_BYTES, DataChannel

    link = bus.link(broker.connect, P.Hello(role="learner", peer_id="learner-0", run_id="run-a", run=run_spec()))
    assert link.wait_welcome(WAIT_S) is not None
    channel = DataChannel(bus.ctx, link, "learner-0", link.welcome.max_message_bytes, window=8)
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
        wait_for(lambda: status(broker, bus)["members"]["learner-0"]["credit"] == channel.outstanding, WAIT_S,
                 "the broker to hold exactly the credit the channel granted and has not used")
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
    wait_for(lambda: [status(broker, bus)["members"][s.peer_id]["credit"] for s in (l0, l1)] == [4, 4], WAIT_S,
             "both grants to reach the broker")
    for seq in range(n):
        for a in actors:
            assert a.send(trajectory("run-a", a.peer_id, seq))
    collect([l0, l1], 2 * n)
    wait_for(lambda: counters(broker, bus)["forwarded"] == 2 * n, WAIT_S, "the broker to count every forward")
    for shard in (l0, l1):
        assert shard.recv(0) is None, "more trajectories than were sent"

    got = [(t.sender, t.seq) for s in (l0, l1) for t in s.trajectories()]
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


# ------------------------------------------------------------------------------------------------
# 2. Credit and backpressure
# ------------------------------------------------------------------------------------------------


def test_without_credit_nothing_is_delivered_and_the_sender_blocks(broker: BrokerHandle, bus: Bus) -> None:
    shard = start_run(bus, broker)  # grants no credit
    actor = Pusher(bus, broker, "actor-0", sndhwm=2)
    cap, sent = 400, 0  # 400 x 256 KiB: far more than the queues between sender and broker hold
    while sent < cap and actor.send(trajectory("run-a", "actor-0", sent, nbytes=256 << 10), timeout_ms=300):
        sent += 1
    assert 0 < sent < cap, f"the sender never blocked ({sent} messages queued without credit)"
    b = counters(broker, bus)
    assert b["received"] == 0, "the broker read trajectories without credit"
    assert shard.recv(0) is None

    shard.grant(8)  # credit releases the queued messages, in order
    collect([shard], sent)
    assert [t.seq for t in shard.trajectories()] == list(range(sent))
    assert actor.send(trajectory("run-a", "actor-0", sent), timeout_ms=int(WAIT_S * 1000)), "still blocked"
    collect([shard], sent + 1)
    b = counters(broker, bus)
    assert b["received"] == b["forwarded"] == sent + 1 and b["accounted"]


def test_what_an_actor_sent_before_its_bye_is_still_forwarded(broker: BrokerHandle, bus: Bus) -> None:
    """Trajectories queued at the broker when their actor leaves are its last rollouts, not a stranger's."""
    shard = start_run(bus, broker)  # no credit yet: the broker leaves them queued
    actor = Pusher(bus, broker, "leaver")
    for seq in range(3):
        assert actor.send(trajectory("run-a", "leaver", seq))
    actor.link.close("done")
    wait_for(lambda: "leaver" not in status(broker, bus)["members"], WAIT_S, "the bye to remove the member")
    shard.grant(8)
    collect([shard], 3, regrant=False)
    b = counters(broker, bus)
    assert [t.seq for t in shard.trajectories()] == [0, 1, 2]
    assert b["forwarded"] == 3 and b["dropped"]["unknown_sender"] == 0 and b["accounted"]


def test_departed_actors_are_remembered_for_a_while_and_in_bounded_number() -> None:
    from zddrl.broker.membership import LEFT_ACTORS_KEPT, Departures, Member

    departures = Departures(grace_s=3.0)
    departures.record(Member(peer_id="shard", role="learner", identity=b"s"), "bye")
    for i in range(LEFT_ACTORS_KEPT + 1):
        departures.record(Member(peer_id=f"actor-{i}", role="actor", identity=b"a"), "bye")
    now = time.monotonic()
    assert departures.actor_left_lately("actor-1", now)
    assert not departures.actor_left_lately("actor-1", now + 3.1)  # the grace is over
    assert not departures.actor_left_lately("actor-0", now)  # the oldest made room
    assert not departures.actor_left_lately("shard", now)  # only actors send trajectories


def test_credit_release_keeps_each_senders_order(broker: BrokerHandle, bus: Bus) -> None:
    shard = start_run(bus, broker)
    actors = [Pusher(bus, broker, f"actor-{i}") for i in range(2)]
    for seq in range(30):
        for a in actors:
            assert a.send(trajectory("run-a", a.peer_id, seq))
    for granted in range(0, 60, 7):  # trickle credit in small, uneven grants
        shard.grant(7)
        collect([shard], min(granted + 7, 60), regrant=False)
    for a in actors:
        assert [t.seq for t in shard.trajectories() if t.sender == a.peer_id] == list(range(30))


class ControlClient:
    """An actor's control socket by hand (a DEALER): hello, then every credit message the broker sends it."""

    def __init__(self, bus: Bus, broker: BrokerHandle, peer_id: str) -> None:
        self.sock = bus.socket(zmq.DEALER)
        self.sock.connect(broker.connect)
        self.sock.send_multipart(P.encode(P.Hello(role="actor", peer_id=peer_id, num_envs=2)))
        self.credits: list[int] = []
        self.welcome = self._next(P.Welcome)

    def _next(self, kind: type) -> P.Message:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            if self.sock.poll(50):
                msg = P.decode(self.sock.recv_multipart())
                if isinstance(msg, P.Credit):
                    self.credits.append(msg.credit)
                if isinstance(msg, kind):
                    return msg
        pytest.fail(f"no {kind.KIND} from the broker")

    def credit_until(self, total: int) -> list[int]:
        while sum(self.credits) < total:
            self._next(P.Credit)
        return self.credits

    def credit_over(self, seconds: float) -> list[int]:
        """Every credit that comes within ``seconds`` (to show that no more comes than is due)."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if self.sock.poll(max(1, int(left * 1000))):
                msg = P.decode(self.sock.recv_multipart())
                if isinstance(msg, P.Credit):
                    self.credits.append(msg.credit)
        return self.credits


@pytest.mark.parametrize("max_in_flight,batch", [(2, 1), (8, 4)])
def test_actors_get_their_credit_back_in_batches_of_half_their_limit(procs: Procs, tmp_path: Path, bus: Bus,
                                                                      max_in_flight: int, batch: int) -> None:
    """The run's algo.max_in_flight sets the batch; what a batch leaves pending goes back with the next
    heartbeat, so every trajectory's credit returns and no actor waits more than a beat for it."""
    broker = ProfiledBroker(procs, tmp_path, heartbeat_interval_s=0.3, heartbeat_liveness=30).start()
    shard = start_run(bus, broker, max_in_flight=max_in_flight)
    shard.grant(100)
    actor = ControlClient(bus, broker, "actor-0")
    push = bus.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{actor.welcome.ports['trajectories']}")
    sent = 2 * batch + 1  # two whole batches and one left over
    for seq in range(sent):
        push.send_multipart(P.encode(trajectory("run-a", "actor-0", seq)))
    collect([shard], sent, regrant=False)
    credits = actor.credit_until(sent)
    assert sum(credits) == sent
    assert all(c >= batch for c in credits[:-1]), credits  # only the heartbeat's remainder may be smaller
    if batch > 1:
        assert len(credits) < sent


def test_an_actor_gets_the_credit_of_its_malformed_trajectories_back(procs: Procs, tmp_path: Path,
                                                                     bus: Bus) -> None:
    """A malformed trajectory still used one of its sender's credits: without it back, an actor allowed 2 in
    flight would stall for good after its second bad message (a NaN episode return, say)."""
    broker = ProfiledBroker(procs, tmp_path, heartbeat_interval_s=0.3, heartbeat_liveness=30).start()
    shard = start_run(bus, broker, max_in_flight=2)
    shard.grant(100)
    actor = ControlClient(bus, broker, "actor-0")
    push = bus.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{actor.welcome.ports['trajectories']}")
    bad = dataclasses.replace(trajectory("run-a", "actor-0", 0), ep_returns=[math.nan], ep_lengths=[1])
    for _ in range(3):
        push.send_multipart(P.encode(bad))
    push.send_multipart(P.encode(trajectory("run-a", "actor-0", 1)))
    collect([shard], 1, regrant=False)
    assert sum(actor.credit_until(4)) == 4
    assert sum(actor.credit_over(2 * 0.3)) == 4  # two heartbeats later: none returned twice
    body = status(broker, bus)
    assert body["broker"]["dropped"]["malformed"] == 3 and body["broker"]["accounted"] is True
    assert body["members"]["actor-0"]["dropped_malformed"] == 3


# ------------------------------------------------------------------------------------------------
# 3. Distribution follows readiness (credit), not round-robin
# ------------------------------------------------------------------------------------------------


def test_the_shard_that_grants_more_gets_more(broker: BrokerHandle, bus: Bus) -> None:
    fast = start_run(bus, broker)
    slow = Shard(bus, broker, "learner-1", "run-a")
    fast.grant(10)
    slow.grant(2)  # and never again: a shard busy training
    wait_for(lambda: {p: m["credit"] for p, m in status(broker, bus)["members"].items() if m["role"] == "learner"}
             == {"learner-0": 10, "learner-1": 2}, WAIT_S, "both grants to reach the broker")
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


# ------------------------------------------------------------------------------------------------
# 4. Parameters: late joiners get the cached version at once; latest wins
# ------------------------------------------------------------------------------------------------


def test_late_subscriber_gets_cached_params_and_latest_wins(broker: BrokerHandle, bus: Bus) -> None:
    learner = start_run(bus, broker)
    learner.publish(2)
    wait_for(lambda: counters(broker, bus)["policy_version"] == 2, WAIT_S, "version 2")
    learner.publish(1)  # older than what is out: must not be re-published
    wait_for(lambda: counters(broker, bus).get("params_stale") == 1, WAIT_S, "the stale version to be counted")
    b = counters(broker, bus)
    assert b["policy_version"] == 2 and b["params_published"] == 2

    # A late joiner: hello on control -> welcome, then the cached version 2 right behind it.
    control = bus.socket(zmq.DEALER)
    control.connect(broker.connect)
    control.send_multipart(P.encode(P.Hello(role="actor", peer_id="late-actor")))
    welcome = recv_control(control)
    assert isinstance(welcome, P.Welcome) and welcome.run_id == "run-a" and welcome.run is not None
    snapshot = recv_control(control, 2000)
    assert isinstance(snapshot, P.Parameters) and snapshot.policy_version == 2
    assert P.param_hash(snapshot.arrays["flat"]) == snapshot.param_hash
    assert counters(broker, bus)["params_published"] == 2, "the late joiner needed no new publish"

    # Its SUB: once subscribed (a publish gets through), a stale version is never broadcast.
    sub = bus.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{welcome.ports['params']}")
    version = 2
    while True:  # PUB/SUB subscriptions take a moment to propagate: publish until one lands
        version += 1
        assert version < 200, "the SUB never received a broadcast"
        learner.publish(version)
        if sub.poll(100):
            break
    learner.publish(1)
    learner.publish(version + 1)
    seen = []
    while not seen or seen[-1] < version + 1:  # the probing loop's broadcasts, then version + 1
        seen.append(recv_control(sub).policy_version)
    assert 1 not in seen and seen == sorted(set(seen)), f"broadcast versions {seen}: a stale one went out"
    wait_for(lambda: counters(broker, bus).get("params_stale") == 2, WAIT_S, "the second stale version")


def test_actor_link_never_goes_back_to_an_older_version(broker: BrokerHandle, bus: Bus) -> None:
    learner = start_run(bus, broker)
    learner.publish(3)
    wait_for(lambda: counters(broker, bus)["policy_version"] == 3, WAIT_S, "version 3")
    link = bus.link(broker.connect, P.Hello(role="actor", peer_id="actor-0"), subscribe_params=True)
    got = link.wait_params(newer_than=-1, timeout_s=WAIT_S)
    assert got is not None and got.policy_version == 3, "late joiner: the cached version at once"
    seen = [3]
    for v in (1, 2, 4, 0, 5):  # 1, 2, 0 are stale at the broker
        learner.publish(v)
        if v > seen[-1]:
            got = link.wait_params(newer_than=seen[-1], timeout_s=WAIT_S)
            assert got is not None and got.policy_version == v
            seen.append(v)
    wait_for(lambda: counters(broker, bus).get("params_stale") == 3, WAIT_S, "three stale versions counted")
    assert link.latest_params().policy_version == 5 and link.params_rejected == 0
    # The broker sees the version the actor acts with through its heartbeats.
    wait_for(lambda: status(broker, bus)["members"]["actor-0"]["policy_version"] == 5, WAIT_S,
             "the actor's heartbeat to report version 5")


# ------------------------------------------------------------------------------------------------
# 5. Malformed input is dropped, counted by reason, logged rate-limited; the broker keeps serving
# ------------------------------------------------------------------------------------------------


def bad_trajectories(run_id: str) -> dict[str, list[list[bytes]]]:
    """Bad messages by the drop reason the broker must count them under."""
    good = [bytes(f) for f in P.encode(trajectory(run_id, "actor-0", 999))]
    header = msgpack.unpackb(good[1])

    def with_header(**changes: Any) -> list[bytes]:
        return [good[0], msgpack.packb({**header, **changes}), *good[2:]]

    return {
        "malformed": [
            [b"\x00garbage"],                                          # one frame of junk
            [b"garbage", b"more garbage"],                             # two frames of junk
            [b"XXXX\x01", good[1], good[2]],                           # wrong signature
            [P.SIGNATURE + b"\x09", good[1], good[2]],                 # unknown protocol version
            [good[0], b"\xc1not msgpack", good[2]],                    # header not msgpack
            with_header(arrays=[["rewards", "complex64", [8]]]),       # dtype not allowed
            [good[0], good[1], good[2][:-3]],                          # frame size != shape x dtype
            [good[0], good[1]],                                        # array frame missing
            with_header(seq="seven"),                                  # field of the wrong type
            [bytes(f) for f in P.encode(P.Heartbeat(peer_id="x"))],    # not a trajectory
        ],
        "unknown_sender": [[bytes(f) for f in P.encode(trajectory(run_id, "never-said-hello", 999))]],
        "unknown_run": [[bytes(f) for f in P.encode(trajectory("no-such-run", "actor-0", 998))]],
        "unknown_version": [[bytes(f) for f in P.encode(trajectory(run_id, "actor-0", 997, version=7))],
                            [bytes(f) for f in P.encode(trajectory(run_id, "actor-0", 996, version=-1))]],
    }


def test_malformed_trajectories_are_dropped_by_reason_and_valid_ones_arrive(
        broker: BrokerHandle, procs: Procs, bus: Bus) -> None:
    shard = start_run(bus, broker)
    shard.grant(1000)
    actor = Pusher(bus, broker, "actor-0")
    bad = bad_trajectories("run-a")
    seq = 0
    for reason, messages in bad.items():
        for frames in messages:
            assert actor.send(trajectory("run-a", "actor-0", seq))
            assert actor.send(frames)
            seq += 1
    flood = 200
    for i in range(flood):  # a flood of junk must not flood the log
        assert actor.send([b"junk-%d" % i])
    assert actor.send(trajectory("run-a", "actor-0", seq))
    seq += 1
    collect([shard], seq, regrant=False)
    assert [t.seq for t in shard.trajectories()] == list(range(seq))

    expected = {"malformed": len(bad["malformed"]) + flood, "unknown_sender": 1, "unknown_run": 1, "unknown_version": 2}
    total = seq + sum(expected.values())
    wait_for(lambda: counters(broker, bus)["received"] == total, WAIT_S, "every message to be read")
    body = status(broker, bus)
    b = body["broker"]
    assert b["dropped"] == {"malformed": expected["malformed"], "unknown_sender": 1, "unknown_run": 1, "stale": 0,
                            "unknown_version": 2, "no_route": 0}
    assert b["forwarded"] == seq and b["accounted"] is True
    assert b["received"] == b["forwarded"] + sum(b["dropped"].values()) + b["in_flight"]
    actor_row = body["members"]["actor-0"]  # drops with a readable sender are charged to it
    assert actor_row["dropped_unknown_run"] == 1 and actor_row["dropped_unknown_version"] == 2
    # malformed ones too when their header names it: bad dtype, frame size, missing frame, bad seq
    assert actor_row["dropped_malformed"] == 4

    log = procs.log("broker")
    lines = [ln for ln in log.splitlines() if "dropped a malformed trajectory" in ln]
    assert 1 <= len(lines) <= 3, f"{len(lines)} log lines for {expected['malformed']} malformed messages"
    assert "dropped a trajectory of unknown run 'no-such-run'" in log
    assert "never published" in log
    assert "dropped a trajectory from 'never-said-hello', which is not an actor that joined with hello" in log
    assert broker.proc.poll() is None


def test_malformed_control_and_learner_messages_do_not_stop_the_broker(broker: BrokerHandle, bus: Bus) -> None:
    shard = start_run(bus, broker)
    hello = P.encode(P.Hello(role="actor", peer_id="a"))
    mixed_keys = msgpack.packb({"kind": "hello", "role": "actor", "peer_id": "a", b"x": 1, "y": 2},
                               use_bin_type=True)

    control = bus.socket(zmq.DEALER)
    control.connect(broker.connect)
    control.send_multipart(P.encode(P.Hello(role="actor", peer_id="raw-actor")))
    assert isinstance(recv_control(control), P.Welcome)  # a member: its misplaced data is malformed
    bad_control = [
        [b"junk"],
        [b"XXXX\x01", hello[1]],
        [P.PREAMBLE, b"\xc1"],
        [P.PREAMBLE, msgpack.packb({"kind": "no-such-kind"})],
        [P.PREAMBLE, mixed_keys],                                      # bytes and str keys together
        [*hello, b"an extra frame"],
        [bytes(f) for f in P.encode(trajectory("run-a", "a", 0))],    # data on the control socket
        P.encode(P.Hello(role="overlord", peer_id="x")),              # unknown role
        P.encode(P.Hello(role="learner", peer_id="y", run_id="other-run")),  # new run without spec
        P.encode(P.Hello(role="learner", peer_id="z", run_id="bad-spec", run={"algo": [1, 2]})),
        P.encode(P.Hello(role="learner", peer_id="z", run_id="bad-spec", run={"algo": {"max_in_flight": 0}})),
    ]
    for frames in bad_control:
        control.send_multipart(frames)
    # The refused hellos are answered with a reject that says why.
    rejects = []
    while len(rejects) < 4:  # the params snapshot and heartbeats may come in between
        msg = recv_control(control)
        if not isinstance(msg, (P.Parameters, P.Heartbeat)):
            rejects.append(msg)
    assert all(isinstance(r, P.Reject) and "hello refused" in r.reason and not r.rehello for r in rejects), rejects
    # A member's stats must be a flat map of figures; nested maps or bytes would break `zddrl status`.
    link = bus.link(broker.connect, P.Hello(role="actor", peer_id="actor-0"))
    assert link.wait_welcome(WAIT_S)
    link.send(P.Stats(sender="actor-0", role="actor", stats={"sps": {"nested": 1}}))
    link.send(P.Stats(sender="actor-0", role="actor", stats={"blob": b"\x00\x01"}))
    link.send(P.Stats(sender="actor-0", role="actor", stats={"sps": 12.5, "param_hash": "abc"}))

    unknown = bus.socket(zmq.DEALER, identity=b"nobody")
    unknown.connect(shard.link.endpoint("learners"))
    unknown.send_multipart(P.encode(P.Credit(sender="nobody", credit=5)))
    reject = recv_control(unknown)
    assert isinstance(reject, P.Reject) and reject.rehello

    bad_learner = [
        [b"junk"],
        P.encode(P.Credit(sender="learner-0", credit=0)),
        P.encode(P.Credit(sender="learner-0", credit=-5)),
        P.encode(P.Credit(sender="learner-0", credit=1 << 30)),
        P.encode(P.Hello(role="learner", peer_id="learner-0")),      # control message on the data socket
        [bytes(f) for f in P.encode(parameters("run-a", 1))][:-1],   # params without its array frame
    ]
    for frames in bad_learner:
        shard.sock.send_multipart(frames)

    expect_control = len(bad_control) + 2
    wait_for(lambda: counters(broker, bus).get("control_malformed") == expect_control
             and counters(broker, bus).get("learner_malformed") == len(bad_learner), WAIT_S,
             "every bad control and learner message to be counted")
    body = status(broker, bus)
    assert body["broker"]["run_id"] == "run-a", "a refused hello must not change the run"
    assert body["broker"]["policy_version"] == 0
    assert body["members"]["actor-0"]["stats"] == {"sps": 12.5, "param_hash": "abc"}
    assert {"learner-0", "actor-0"} <= set(body["members"]) and not {"x", "y", "z", "a"} & set(body["members"])
    assert broker.proc.poll() is None
    # ... and it still routes.
    shard.grant(1)
    actor = Pusher(bus, broker, "actor-1")
    assert actor.send(trajectory("run-a", "actor-1", 0))
    collect([shard], 1, regrant=False)
    out = cli("status", "--connect", broker.connect, "--json")
    assert out.returncode == 0, out.stderr
    json.loads(out.stdout)


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


# ------------------------------------------------------------------------------------------------
# 7. Broker killed and restarted on the same ports
# ------------------------------------------------------------------------------------------------


def test_clients_reconnect_after_broker_sigkill_and_restart(broker: BrokerHandle, bus: Bus) -> None:
    learner = start_run(bus, broker, run_id="run-k")
    actor = bus.link(broker.connect, P.Hello(role="actor", peer_id="actor-0"), subscribe_params=True)
    assert actor.wait_params(-1, WAIT_S) is not None
    gen_actor, gen_learner = actor.generation, learner.link.generation

    broker.proc.kill()
    broker.proc.wait(timeout=WAIT_S)
    broker.start()  # same ports

    wait_for(lambda: actor.generation > gen_actor and learner.link.generation > gen_learner, 20,
             "both links to be welcomed by the new broker")
    wait_for(lambda: counters(broker, bus)["run_id"] == "run-k", WAIT_S, "the learner's re-hello to restore the run")
    assert actor.welcome.run_id == "run-k"
    assert actor.latest_params().policy_version == 0, "same run: the actor keeps what it holds"
    wait_for(lambda: {"learner-0", "actor-0"} <= set(status(broker, bus)["members"]), WAIT_S, "both members")

    # Resume: the shard reopens its data channel, re-publishes and grants; data flows again.
    learner.sock.close(linger=0)
    learner.sock = bus.socket(zmq.DEALER, identity=b"learner-0", rcvhwm=0)
    learner.sock.connect(learner.link.endpoint("learners"))
    learner.publish(1)
    learner.grant(4)
    got = actor.wait_params(newer_than=0, timeout_s=WAIT_S)
    assert got is not None and got.policy_version == 1
    push = bus.socket(zmq.PUSH)
    push.connect(actor.endpoint("trajectories"))
    push.send_multipart(P.encode(trajectory("run-k", "actor-0", 0, version=1)))
    collect([learner], 1, regrant=False)
    assert counters(broker, bus)["forwarded"] == 1


def test_learner_credit_restarts_with_a_control_rehello(broker: BrokerHandle, bus: Bus) -> None:
    shard = start_run(bus, broker)
    shard.grant(5)
    wait_for(lambda: status(broker, bus)["members"]["learner-0"]["credit"] == 5, WAIT_S, "the grant")
    # The shard's control session is replaced (its link timed out and said hello again): the broker
    # cannot know what the shard will re-grant, so credit starts from zero and the shard grants again
    # after the welcome (as DataChannel.regrant does); the window is never counted twice.
    control = bus.socket(zmq.DEALER)
    control.connect(broker.connect)
    control.send_multipart(P.encode(P.Hello(role="learner", peer_id="learner-0", run_id="run-a")))
    assert isinstance(recv_control(control), P.Welcome)
    assert status(broker, bus)["members"]["learner-0"]["credit"] == 0
    shard.grant(5)
    wait_for(lambda: status(broker, bus)["members"]["learner-0"]["credit"] == 5, WAIT_S, "the new grant")
    actor = Pusher(bus, broker, "actor-0")
    for seq in range(5):
        assert actor.send(trajectory("run-a", "actor-0", seq))
    collect([shard], 5, regrant=False)


# ------------------------------------------------------------------------------------------------
# 8. Liveness
# ------------------------------------------------------------------------------------------------


def test_silent_member_expires_and_unknown_heartbeats_get_rehello(fast_broker: ProfiledBroker, bus: Bus) -> None:
    broker = fast_broker
    alive = bus.link(broker.connect, P.Hello(role="actor", peer_id="alive"))  # heartbeats on its own
    welcome = alive.wait_welcome(WAIT_S)
    assert welcome.heartbeat_interval_s == 0.2 and welcome.heartbeat_liveness == 3
    ghost = bus.socket(zmq.DEALER)
    ghost.connect(broker.connect)
    ghost.send_multipart(P.encode(P.Hello(role="actor", peer_id="ghost")))
    assert isinstance(recv_control(ghost), P.Welcome)
    silent_since = time.monotonic()
    assert "ghost" in status(broker, bus)["members"]
    wait_for(lambda: "ghost" not in status(broker, bus)["members"], WAIT_S, "the silent member to expire")
    assert time.monotonic() - silent_since >= 0.2 * 3
    assert "alive" in status(broker, bus)["members"], "a heartbeating member must not expire"
    assert counters(broker, bus)["expired_or_left"] == 1

    ghost.send_multipart(P.encode(P.Heartbeat(peer_id="ghost", policy_version=0)))
    while True:  # skip the broker's own heartbeats sent before the expiry
        msg = recv_control(ghost)
        if not isinstance(msg, P.Heartbeat):
            break
    assert isinstance(msg, P.Reject) and msg.rehello

    stranger = bus.socket(zmq.DEALER)
    stranger.connect(broker.connect)
    stranger.send_multipart(P.encode(P.Heartbeat(peer_id="stranger")))
    msg = recv_control(stranger)
    assert isinstance(msg, P.Reject) and msg.rehello


def test_bye_removes_the_member_at_once(broker: BrokerHandle, procs: Procs, bus: Bus) -> None:
    link = bus.link(broker.connect, P.Hello(role="actor", peer_id="leaver"))
    assert link.wait_welcome(WAIT_S)
    assert "leaver" in status(broker, bus)["members"]
    link.close("done for today")
    # Expiry would take 3-4 s; the bye is handled at once.
    wait_for(lambda: "leaver" not in status(broker, bus)["members"], 2.0, "the bye to remove the member")
    assert "actor leaver left: done for today" in procs.log("broker")


def test_monitor_role_is_welcomed(broker: BrokerHandle, bus: Bus) -> None:
    link = bus.link(broker.connect, P.Hello(role="monitor", peer_id="mon"))
    assert link.wait_welcome(WAIT_S) is not None
    assert status(broker, bus)["members"]["mon"]["role"] == "monitor"


# ------------------------------------------------------------------------------------------------
# 9. `zddrl status`
# ------------------------------------------------------------------------------------------------


def test_status_cli_table_json_and_dead_broker(broker: BrokerHandle, bus: Bus) -> None:
    learner = start_run(bus, broker)
    actor = Pusher(bus, broker, "actor-0")
    actor.link.send(P.Stats(sender="actor-0", role="actor", stats={"sps": 1234.0, "comm_share": 0.25}))
    learner_stats = {"policy_version": 0, "updates": 0, "return_mean_20": None, "lag/actor-0": 1, "dropped_late": 0}
    learner.link.send(P.Stats(sender="learner-0", role="learner", stats=learner_stats))
    wait_for(lambda: status(broker, bus)["members"]["actor-0"]["stats"].get("sps") == 1234.0
             and status(broker, bus)["members"]["learner-0"]["stats"] == learner_stats, WAIT_S, "both stats")

    table = cli("status", "--connect", broker.connect)
    assert table.returncode == 0, table.stderr
    assert "run run-a" in table.stdout and "[ok]" in table.stdout
    assert "trajectories: received 0 = forwarded 0" in table.stdout
    rows = {ln.split()[0]: ln.split() for ln in table.stdout.splitlines() if ln.startswith(("actor-0", "learner-0"))}
    assert rows["actor-0"][1] == "actor" and "1234" in rows["actor-0"] and "25%" in rows["actor-0"]
    assert rows["learner-0"][1] == "learner"
    with pytest.raises(json.JSONDecodeError):
        json.loads(table.stdout)

    as_json = cli("status", "--connect", broker.connect, "--json")
    assert as_json.returncode == 0, as_json.stderr
    body = json.loads(as_json.stdout)
    assert body["broker"]["ports"] == broker.bound_ports and set(body["members"]) == {"actor-0", "learner-0"}

    (dead,) = free_ports(1)
    t0 = time.monotonic()
    out = cli("status", "--connect", f"tcp://127.0.0.1:{dead}", "--timeout", "0.5")
    assert out.returncode != 0
    assert f"no answer from a broker at tcp://127.0.0.1:{dead} within 0.5 s" in out.stderr
    assert time.monotonic() - t0 < 10


def test_a_second_live_process_with_the_same_peer_id_is_refused(procs: Procs, broker: BrokerHandle) -> None:
    """Two actors started with the same --actor-id: the second exits with a clear error, the first keeps its id."""
    first = procs.start("actor-a", "actor", "--connect", broker.connect, "--actor-id", "0")
    wait_for(lambda: "actor-0" in json.loads(cli("status", "--connect", broker.connect, "--json").stdout)["members"],
             WAIT_S, "the first actor to join")
    second = procs.start("actor-b", "actor", "--connect", broker.connect, "--actor-id", "0")
    assert second.wait(timeout=WAIT_S) != 0
    assert "peer id 'actor-0' is in use by pid" in procs.log("actor-b")
    body = json.loads(cli("status", "--connect", broker.connect, "--json").stdout)
    assert body["members"]["actor-0"]["pid"] == first.pid and first.poll() is None
    assert not any("replaced by" in d["reason"] for d in body.get("departures", []))
