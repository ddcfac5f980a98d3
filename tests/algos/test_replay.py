"""zddrl.algos.replay_buffer.prioritized: priorities and importance weights against a slow reference, next
observations across episode ends and ring wrap-around, dtypes, version filtering, the memory check and checkpoints."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from test_replay_nstep import slow_nstep

from zddrl.algos.replay_buffer.memory import check_fits
from zddrl.algos.replay_buffer.prioritized import PrioritizedReplay, ReplayMemoryError, replay_nbytes

ATARI = (4, 84, 84)


def rollout(rng: np.random.Generator, T: int, N: int, obs_shape=(2,), p_end: float = 0.2, dtype=np.float32) -> dict:
    """A rollout's arrays as an actor ships them, episode ends at random, every truncation's final observation."""
    terminated = rng.random((T, N)) < p_end
    truncated = rng.random((T, N)) < p_end
    trunc_idx = np.flatnonzero(truncated & ~terminated)
    return {
        "obs": rng.integers(0, 255, (T, N, *obs_shape)).astype(dtype),
        "actions": rng.integers(0, 4, (T, N)),
        "rewards": rng.standard_normal((T, N)).astype(np.float32),
        "terminated": terminated,
        "truncated": truncated,
        "next_obs": rng.integers(0, 255, (N, *obs_shape)).astype(dtype),
        "trunc_idx": trunc_idx,
        "trunc_obs": rng.integers(0, 255, (len(trunc_idx), *obs_shape)).astype(dtype),
    }


class SlowReplay:
    """The buffer's priority bookkeeping in plain Python: ``{id: priority}`` of the transitions it holds."""

    def __init__(self, capacity: int, alpha: float, eps: float, beta0: float, beta_steps: int) -> None:
        self.capacity, self.alpha, self.eps, self.beta0, self.beta_steps = capacity, alpha, eps, beta0, beta_steps
        self.priority: dict[int, float] = {}
        self.written, self.max_priority, self.samples = 0, 1.0, 0

    def insert(self, T: int, N: int, K: int, td: np.ndarray | None) -> None:
        if td is not None:
            new = [(abs(float(d)) + self.eps) ** self.alpha for d in td.reshape(-1)]
            self.max_priority = max([self.max_priority, *new])
        else:
            new = [self.max_priority] * (T * N)
        for j, p in enumerate(new):
            self.priority[self.written + j] = p
        self.written += T * N + N + K
        self.priority = {i: p for i, p in self.priority.items() if i >= self.written - self.capacity}

    def update(self, ids: list[int], td: list[float]) -> None:
        for i, d in zip(ids, td):
            if i in self.priority:
                self.priority[i] = (abs(d) + self.eps) ** self.alpha
                self.max_priority = max(self.max_priority, self.priority[i])

    def weights(self, ids: list[int]) -> list[float]:
        """w_i = (N P(i))^-beta / max_j w_j, as the paper writes it."""
        beta = self.beta0 + (1 - self.beta0) * min(1.0, self.samples / self.beta_steps)
        total, n = sum(self.priority.values()), len(self.priority)
        w = {i: (n * p / total) ** -beta for i, p in self.priority.items()}
        w_max = max(w.values())
        return [w[i] / w_max for i in ids]


def test_priorities_and_weights_match_the_slow_reference() -> None:
    rng = np.random.default_rng(5)
    kw = dict(alpha=0.7, eps=1e-3, beta0=0.4, beta_steps=25)
    buf = PrioritizedReplay(61, (2,), seed=1, **kw)
    ref = SlowReplay(61, **kw)
    for step in range(60):
        T, N = int(rng.integers(1, 5)), int(rng.integers(1, 4))
        arrays = rollout(rng, T, N)
        td = rng.standard_normal((T, N)) * 3 if step % 3 == 0 else None
        buf.insert_arrays(arrays, version=step, td_errors=td)
        ref.insert(T, N, len(arrays["trunc_idx"]), td)
        batch = buf.sample(16)
        np.testing.assert_allclose(batch.weights, ref.weights(batch.ids.tolist()), rtol=1e-5)
        ref.samples += 1
        assert buf.beta == pytest.approx(0.4 + 0.6 * min(1.0, ref.samples / 25))
        ids = np.unique(batch.ids)
        td_new = rng.standard_normal(ids.size)
        assert buf.update_priorities(ids, td_new) == ids.size
        ref.update(ids.tolist(), td_new.tolist())
        held = np.array(sorted(ref.priority))
        assert len(buf) == len(held)
        np.testing.assert_allclose(buf.tree.get(held % 61), [ref.priority[i] for i in held], rtol=1e-12)
        assert buf.tree.total == pytest.approx(sum(ref.priority.values()), rel=1e-9)
        assert buf.max_priority == pytest.approx(ref.max_priority)


