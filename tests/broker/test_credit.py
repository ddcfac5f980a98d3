"""Credit and backpressure: no credit, no delivery; actors' credit returns, in batches.

The broker runs as a real `zddrl broker` process, driven over raw pyzmq sockets by the test-side clients of
tests/broker_clients.py. Every wait is on a condition with a deadline; the fixtures clean up every socket, link
and process.
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path

import pytest
import zmq

from broker_clients import WAIT_S, ProfiledBroker, Pusher, collect, counters, start_run, status, trajectory
from conftest import BrokerHandle, Bus, Procs, wait_for
from zddrl import protocol as P

# ------------------------------------------------------------------------------------------------
# 2. Credit and backpressure
# ------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_without_credit_nothing_is_delivered_and_the_sender_blocks(broker: BrokerHandle, bus: Bus) -> None:
    shard = start_run(bus, broker)  # grants no credit
    actor = Pusher(bus, broker, "actor-0", sndhwm=2)
    cap, sent = 400, 0  # 400 x 256 KiB: far more than the queues between peer_id and broker hold
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


@pytest.mark.slow
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


@pytest.mark.slow
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
        assert [t.seq for t in shard.trajectories() if t.peer_id == a.peer_id] == list(range(30))


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


@pytest.mark.slow
@pytest.mark.parametrize("max_in_flight,batch", [(2, 1), (8, 4)])
def test_actors_get_their_credit_back_in_batches_of_half_their_limit(
    procs: Procs, tmp_path: Path, bus: Bus, max_in_flight: int, batch: int
) -> None:
    """The run's bus.max_in_flight sets the batch; what a batch leaves pending goes back with the next
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


@pytest.mark.slow
def test_an_actor_gets_the_credit_of_its_malformed_trajectories_back(procs: Procs, tmp_path: Path, bus: Bus) -> None:
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
