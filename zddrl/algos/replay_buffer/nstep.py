"""n-step returns for replay, vectorized over envs: what an n-step Q-learning target needs of a rollout.

For the step ``t`` of env ``i`` (time-major ``[T, N]``, the conventions of ``returns.py``: row ``t``
is one ``env.step``, ``terminated``/``truncated`` say the episode ended *after* it), with ``k`` the
number of rewards summed::

    G_t = r_t + gamma r_{t+1} + ... + gamma^(k-1) r_{t+k-1}
    target_t = G_t + discount_t * max_a Q(s_{t+k}, a),   discount_t = gamma^k, or 0 after a termination

``k = min(n, T - t, 1 + first j >= 0 with an episode end at t + j)``: the sum never crosses

* a **termination** at ``t + j``: it stops there and nothing is bootstrapped (``discount = 0``);
* a **truncation** at ``t + j`` (time limit): it stops there too (the rewards after it belong to the
  next episode) and bootstraps from the truncated episode's *final* observation, the one the
  actor ships in ``trunc_obs`` (``s_{t+k}`` is that observation, not ``obs[t + k]``, which is
  the reset observation of the next episode). If both flags are set, termination wins;
* the **rollout's end**: ``s_{t+k}`` with ``t + k = T`` is the rollout's ``next_obs``, so the last
  ``n - 1`` steps of a rollout get shorter sums (``k = T - t``) with their matching discount. Their
  continuation arrives in the actor's next rollout, which the buffer does not wait for.

Ape-X (Horgan et al. 2018, arXiv:1803.00933) computes these on the actor; the same function serves
both sides. Computed and returned in float64; the only Python loop runs over ``n``.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

__all__ = ["NStepReturns", "nstep_returns"]


class NStepReturns(NamedTuple):
    returns: np.ndarray  # [T, N] float64, G_t
    discounts: np.ndarray  # [T, N] float64, gamma^k or 0 after a termination
    steps: np.ndarray  # [T, N] int64, k in 1..n: the bootstrap observation is s_{t+k}


def nstep_returns(
    rewards: np.ndarray, terminated: np.ndarray, truncated: np.ndarray, gamma: float, n: int
) -> NStepReturns:
    """n-step returns, bootstrap discounts and step counts of one time-major rollout (module docstring)."""
    rewards = np.asarray(rewards, dtype=np.float64)
    if rewards.ndim != 2:
        raise ValueError(f"rewards must be time-major [T, N], not of shape {list(rewards.shape)}")
    terminated = np.asarray(terminated).astype(bool, copy=False)
    truncated = np.asarray(truncated).astype(bool, copy=False)
    for name, a in (("terminated", terminated), ("truncated", truncated)):
        if a.shape != rewards.shape:
            raise ValueError(f"{name} has shape {list(a.shape)}, rewards {list(rewards.shape)}")
    if n < 1:
        raise ValueError(f"n must be >= 1, not {n}")
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must lie in [0, 1], not {gamma}")
    T = rewards.shape[0]
    ended = terminated | truncated
    returns = np.zeros_like(rewards)
    steps = np.zeros(rewards.shape, dtype=np.int64)
    summing = np.ones(rewards.shape, dtype=bool)  # start t still adds rewards
    for j in range(min(n, T)):
        # start t adds r_{t+j}: rows 0..T-j-1 of the starts against rows j..T-1 of the rewards
        live = summing[: T - j]
        returns[: T - j] += np.where(live, gamma**j * rewards[j:], 0.0)
        steps[: T - j] += live
        live &= ~ended[j:]
        summing[T - 1 - j] = False  # start T-1-j has just added the rollout's last reward
    last = np.arange(T)[:, None] + steps - 1
    end_terminated = np.take_along_axis(terminated, last, axis=0)
    discounts = np.where(end_terminated, 0.0, np.power(gamma, steps, dtype=np.float64))
    return NStepReturns(returns, discounts, steps)
