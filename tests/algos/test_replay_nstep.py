"""zddrl.algos.replay_buffer.nstep: n-step returns against a slow loop written from the definition."""

from __future__ import annotations

import numpy as np
import pytest

from zddrl.algos.replay_buffer.nstep import nstep_returns


def slow_nstep(rewards, terminated, truncated, gamma, n):
    """Per env, per start: add rewards until n of them, an episode end (included) or the rollout's end."""
    T, N = rewards.shape
    G, D, K = np.zeros((T, N)), np.zeros((T, N)), np.zeros((T, N), dtype=int)
    for i in range(N):
        for t in range(T):
            total, k = 0.0, 0
            while True:
                total += gamma**k * float(rewards[t + k, i])
                k += 1
                if terminated[t + k - 1, i] or truncated[t + k - 1, i] or k == n or t + k == T:
                    break
            G[t, i], K[t, i] = total, k
            D[t, i] = 0.0 if terminated[t + k - 1, i] else gamma**k
    return G, D, K


def test_random_rollouts_match_the_slow_loop() -> None:
    rng = np.random.default_rng(11)
    for _ in range(300):
        T, N, n = int(rng.integers(1, 12)), int(rng.integers(1, 5)), int(rng.integers(1, 7))
        rewards = rng.standard_normal((T, N)).astype(np.float32)
        terminated = rng.random((T, N)) < 0.15
        truncated = rng.random((T, N)) < 0.15  # some steps carry both: termination wins
        gamma = float(rng.choice([0.0, 0.5, 0.99, 1.0]))
        out = nstep_returns(rewards, terminated, truncated, gamma, n)
        G, D, K = slow_nstep(rewards, terminated, truncated, gamma, n)
        np.testing.assert_allclose(out.returns, G, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(out.discounts, D, rtol=1e-12, atol=0)
        np.testing.assert_array_equal(out.steps, K)


def test_episode_ends_and_the_rollout_boundary_by_hand() -> None:
    # one env, T = 6, n = 3, gamma = 0.5, rewards 1, 2, 4, 8, 16, 32
    # terminated after t = 1, truncated after t = 3; the rollout ends after t = 5
    rewards = np.array([[1.0], [2], [4], [8], [16], [32]])
    terminated = np.array([[0], [1], [0], [0], [0], [0]], bool)
    truncated = np.array([[0], [0], [0], [1], [0], [0]], bool)
    out = nstep_returns(rewards, terminated, truncated, 0.5, 3)
    # t=0: 1 + 2/2 = 2 then the termination, no bootstrap; t=1: 2, terminated
    # t=2: 4 + 8/2 = 8, truncated after t=3: bootstrap s_4 (the final obs) with 0.5^2
    # t=3: 8, truncated: 0.5; t=4: 16 + 32/2 = 32, the rollout's end: next_obs with 0.5^2; t=5: 32, 0.5
    np.testing.assert_allclose(out.returns[:, 0], [2, 2, 8, 8, 32, 32])
    np.testing.assert_allclose(out.discounts[:, 0], [0, 0, 0.25, 0.5, 0.25, 0.5])
    np.testing.assert_array_equal(out.steps[:, 0], [2, 1, 2, 1, 2, 1])


def test_one_step_is_the_plain_td_target() -> None:
    rewards = np.arange(8.0).reshape(4, 2)
    terminated = np.zeros((4, 2), bool)
    terminated[2, 1] = True
    out = nstep_returns(rewards, terminated, np.zeros((4, 2), bool), 0.9, 1)
    np.testing.assert_array_equal(out.returns, rewards)
    np.testing.assert_allclose(out.discounts, np.where(terminated, 0.0, 0.9))
    assert (out.steps == 1).all()


def test_bad_arguments_are_named() -> None:
    flags = np.zeros((3, 2), bool)
    with pytest.raises(ValueError, match="time-major"):
        nstep_returns(np.zeros(3), flags, flags, 0.9, 2)
    with pytest.raises(ValueError, match="truncated"):
        nstep_returns(np.zeros((3, 2)), flags, np.zeros((3, 1), bool), 0.9, 2)
    with pytest.raises(ValueError, match="n must be"):
        nstep_returns(np.zeros((3, 2)), flags, flags, 0.9, 0)
    with pytest.raises(ValueError, match="gamma"):
        nstep_returns(np.zeros((3, 2)), flags, flags, 1.5, 2)
