"""A learner's side of the replay services (zddrl/replay/client.py) against real ROUTER sockets served by
real ``ReplayStore``s: batches split by priority mass, importance weights over every replay against a slow
reference, priority updates back to the replay that served each row, intake and reports, a replay that is gone."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import zmq
from loguru import logger

from samples import cartpole_trajectory
from zddrl import protocol as P
from zddrl.config import Config
from zddrl.envs import EnvSpec
from zddrl.replay import client as replay_client
from zddrl.replay.client import RemoteReplay
from zddrl.replay.store import ReplayStore

SPEC = EnvSpec((4,), True, 2)
CONFIG = Config().replace(
    {
        "algo.name": "apex",
        "algo.schedule": "async",
        "replay.placement": "service",
        "replay.capacity": 1024,
        "replay.beta": 0.5,
    }
)


class FakeReplay:
    """A ROUTER answering replay_sample with a ReplayStore, on its own thread (what zddrl/replay/service.py does,
    without the broker)."""

    def __init__(self, ctx: zmq.Context, name: str, port: int = 0) -> None:
        self.store = ReplayStore(name, None, logger)
        self.store.adopt(CONFIG, SPEC)
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if port:
            self.sock.bind(f"tcp://127.0.0.1:{port}")
            self.port = port
        else:
            self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.stop = threading.Event()
        self.requests: list[P.ReplaySample] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            if not self.sock.poll(10):
                continue
            identity, body = P.split_routed(self.sock.recv_multipart())
            msg = P.decode(body)
            assert isinstance(msg, P.ReplaySample)
            self.requests.append(msg)
            self.sock.send_multipart([identity, *P.encode(self.store.serve(msg, "r"))])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close(linger=0)


@pytest.fixture
def replays() -> Iterator[tuple[zmq.Context, list[FakeReplay]]]:
    ctx = zmq.Context()
    fakes = [FakeReplay(ctx, "replay-a"), FakeReplay(ctx, "replay-b")]
    try:
        yield ctx, fakes
    finally:
        for f in fakes:
            f.close()
        ctx.destroy(linger=0)


def remote(ctx: zmq.Context, fakes: list[FakeReplay], **kw: object) -> RemoteReplay:
    return RemoteReplay([f.endpoint for f in fakes], CONFIG, SPEC, "r", "learner-0", context=ctx, **kw)


def fill(fake: FakeReplay, rollouts: int, seed: int = 0) -> None:
    for seq in range(rollouts):
        td = np.ones((8, 2), np.float32)  # Ape-X's declared actor_td
        fake.store.take_in(cartpole_trajectory(8, 2, peer_id=f"{fake.store.peer_id}-actor", seq=seq, actor_td=td), None)


def test_a_batch_is_split_by_priority_mass_and_weighted_over_every_replay(replays) -> None:
    ctx, (a, b) = replays
    fill(a, 3)  # 48 transitions of priority 1
    fill(b, 1)  # 16
    b.store.buffer.update_priorities(np.arange(16), np.full(16, 3.0))  # B: 16 x 3^0.6 = mass 30.9 vs A's 48
    r = remote(ctx, [a, b])
    r.refresh()
    mass = {p.endpoint: p.last.total for p in r.peers}
    assert mass[a.endpoint] == pytest.approx(48.0) and mass[b.endpoint] == pytest.approx(16 * 3.0**0.6, rel=1e-4)
    batch = r.sample(100)
    shares = {peer.endpoint: n for peer, n in r._pending_rows}
    assert shares[a.endpoint] + shares[b.endpoint] == 100
    assert abs(shares[a.endpoint] - 100 * 48 / (48 + 16 * 3.0**0.6)) < 1  # largest remainders
    # Slow reference: w_i = (N P(i))^-beta / max_j w_j = (p_i / p_min)^-beta over the union of both buffers.
    p_min = min(a.store.buffer.tree.min, b.store.buffer.tree.min)
    rows = [(a, shares[a.endpoint]), (b, shares[b.endpoint])]
    starts = (0, rows[0][1])
    want = np.concatenate([f.store.buffer.tree.get(batch.ids[s : s + n] % 1024) for (f, n), s in zip(rows, starts)])
    assert np.allclose(batch.weights, (want / p_min) ** -r.beta, rtol=1e-6)
    assert batch.weights.max() <= 1.0 and batch.weights.min() < 1.0
    assert r.beta == pytest.approx(0.5 + 0.5 / CONFIG.replay.beta_steps)


def test_priority_updates_go_back_to_the_replay_that_served_each_row(replays) -> None:
    ctx, (a, b) = replays
    fill(a, 1)
    fill(b, 1)
    r = remote(ctx, [a, b])
    r.refresh()
    batch = r.sample(8)
    td = np.linspace(0.5, 4.0, 8).astype(np.float32)
    r.update_priorities(batch.ids, td)
    r.refresh()  # the updates travel with the next request
    start = 0
    for peer, n in [(a, 4), (b, 4)]:
        got = peer.store.buffer.tree.get(batch.ids[start : start + n] % 1024)
        assert np.allclose(got, (td[start : start + n].astype(np.float64) + 1e-6) ** CONFIG.replay.alpha, rtol=1e-5)
        start += n


def test_intake_reports_and_the_share_of_room_each_replay_is_allowed(replays) -> None:
    ctx, (a, b) = replays
    r = remote(ctx, [a, b])
    r.refresh()
    fill(a, 2)  # 32 steps, one finished episode
    fill(b, 1)  # 16
    r.room = 100
    r.refresh()
    assert r.intake() == (48, 0) and r.taken == 48 and r.intake() == (0, 0)
    report = r.take_reports()
    assert (report.env_steps, report.trajectories, report.invalid) == (48, 3, 0)
    assert sorted(report.returns) == [2.0, 2.0, 8.0]
    assert a.requests[-1].report and a.requests[-1].allow_steps == 0 + 50  # inserted as last known + half the room
    r.room = 100 - 48  # what the collecting learner still lacks
    r.refresh()
    assert a.requests[-1].allow_steps == 32 + 26 and b.requests[-1].allow_steps == 16 + 26


def test_a_replay_that_does_not_answer_is_left_out(replays, monkeypatch) -> None:
    monkeypatch.setattr(replay_client, "REPLY_TIMEOUT_S", 0.3)
    ctx, (a, b) = replays
    fill(a, 1)
    fill(b, 1)
    r = remote(ctx, [a, b], prefetch=False)
    r.refresh()
    batch = r.sample(8)
    r.update_priorities(batch.ids, np.ones(8, np.float32))
    b.close()  # gone, with 4 updates owed
    r.refresh(0.3)
    assert [p.alive for p in r.peers] == [True, False]
    assert r.counters["updates_dropped"] + r.counters["timeouts"] >= 1  # unsendable (its updates lost) or silent
    again = r.sample(8)
    assert len(again.ids) == 8 and r._pending_rows[0][0].endpoint == a.endpoint
    assert len(r) == 16  # what the live replays hold


def test_with_no_replay_answering_a_step_is_skipped_and_the_replay_found_again(monkeypatch) -> None:
    """A replay killed mid-run (its answer lost) costs the learner skipped gradient steps, counted, not its run; a
    replay that comes back on the same endpoint is sampled again after the next refresh."""
    monkeypatch.setattr(replay_client, "REPLY_TIMEOUT_S", 0.3)
    ctx = zmq.Context()
    a = FakeReplay(ctx, "replay-a")
    try:
        fill(a, 1)
        r = remote(ctx, [a], prefetch=False)
        r.refresh()
        assert r.sample(8) is not None
        a.close()
        assert r.sample(8) is None and r.counters["missed_batches"] == 1 and r.counters["timeouts"] == 1
        assert len(r) == 0 and r.sample(8) is None  # nobody is asked while none is known alive
        assert r.counters["timeouts"] == 1 and r.counters["missed_batches"] == 2
        back = FakeReplay(ctx, "replay-a", port=a.port)  # restarted on the same port, holding data again
        try:
            fill(back, 1)
            deadline = time.monotonic() + 10
            while not r.peers[0].alive and time.monotonic() < deadline:
                r.refresh(0.3)
            batch = r.sample(8)
            assert batch is not None and len(batch.ids) == 8
        finally:
            back.close()
    finally:
        ctx.destroy(linger=0)


def test_the_next_batch_is_asked_for_ahead_and_its_updates_go_one_request_later(replays) -> None:
    ctx, (a, b) = replays
    fill(a, 2)
    r = remote(ctx, [a])
    r.refresh()
    first = r.sample(8)
    assert first is not None
    deadline = time.monotonic() + 5
    while len(a.requests) < 3 and time.monotonic() < deadline:  # refresh, the batch, the batch asked ahead
        time.sleep(0.01)
    assert [m.batch for m in a.requests] == [0, 8, 8]
    r.update_priorities(first.ids, np.full(8, 2.0, np.float32))
    r.refresh()  # its answer comes while the batch asked ahead is pending: that one is kept, not lost
    second = r.sample(8)
    assert second is not None and len(second.ids) == 8
    assert [m.batch for m in a.requests[:4]] == [0, 8, 8, 0]  # no new request for the second batch
    assert len(a.requests[3].arrays["ids"]) == 8  # the first batch's updates went with the refresh after it