def expected_next(arrays: dict, t: int, i: int, k: int) -> np.ndarray:
    """s_{t+k}, as replay_buffer/nstep.py defines it; after a termination the transition's own observation."""
    last = t + k - 1
    if arrays["terminated"][last, i]:
        return arrays["obs"][t, i]
    if arrays["truncated"][last, i]:
        N = arrays["obs"].shape[1]
        return arrays["trunc_obs"][list(arrays["trunc_idx"]).index(last * N + i)]
    if t + k == arrays["obs"].shape[0]:
        return arrays["next_obs"][i]
    return arrays["obs"][t + k, i]


@pytest.mark.parametrize("capacity", [23, 64])
def test_next_obs_and_returns_stay_right_across_wrap_around(capacity: int) -> None:
    rng = np.random.default_rng(capacity)
    buf = PrioritizedReplay(capacity, (2,), gamma=0.9, n_step=3)
    held: dict[int, tuple] = {}  # id -> (rollout, its n-step returns, t, i)
    for _ in range(50):  # about 400 slots: the ring wraps 6 to 17 times
        T, N = int(rng.integers(1, 6)), int(rng.integers(1, 4))
        arrays = rollout(rng, T, N, p_end=0.25)
        ids = buf.insert_arrays(arrays, version=0)
        nstep = slow_nstep(arrays["rewards"], arrays["terminated"], arrays["truncated"], 0.9, 3)
        held.update({int(ids[t, i]): (arrays, nstep, t, i) for t in range(T) for i in range(N)})
        alive = sorted(j for j in held if j >= buf.written - capacity)
        got = buf.get(alive)
        assert len(buf) == len(alive)
        for row, j in enumerate(alive):
            arrays, (G, D, K), t, i = held[j]
            np.testing.assert_array_equal(got.obs[row], arrays["obs"][t, i])
            np.testing.assert_array_equal(got.next_obs[row], expected_next(arrays, t, i, K[t, i]))
            assert got.actions[row] == arrays["actions"][t, i]
            assert got.returns[row] == pytest.approx(G[t, i], rel=1e-5, abs=1e-5)
            assert got.discounts[row] == pytest.approx(D[t, i], rel=1e-6)


def test_uint8_stays_uint8() -> None:
    rng = np.random.default_rng(0)
    buf = PrioritizedReplay(50, ATARI, np.uint8)
    assert buf.nbytes == replay_nbytes(50, ATARI, np.uint8) < 50 * (2 * 4 * 84 * 84)
    arrays = rollout(rng, 4, 2, ATARI, dtype=np.uint8)
    ids = buf.insert_arrays(arrays, version=0)
    batch = buf.sample(8)
    assert batch.obs.dtype == batch.next_obs.dtype == buf.obs.dtype == np.uint8
    got = buf.get(ids[:2].reshape(-1))
    np.testing.assert_array_equal(got.obs, arrays["obs"][:2].reshape(-1, *ATARI))
    with pytest.raises(ValueError, match="obs is float32, the buffer stores uint8"):
        buf.insert_arrays({**arrays, "obs": arrays["obs"].astype(np.float32)}, version=0)


def test_bad_rollouts_are_refused_with_the_reason() -> None:
    rng = np.random.default_rng(1)
    buf = PrioritizedReplay(40, (2,))
    arrays = rollout(rng, 3, 2, p_end=0.0)
    arrays["truncated"][1, 0] = True  # a truncation without its final observation
    with pytest.raises(ValueError, match=r"truncated, not terminated steps \[2\]"):
        buf.insert_arrays(arrays, version=0)
    with pytest.raises(ValueError, match="next_obs has shape"):
        buf.insert_arrays({**rollout(rng, 3, 2), "next_obs": np.zeros((3, 2), np.float32)}, version=0)
    with pytest.raises(ValueError, match="versions must be >= 0"):
        buf.insert_arrays(rollout(rng, 3, 2), version=-1)
    with pytest.raises(ValueError, match="does not fit a capacity of 40"):
        buf.insert_arrays(rollout(rng, 13, 3, p_end=0.0), version=0)
    with pytest.raises(ValueError, match="no transition to sample"):
        buf.sample(4)


