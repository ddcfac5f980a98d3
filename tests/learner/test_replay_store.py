"""The replay service's buffer and books (zddrl/replay/store.py): intake checked and counted, reports,
requests, runs that keep or replace the buffer, and state saved and loaded."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from loguru import logger

import samples
from zddrl import protocol as P
from zddrl.config import Config
from zddrl.envs import EnvSpec
from zddrl.replay.store import ReplayStore

SPEC = EnvSpec((4,), True, 2)


def config(**over: object) -> Config:
    base = {
        "algo.name": "apex",
        "algo.schedule": "async",
        "replay.placement": "service",
        "replay.capacity": 512,
        "env.rollout_len": 16,
    }
    return Config().replace({**base, **over})


def store(tmp_path: Path | None = None, **over: object) -> ReplayStore:
    s = ReplayStore("replay-0", tmp_path, logger)
    s.adopt(config(**over), SPEC)
    return s


def cartpole_trajectory(T: int, N: int, peer_id: str = "a", seq: int = 0) -> P.Trajectory:
    """An Ape-X rollout: its actors' declared TD errors (``actor_td``) beside every trajectory's arrays."""
    return samples.cartpole_trajectory(T, N, peer_id, seq, actor_td=np.ones((T, N), np.float32))


def request(**kw: object) -> P.ReplaySample:
    fields: dict = dict(run_id="r", peer_id="learner-0", request=1, batch=0, allow_steps=0, policy_version=0)
    fields.update(rollout_len=16, report=True)
    return P.ReplaySample(**{**fields, **kw})


def test_intake_counts_steps_trajectories_and_finished_episodes() -> None:
    s = store()
    for seq in range(3):  # env 0 is truncated at step 1 of every rollout: one finished episode each
        s.take_in(cartpole_trajectory(8, 2, seq=seq), None)
    assert s.inserted == 48 and len(s.buffer) == 48
    reply = s.serve(request(), "r")
    assert (reply.env_steps, reply.trajectories, reply.invalid) == (48, 3, 0)
    # Env 0 ends at step 1 of each rollout of 8 (reward 1 a step): 2 steps in the first, then 6 + 2 across rollouts.
    assert reply.ep_returns == [2.0, 8.0, 8.0]
    again = s.serve(request(request=2), "r")
    assert (again.env_steps, again.trajectories, again.ep_returns) == (0, 0, [])  # reported once only
    assert again.inserted == 48


def test_refused_trajectories_are_counted_not_inserted() -> None:
    s = store()
    wrong = cartpole_trajectory(8, 2)
    arrays = {**wrong.arrays, "obs": np.zeros((8, 2, 5), np.float32), "next_obs": np.zeros((2, 5), np.float32)}
    arrays["trunc_obs"] = np.zeros((1, 5), np.float32)
    s.take_in(P.Trajectory(**{**wrong.__dict__, "arrays": arrays}), None)  # observations of another env
    future = cartpole_trajectory(8, 2, seq=1)
    s.take_in(P.Trajectory(**{**future.__dict__, "policy_version": 5}), None)  # a version never published
    assert s.inserted == 0 and len(s.buffer) == 0
    assert s.counters["invalid"] == 2 and s.counters["received"] == 2
    assert s.serve(request(), "r").invalid == 2


def test_serve_draws_a_batch_with_its_priorities_and_applies_updates() -> None:
    s = store()
    s.take_in(cartpole_trajectory(16, 2), None)
    reply = s.serve(request(batch=8), "r")
    a = reply.arrays
    assert a["ids"].shape == (8,) and a["obs"].shape == (8, 4) and a["priorities"].dtype == np.float64
    assert np.allclose(a["priorities"], s.buffer.max_priority)  # new transitions: the largest priority seen
    assert reply.held == 32 and reply.total == pytest.approx(32 * s.buffer.max_priority)
    ids = a["ids"][:2]
    s.serve(request(request=2, arrays={"ids": ids, "td_errors": np.array([3.0, 0.0], np.float32)}), "r")
    rc = config().replay
    got = s.buffer.tree.get(ids % s.buffer.capacity)
    assert np.allclose(got, (np.array([3.0, 0.0]) + s.buffer.eps) ** rc.alpha)


def test_bad_priority_updates_are_skipped_and_counted() -> None:
    s = store()
    s.take_in(cartpole_trajectory(8, 2), None)
    bad = {"ids": np.array([10_000], np.int64), "td_errors": np.ones(1, np.float32)}  # never given out
    reply = s.serve(request(arrays=bad), "r")
    assert s.counters["bad_updates"] == 1 and reply.held == 16


def test_a_new_run_keeps_the_buffer_only_with_the_same_layout() -> None:
    s = store()
    s.take_in(cartpole_trajectory(8, 2), None)
    assert "kept 16" in s.adopt(config(name="again"), SPEC)  # a restarted learner: same layout
    assert len(s.buffer) == 16
    assert "new buffer" in s.adopt(config(**{"replay.capacity": 1024}), SPEC)
    assert len(s.buffer) == 0 and s.buffer.capacity == 1024


def test_state_is_saved_and_loaded_by_a_new_process(tmp_path: Path) -> None:
    s = store(tmp_path)
    for seq in range(3):
        s.take_in(cartpole_trajectory(8, 2, seq=seq), None)
    s.save()
    fresh = ReplayStore("replay-0", tmp_path, logger)
    line = fresh.adopt(config(), SPEC)
    assert line.startswith("loaded 48 transitions")
    assert fresh.inserted == 48 and len(fresh.buffer) == 48
    a, b = s.serve(request(batch=4), "r").arrays, fresh.serve(request(batch=4), "r").arrays
    assert np.array_equal(a["ids"], b["ids"]) and np.array_equal(a["obs"], b["obs"])  # the same sampling stream


def test_a_saved_state_of_another_layout_or_a_torn_save_is_not_loaded(tmp_path: Path) -> None:
    s = store(tmp_path)
    s.take_in(cartpole_trajectory(8, 2), None)
    s.save()
    other = ReplayStore("replay-0", tmp_path, logger)
    assert "another layout" in other.adopt(config(**{"replay.capacity": 1024}), SPEC)
    (tmp_path / "replay_state.npz").write_bytes(b"torn")  # the arrays of another save than the JSON's
    torn = ReplayStore("replay-0", tmp_path, logger)
    assert torn.adopt(config(), SPEC).startswith("new buffer") and len(torn.buffer) == 0
