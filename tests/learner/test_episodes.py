"""Issue 13, attack 2: "episode returns of 1e9 and total_env_steps 1e15 end the run with reached: true". Env
steps and episode returns are now the learner's own reading of the arrays it verified (``episodes.py``): checked
here against a slow step-by-step walk over the concatenated rollouts, and end to end through the collector."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from loguru import logger

from fakes import FakeChannel, FakeLink
from samples import rollout_of
from zddrl import protocol as P
from zddrl.config import Config
from zddrl.intake.episodes import REORDER_WINDOW, Episodes, segments_of
from zddrl.intake.records import record_of, records_of
from zddrl.learner.ledger import Ledger
from zddrl.learner.poll import ShardPoller
from zddrl.learner.rounds import AsyncStream
from zddrl.shards.group import ShardGroup


def rollouts(n: int, T: int, N: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """``n`` consecutive rollouts' rewards and episode-end flags (random, some episodes longer than a rollout)."""
    rng = np.random.default_rng(seed)
    return [
        {
            "rewards": rng.normal(1.0, 2.0, (T, N)).astype(np.float32),
            "terminated": rng.random((T, N)) < 0.08,
            "truncated": rng.random((T, N)) < 0.04,
        }
        for _ in range(n)
    ]


def slow_episodes(parts: list[dict[str, np.ndarray] | None]) -> list[tuple[float, int]]:
    """Walk every column step by step over the rollouts in order; None is a lost rollout. A column's episode is
    reported only if the walk saw all of it (from step 0 of the first rollout, or from an earlier episode end)."""
    N = next(p for p in parts if p is not None)["rewards"].shape[1]
    ret, length, known = [0.0] * N, [0] * N, [True] * N
    out = []
    for p in parts:
        if p is None:
            known = [False] * N
            continue
        T = p["rewards"].shape[0]
        for n in range(N):
            for t in range(T):
                ret[n] += float(p["rewards"][t, n])
                length[n] += 1
                known[n] = known[n] and bool(np.isfinite(p["rewards"][t, n]))  # a NaN reward breaks its episode
                if p["terminated"][t, n] or p["truncated"][t, n]:
                    if known[n]:
                        out.append((ret[n], length[n]))
                    ret[n], length[n], known[n] = 0.0, 0, True
    return out


def same(a: list[tuple[float, int]], b: list[tuple[float, int]]) -> None:
    assert len(a) == len(b)
    a, b = sorted(a, key=lambda e: (e[1], e[0])), sorted(b, key=lambda e: (e[1], e[0]))
    np.testing.assert_allclose([r for r, _ in a], [r for r, _ in b], rtol=1e-9, atol=1e-9)
    assert [n for _, n in a] == [n for _, n in b]


def test_episodes_match_a_step_by_step_walk_over_the_rollouts() -> None:
    parts = rollouts(12, 7, 3)
    ep = Episodes()
    got = [e for seq, p in enumerate(parts) for e in ep.add("a", "x", seq, segments_of(p))]
    assert len(got) > 10
    same(got, slow_episodes(parts))


def test_out_of_order_rollouts_within_the_window_change_nothing() -> None:
    parts = rollouts(12, 5, 2, seed=1)
    order = [0, 2, 1, 3, 5, 6, 4, 9, 7, 8, 11, 10]  # how learner shards may hand an actor's stream to the main one
    ep = Episodes()
    got = [e for seq in order for e in ep.add("a", "x", seq, segments_of(parts[seq]))]
    same(got, slow_episodes(parts))


def test_a_refused_or_lost_rollout_breaks_the_episodes_it_cuts() -> None:
    parts = rollouts(8 + REORDER_WINDOW + 2, 6, 3, seed=2)
    ep = Episodes()
    got = []
    for seq, p in enumerate(parts):
        if seq == 3:
            got += ep.add("a", "x", seq, None)  # refused by the run: its rewards were never read
        elif seq != 6:  # never arrives: given up once REORDER_WINDOW later ones wait for it
            got += ep.add("a", "x", seq, segments_of(p))
    same(got, slow_episodes([None if seq in (3, 6) else p for seq, p in enumerate(parts)]))