def test_version_floor_retires_old_transitions_for_good() -> None:
    rng = np.random.default_rng(2)
    buf = PrioritizedReplay(200, (2,))
    ids = {v: buf.insert_arrays(rollout(rng, 4, 2, p_end=0.0), version=v).reshape(-1) for v in (1, 2, 3)}
    assert buf.version_counts() == {1: 8, 2: 8, 3: 8}
    assert buf.drop_older_than(2) == 8
    assert buf.version_counts() == {2: 8, 3: 8} and len(buf) == 16
    assert (buf.sample(256).versions >= 2).all()
    assert buf.update_priorities(ids[1], np.ones(8)) == 0 and buf.stale_updates == 8  # not brought back
    buf.insert_arrays(rollout(rng, 4, 2, p_end=0.0), version=1)  # a late rollout of an old version
    assert len(buf) == 16 and buf.dropped_by_version == 16
    with pytest.raises(ValueError, match="not in the buffer"):
        buf.get(ids[1])
    assert buf.drop_older_than(1) == 0 and buf.version_floor == 2  # the floor only rises


def test_updates_for_overwritten_transitions_are_skipped_and_counted() -> None:
    rng = np.random.default_rng(3)
    buf = PrioritizedReplay(20, (2,))
    buf.insert_arrays(rollout(rng, 3, 2, p_end=0.0), version=0)  # 8 slots: ids 0..5 and two observations
    batch = buf.sample(4)
    for _ in range(3):
        buf.insert_arrays(rollout(rng, 3, 2, p_end=0.0), version=0)  # 24 more slots: the first block is gone
    before = buf.tree.sums.copy()
    assert buf.update_priorities(batch.ids, np.full(4, 100.0)) == 0
    assert buf.stale_updates == 4 and np.array_equal(buf.tree.sums, before)
    with pytest.raises(ValueError, match="ids must lie in"):
        buf.update_priorities([buf.written], [1.0])


def test_beta_anneals_linearly_to_one() -> None:
    buf = PrioritizedReplay(40, (2,), beta0=0.4, beta_steps=10)
    buf.insert_arrays(rollout(np.random.default_rng(4), 3, 2), version=0)
    betas = []
    for _ in range(12):
        betas.append(buf.beta)
        buf.sample(2)
    np.testing.assert_allclose(betas, [0.4 + 0.06 * min(s, 10) for s in range(12)])


def test_a_capacity_that_does_not_fit_is_refused_at_construction() -> None:
    with pytest.raises(ReplayMemoryError, match=r"capacity 1,000,000,000 needs .* GiB .* GiB available") as err:
        PrioritizedReplay(10**9, ATARI, np.uint8)
    assert "\n" not in str(err.value)
    check_fits(1000, 10_000, 0.5, available=30_000)
    with pytest.raises(ReplayMemoryError, match="more than 50%"):
        check_fits(1000, 10_000, 0.5, available=15_000)
    with pytest.raises(ValueError, match="int32"):
        PrioritizedReplay(2**31, (1,), np.uint8)


def through_torch(state: dict) -> dict:
    """The checkpoint layer's round trip: arrays as tensors, torch.save, torch.load(weights_only=True)."""
    f = io.BytesIO()
    torch.save({k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in state.items()}, f)
    f.seek(0)
    return torch.load(f, weights_only=True)


@pytest.mark.parametrize("rollouts", [3, 40])  # before and after the ring wraps
def test_state_dict_round_trip_through_a_weights_only_checkpoint(rollouts: int) -> None:
    rng = np.random.default_rng(6)
    make = dict(capacity=97, obs_shape=ATARI, obs_dtype=np.uint8, n_step=2, seed=9)
    buf = PrioritizedReplay(**make)
    for v in range(rollouts):
        buf.insert_arrays(rollout(rng, 3, 2, ATARI, dtype=np.uint8), version=v)
        batch = buf.sample(8)
        buf.update_priorities(batch.ids, rng.standard_normal(8))
    buf.drop_older_than(rollouts // 2)
    copy = PrioritizedReplay(**make)
    copy.load_state_dict(through_torch(buf.state_dict()))
    assert (len(copy), copy.written, copy.fill, copy.samples) == (len(buf), buf.written, buf.fill, buf.samples)
    assert copy.version_counts() == buf.version_counts() and copy.version_floor == buf.version_floor
    assert np.array_equal(copy.tree.sums, buf.tree.sums) and np.array_equal(copy.tree.mins, buf.tree.mins)
    for a, b in zip(copy.sample(32), buf.sample(32)):  # the same generator state: the same draws
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="capacity"):
        PrioritizedReplay(**{**make, "capacity": 98}).load_state_dict(buf.state_dict())
