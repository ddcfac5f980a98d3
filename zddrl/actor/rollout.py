"""One rollout of an actor host: ``T`` steps of its vector env with a policy, into the arrays a trajectory carries
(docs/protocol.md section 7) and the episodes that ended in it."""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from zddrl.algos.policy import Policy
from zddrl.envs import ActorEnvs


class RolloutBuffer:
    """Preallocated time-major buffers for one rollout of ``T`` steps of ``N`` envs."""

    def __init__(self, T: int, vec: ActorEnvs) -> None:
        N, spec = vec.num_envs, vec.spec
        self.T, self.N = T, N
        self.obs = np.zeros((T, N, *spec.obs_shape), dtype=vec.dtype)  # uint8 pixels stay uint8 (4x fewer bytes)
        self.actions = np.zeros(
            (T, N) if spec.discrete else (T, N, spec.action_dim), dtype=np.int64 if spec.discrete else np.float32
        )
        self.logp = np.zeros((T, N), dtype=np.float32)
        self.values = np.zeros((T, N), dtype=np.float32)
        self.rewards = np.zeros((T, N), dtype=np.float32)
        self.terminated = np.zeros((T, N), dtype=bool)
        self.truncated = np.zeros((T, N), dtype=bool)
        self.life_lost = np.zeros((T, N), dtype=bool)
        self.q_taken = np.zeros((T, N), dtype=np.float32)
        """apex: Q(s, a) of the actions taken, for the TD errors (not sent)."""


class Collected(NamedTuple):
    """One rollout as a trajectory carries it: its arrays (frames) and its episode figures (header)."""

    arrays: dict[str, np.ndarray]
    ep_returns: list[float]
    ep_lengths: list[int]
    nonfinite_episodes: int = 0
    """Episodes that ended with a non-finite return (an env's NaN or infinite reward), left out of the figures:
    the protocol wants them finite. The rollout whose rewards frame carried the non-finite reward (this one or
    an earlier one) is the learner's to drop as invalid (counted for this actor); this actor lives on."""


def collect(vec: ActorEnvs, policy: Policy, rng: np.random.Generator, T: int) -> Collected:
    """Step ``vec`` for ``T`` steps with ``policy``; return the trajectory's arrays and episode figures
    (docs/protocol.md section 7). The truncation arrays are there only if an episode was truncated."""
    buf = RolloutBuffer(T, vec)
    trunc_idx, trunc_obs = [], []
    vec.finished.clear()
    for t in range(T):
        obs = vec.obs
        out = policy.act(obs, rng)
        buf.obs[t] = obs
        buf.actions[t], buf.logp[t], buf.values[t] = out.actions, out.logp, out.values
        if out.q_taken is not None:
            buf.q_taken[t] = out.q_taken
        _, buf.rewards[t], buf.terminated[t], buf.truncated[t], final_obs = vec.step(out.actions)
        buf.life_lost[t] = vec.life_lost
        for i, fo in final_obs.items():
            if buf.truncated[t, i] and not buf.terminated[t, i]:
                trunc_idx.append(t * vec.num_envs + i)
                trunc_obs.append(fo)
    arrays = {
        "obs": buf.obs,
        "actions": buf.actions,
        "logp": buf.logp,
        "values": buf.values,
        "rewards": buf.rewards,
        "terminated": buf.terminated,
        "truncated": buf.truncated,
        "next_obs": vec.obs.copy(),
        "next_value": policy.value(vec.obs).astype(np.float32),
    }
    if trunc_idx:  # most rollouts have none: three empty frames fewer to send and check
        final = np.stack(trunc_obs).astype(vec.dtype, copy=False)
        arrays.update(
            trunc_idx=np.array(trunc_idx, dtype=np.int64),
            trunc_obs=final,
            trunc_value=policy.value(final).astype(np.float32),
        )
    if vec.episodic_life:
        arrays["life_lost"] = buf.life_lost
    td_errors = getattr(policy, "td_errors", None)  # Ape-X's: the initial priorities, from this actor's estimates
    if td_errors is not None:
        arrays["td_errors"] = td_errors(arrays, buf.q_taken)
    episodes = [(float(r), int(n)) for r, n in vec.finished if math.isfinite(r)]
    return Collected(arrays, [r for r, _ in episodes], [n for _, n in episodes], len(vec.finished) - len(episodes))