def test_a_non_finite_reward_breaks_its_own_episode_only() -> None:
    """A rollout refused for a NaN reward is still read for its rewards' shape: the other columns carry on."""
    parts = rollouts(10, 6, 3, seed=4)
    parts[2]["rewards"][3, 1] = np.nan
    parts[5]["rewards"][0, 0] = np.inf
    ep = Episodes()
    got = [e for seq, p in enumerate(parts) for e in ep.add("a", "x", seq, segments_of(p))]
    same(got, slow_episodes(parts))
    assert all(np.isfinite(r) for r, _ in got)


def test_a_stream_that_does_not_start_at_seq_0_or_restarts_is_unknown_until_an_episode_ends() -> None:
    parts = rollouts(6, 5, 2, seed=3)
    ep = Episodes()
    got = [e for seq, p in enumerate(parts[:3]) for e in ep.add("a", "x", seq + 40, segments_of(p))]
    same(got, slow_episodes([None, *parts[:3]]))  # an actor host that served an earlier run: mid-episode
    got = [e for seq, p in enumerate(parts[3:]) for e in ep.add("a", "y", seq, segments_of(p))]
    same(got, slow_episodes(parts[3:]))  # a new process (envs just reset) under the same id


@pytest.mark.parametrize("width", [2, 3])
def test_records_carry_the_segments_through_the_shards_exchange(width: int) -> None:
    msg = rollout_of("a", 0, 0, T=5, N=width, trunc_at=(2, 1))
    [record] = records_of([list(record_of(msg, fresh=True, used=True))])
    assert record.segments == segments_of(msg.arrays)
    assert record_of(msg, fresh=True, used=False, invalid="bad").segments is None  # refused: never read


def forged(seq: int, T: int = 4) -> P.Trajectory:
    """An honest rollout of CartPole rewards (1 per step, an episode ending at step 1) under a forged header:
    1e9 returns and a cumulative step count of 1e15."""
    t = rollout_of("a", seq, 0, T=T, N=1, trunc_at=(1, 0), ep_returns=(1e9, 1e9))
    info = {"total_env_steps": 10**15, "incarnation": "x"}
    return P.Trajectory(**{**t.__dict__, "info": info})


def test_forged_returns_and_step_totals_in_the_header_do_not_end_the_run() -> None:
    config = Config().replace(
        {"algo.name": "ppo", "algo.schedule": "async", "algo.batch_size": 4, "train.until_return": 500.0}
    )
    ledger = Ledger(config, logger, time.time())
    channel = FakeChannel([forged(seq) for seq in range(30)])
    poller = ShardPoller(FakeLink(), lambda: channel, "r", ShardGroup(), lambda m: "", logger)
    stream = AsyncStream(poller, config, ledger)
    for _ in range(30):
        assert not ledger.finished()
        ledger.row({"batch_steps": 4}, policy_version=0)
        stream.collect(threading.Event(), 0)
    summary = ledger.summary()
    assert summary["total_env_steps"] == 30 * 4 and not ledger.finished()
    assert not summary["reached"] and summary["return_mean_20"] < 5
    assert summary["episodes"] == 30 and summary["return_mean_20"] == 4.0  # each rollout ends one at its step 1


def test_what_the_learner_keeps_per_actor_is_bounded_whatever_the_peer_ids() -> None:
    from zddrl.algos.core import REWARD_STREAMS_KEPT, RewardScaler
    from zddrl.intake.episodes import STREAMS_KEPT
    from zddrl.learner.ledger import LAG_KEPT

    ledger, scaler = Ledger(Config(), logger, time.time()), RewardScaler(0.99)
    parts = rollouts(1, 2, 1)[0]
    for i in range(max(LAG_KEPT, STREAMS_KEPT, REWARD_STREAMS_KEPT) + 10):
        msg = rollout_of(f"actor-{i}", 0, 0, T=2, N=1)
        ledger.account(record_of(msg, fresh=True, used=True), 0)
        scaler.discounted(f"actor-{i}", parts["rewards"], parts["terminated"])
    assert len(ledger.lag) == LAG_KEPT and len(ledger.episodes.streams) == STREAMS_KEPT
    assert len(scaler.returns) == REWARD_STREAMS_KEPT and "actor-0" not in ledger.lag
