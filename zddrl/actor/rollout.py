"""One rollout of an actor host: ``T`` steps of its vector env with a policy, into the arrays a trajectory carries
(docs/protocol.md section 7), the algorithm's declared arrays among them (``AlgorithmSpec.arrays``, section 7.1),
and the episodes that ended in it."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import NamedTuple

import numpy as np

from zddrl.algos.policy import Policy
from zddrl.algos.spec import DeclaredArray
from zddrl.envs import ActorEnvs


class RolloutBuffer:
    """Preallocated time-major buffers for one rollout of ``T`` steps of ``N`` envs."""

    def __init__(self, T: int, vec: ActorEnvs, declared: tuple[DeclaredArray, ...] = ()) -> None:
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
        self.extras = {a.name: np.zeros(a.rows(T, N), dtype=a.dtype) for a in declared if a.per == "step"}
        """The declared per-step arrays, filled from each step's ``ActOutput.extras``."""
        self.filled = dict.fromkeys(self.extras, 0)
        """Steps whose row of each declared per-step array the policy gave."""


class Collected(NamedTuple):
    """One rollout as a trajectory carries it: its arrays (frames) and its episode figures (header)."""

    arrays: dict[str, np.ndarray]
    ep_returns: list[float]
    ep_lengths: list[int]
    nonfinite_episodes: int = 0
    """Episodes that ended with a non-finite return (an env's NaN or infinite reward), left out of the figures:
    the protocol wants them finite. The rollout whose rewards frame carried the non-finite reward (this one or
    an earlier one) is the learner's to drop as invalid (counted for this actor); this actor lives on."""


def collect(
    vec: ActorEnvs, policy: Policy, rng: np.random.Generator, T: int, declared: tuple[DeclaredArray, ...] = ()
) -> Collected:
    """Step ``vec`` for ``T`` steps with ``policy``; return the trajectory's arrays and episode figures
    (docs/protocol.md section 7). The truncation arrays are there only if an episode was truncated.

    ``declared``: the algorithm's own arrays. Per-rollout ones come from the policy's ``begin_rollout()`` (before
    the first step), per-step ones from each step's ``ActOutput.extras``; the policy's ``finish_rollout(arrays)``
    may add any of them from the whole rollout. Those declared ``sent=False`` stay here. A policy that leaves a
    declared array out, or gives one of another dtype or shape, is a bug of its algorithm: ValueError."""
    buf = RolloutBuffer(T, vec, declared)
    begin = getattr(policy, "begin_rollout", None)
    started: Mapping[str, np.ndarray] = begin() if begin is not None else {}
    trunc_idx, trunc_obs = [], []
    vec.finished.clear()
    for t in range(T):
        obs = vec.obs
        out = policy.act(obs, rng)
        buf.obs[t] = obs
        buf.actions[t], buf.logp[t], buf.values[t] = out.actions, out.logp, out.values
        if out.extras:
            for name, row in out.extras.items():
                if name not in buf.extras:
                    raise ValueError(f"the policy output {name!r} is not a per-step array its algorithm declares")
                buf.extras[name][t] = row
                buf.filled[name] += 1
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
    if declared:
        arrays.update({name: rows for name, rows in buf.extras.items() if buf.filled[name] == T})
        arrays.update(started)
        finish = getattr(policy, "finish_rollout", None)
        if finish is not None:
            arrays.update(finish(arrays | {n: r for n, r in buf.extras.items() if n not in arrays}))
        for a in declared:
            got = arrays.pop(a.name, None) if not a.sent else arrays.get(a.name)
            if got is None or got.dtype != np.dtype(a.dtype) or got.shape != a.rows(T, vec.num_envs):
                raise ValueError(
                    f"the policy gave the declared array {a.name!r} as "
                    f"{'nothing' if got is None else f'{got.dtype} {list(got.shape)}'}, "
                    f"not {a.dtype} {list(a.rows(T, vec.num_envs))}"
                )
    episodes = [(float(r), int(n)) for r, n in vec.finished if math.isfinite(r)]
    return Collected(arrays, [r for r, _ in episodes], [n for _, n in episodes], len(vec.finished) - len(episodes))
