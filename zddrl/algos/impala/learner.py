"""The IMPALA compute core: V-trace actor-critic updates on data from older policies. No sockets here.

Espeholt et al. (2018): the value target is the V-trace target ``vs`` and the policy gradient
uses the V-trace advantage ``rho_t * (r_t + gamma_t * vs_{t+1} - V(x_t))``, both computed with
``zddrl.vtrace`` under no_grad from the behaviour log-probs each trajectory carries and the
current network's log-probs and values. Episode ends inside a rollout enter through the
discounts (0 after termination); a truncated step is bootstrapped from V(final observation)
(``vtrace_discounts_and_rewards``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from zddrl.algos.core import LearnerCore, explained_variance
from zddrl.algos.returns import vtrace, vtrace_discounts_and_rewards
from zddrl.algos.rollout import Rollout, terminal, truncations


class TimeMajor(NamedTuple):
    """Trajectories side by side: ``[T, B, ...]`` with B = all envs of all trajectories."""

    obs: np.ndarray
    actions: np.ndarray
    behaviour_logp: np.ndarray
    rewards: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    next_obs: np.ndarray
    """``[B, *obs]``: the observation after the last step, for the bootstrap value."""
    trunc_index: np.ndarray
    """``[K]`` flat indices ``t * B + b`` of truncated steps, in the order of ``trunc_obs``."""
    trunc_obs: np.ndarray


def stack_time_major(trajectories: Sequence[Rollout], rewards: Sequence[np.ndarray]) -> TimeMajor:
    """Concatenate trajectories of one rollout length along the env axis (``rewards`` may be scaled)."""
    lengths = {t.arrays["rewards"].shape[0] for t in trajectories}
    if len(lengths) != 1:
        raise ValueError(f"trajectories of one batch must share their length, got {sorted(lengths)}")
    widths = [t.arrays["rewards"].shape[1] for t in trajectories]
    B = sum(widths)
    trunc_index, trunc_obs, offset = [], [], 0
    for traj, n in zip(trajectories, widths):
        idx, final_obs, _ = truncations(traj.arrays)  # t * n + i within this trajectory -> t * B + offset + i
        trunc_index.append((idx // n) * B + offset + idx % n)
        trunc_obs.append(final_obs)
        offset += n

    def cat(key: str) -> np.ndarray:
        return np.concatenate([t.arrays[key] for t in trajectories], axis=1)

    return TimeMajor(
        cat("obs"),
        cat("actions"),
        cat("logp"),
        np.concatenate(rewards, axis=1),
        np.concatenate([terminal(t.arrays) for t in trajectories], axis=1),
        cat("truncated"),
        np.concatenate([t.arrays["next_obs"] for t in trajectories]),
        np.concatenate(trunc_index),
        np.concatenate(trunc_obs),
    )


IMPALA_FIGURES = ("policy_loss", "value_loss", "entropy", "rho_mean", "explained_variance")
"""Per-step figures, averaged over the samples of every shard."""


class ImpalaLearner(LearnerCore):
    """``update(trajectories) -> figures``: epochs x minibatches (over env columns) of V-trace steps.

    Every shard takes the same number of steps: minibatch j is the j-th of ``minibatches``
    near-equal slices of this shard's permuted env columns (possibly none), and each step's gradient
    is the sample-weighted mean over the shards.
    """

    def update(self, trajectories: Sequence[Rollout], staleness: float = 0.0) -> dict[str, float]:
        rewards = self.learning_rewards(trajectories)
        tm = stack_time_major(trajectories, rewards) if trajectories else None
        T, B = tm.rewards.shape if tm is not None else (0, 0)
        obs = self.tensor(self.normalize(tm.obs)) if tm is not None else None
        total = int(self.group.sum(T * B)[0])
        lr = self.set_lr(staleness)
        k = self.settings.minibatches
        sums: dict[str, float] = defaultdict(float)
        for _ in range(self.settings.epochs):
            perm = torch.randperm(B)
            for j in range(k):
                figures, grad_norm = self._step(tm, obs, perm[j * B // k : (j + 1) * B // k])
                for name, v in figures.items():
                    sums[name] += v
                if grad_norm is not None:
                    sums["grad_norm"] += grad_norm
                    sums["steps"] += 1
        if self.obs_rms is not None:  # after the epochs: bootstrap values must see the same statistics
            self.obs_rms.update(
                tm.obs.reshape(T * B, *tm.obs.shape[2:])
                if tm is not None
                else np.zeros((0, *self.spec.obs_shape), np.float32),
                self.group,
            )
        self.steps_trained += total
        pooled = self.group.sum(*(sums[name] for name in IMPALA_FIGURES))
        seen = max(total * self.settings.epochs, 1)
        return {
            **{name: v / seen for name, v in zip(IMPALA_FIGURES, pooled)},
            "grad_norm": sums["grad_norm"] / max(sums["steps"], 1),
            "lr": lr,
            "batch_steps": total,
        }

    def _targets(self, tm: TimeMajor, cols: torch.Tensor, target_logp: torch.Tensor, values: torch.Tensor):
        """V-trace targets for the env columns ``cols`` with the current network (no grad), on the CPU."""
        T, B = tm.rewards.shape
        c = cols.numpy()
        trunc_value = np.zeros((T, B), dtype=np.float32)
        trunc_value.reshape(-1)[tm.trunc_index] = self.value(tm.trunc_obs)
        rewards, discounts = vtrace_discounts_and_rewards(
            tm.rewards[:, c], tm.terminated[:, c], tm.truncated[:, c], trunc_value[:, c], self.algo.gamma
        )
        return vtrace(
            tm.behaviour_logp[:, c],
            target_logp.cpu(),
            rewards,
            discounts,
            values.cpu(),
            self.value(tm.next_obs[c]),
            rho_bar=self.settings.rho_bar,
            c_bar=self.settings.c_bar,
        )

    def _step(
        self, tm: TimeMajor | None, obs: torch.Tensor | None, cols: torch.Tensor
    ) -> tuple[dict[str, float], float | None]:
        """One optimizer step on the env columns ``cols``: this shard's figures, summed over its samples
        (none if it has no columns this step), and the global gradient norm (None: no step taken)."""
        if tm is None or obs is None or len(cols) == 0:  # obs is None exactly when tm is
            return {}, self.step_optimizer(None, 0)
        s = self.settings
        T, b = obs.shape[0], len(cols)
        mb_obs = obs[:, cols.to(self.device)].reshape(T * b, *obs.shape[2:])
        actions = self.tensor(tm.actions[:, cols.numpy()]).reshape(T * b, *tm.actions.shape[2:])
        logp, entropy, values = (x.reshape(T, b) for x in self.evaluate(mb_obs, actions))
        vt = self._targets(tm, cols, logp.detach(), values.detach())
        vs, pg_advantages = vt.vs.to(self.device), vt.pg_advantages.to(self.device)
        policy_loss = -(pg_advantages * logp).mean()
        value_loss = 0.5 * ((vs - values) ** 2).mean()
        entropy_mean = entropy.mean()
        loss = policy_loss + s.vf_coef * value_loss - s.ent_coef * entropy_mean
        grad_norm = self.step_optimizer(loss, T * b)
        figures = {
            "policy_loss": policy_loss.item(),
            "value_loss": value_loss.item(),
            "entropy": entropy_mean.item(),
            "rho_mean": vt.rhos.mean().item(),
            "explained_variance": explained_variance(values.detach(), vs),
        }
        return {name: v * T * b for name, v in figures.items()}, grad_norm
