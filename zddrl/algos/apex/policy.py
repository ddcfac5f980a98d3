"""Ape-X's actors: epsilon-greedy on the Q-network, and the TD errors they send as the first priorities of their
transitions (Horgan et al. 2018). The policy records ``Q(s, a)`` of each action taken (``q_taken``, a declared array
kept on the actor) and turns it into ``actor_td`` (declared, sent) when the rollout ends (``finish_rollout``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from zddrl.algos.policy import ActOutput
from zddrl.algos.replay_buffer.block import next_offsets
from zddrl.algos.replay_buffer.nstep import nstep_returns


def apex_epsilons(eps_base: float, eps_alpha: float, first: int, count: int, total: int) -> np.ndarray:
    """Exploration of envs ``first .. first + count - 1`` of ``total``: ``eps_base ** (1 + eps_alpha i / (total - 1))``
    (Horgan et al. 2018). Indices past ``total - 1`` start the schedule over (an actor beyond the planned fleet
    explores like one within it, never all at the smallest epsilon); a fleet of one env explores at ``eps_base``."""
    i = np.arange(first, first + count) % max(total, 1)
    return (eps_base ** (1.0 + eps_alpha * i / max(total - 1, 1))).astype(np.float32)


class QPolicy:
    """Epsilon-greedy on a Q-function ``q(obs) -> [N, actions]`` (numpy ``NumpyDuelingQ``, or a torch network
    through ``torch_policy.TorchForward``); ``eps`` ``[N]``: each env's exploration (``apex_epsilons``)."""

    def __init__(
        self, q: Callable[[np.ndarray], np.ndarray], outputs: int, eps: np.ndarray, gamma: float, n_step: int
    ) -> None:
        self.q, self.outputs = q, outputs
        self.eps = np.asarray(eps, dtype=np.float32)
        self.gamma, self.n_step = gamma, n_step

    def value(self, obs: np.ndarray) -> np.ndarray:
        """``max_a Q(s, a)``: the greedy policy's value, what n-step targets bootstrap from."""
        return self.q(obs).max(axis=1)

    def act(self, obs: np.ndarray, rng: np.random.Generator, deterministic: bool = False) -> ActOutput:
        q = self.q(obs)
        n, k = q.shape
        greedy = q.argmax(axis=1)
        actions = greedy
        if not deterministic:
            explore = rng.random(n, dtype=np.float32) < self.eps
            actions = np.where(explore, rng.integers(k, size=n), greedy)
        rows = np.arange(n)
        prob = self.eps / k + (1.0 - self.eps) * (actions == greedy)
        return ActOutput(
            actions.astype(np.int64),
            np.log(prob).astype(np.float32),
            q.max(axis=1).astype(np.float32),
            {"q_taken": q[rows, actions].astype(np.float32)},
        )

    def finish_rollout(self, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The rollout's ``actor_td``: the initial priorities of what this actor sampled, from its ``q_taken``."""
        return {"actor_td": actor_td(arrays, arrays["q_taken"], self.gamma, self.n_step)}


def actor_td(arrays: Mapping[str, np.ndarray], q_taken: np.ndarray, gamma: float, n: int) -> np.ndarray:
    """Ape-X's actor-side TD errors ``[T, N]`` float32 of one rollout, from the acting network's own estimates.

    ``delta_t = G_t + discount_t V(s_{t+k}) - Q(s_t, a_t)``, with ``V(s) = max_a Q(s, a)`` read from the
    rollout's ``values`` (``obs[t + k]``), ``next_value`` (``t + k = T``) or ``trunc_value`` (a truncated
    episode's final observation): the bootstrap observation ``block.next_offsets`` picks, so the same
    transition the buffer stores. ``q_taken``: ``Q(s_t, a_t)`` ``[T, N]``.
    """
    rewards, terminated, truncated = arrays["rewards"], arrays["terminated"], arrays["truncated"]
    T, N = rewards.shape
    ns = nstep_returns(rewards, terminated, truncated, gamma, n)
    trunc_pos = np.full(T * N, -1, dtype=np.int64)
    trunc_value = np.zeros(0, dtype=np.float32)
    if "trunc_idx" in arrays:
        trunc_pos[arrays["trunc_idx"]] = np.arange(len(arrays["trunc_idx"]))
        trunc_value = arrays["trunc_value"]
    offsets = next_offsets(ns.steps, terminated, truncated, trunc_pos.reshape(T, N))
    values = np.concatenate([arrays["values"].reshape(-1), arrays["next_value"], trunc_value])
    return (ns.returns + ns.discounts * values[offsets] - q_taken).astype(np.float32)
