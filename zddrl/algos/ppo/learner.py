"""The PPO compute core: trajectories -> training batch -> clipped-surrogate updates. No sockets here.

``PPOLearner.update(trajectories)`` takes the decoded trajectory messages of one update, computes
GAE per trajectory with ``zddrl.gae`` (termination, truncation bootstrap and rollout cuts handled
there), runs the PPO epochs and returns the update's figures.

Sync mode trains on data of the current version: the ratio is taken against the behaviour
log-probs the actors sent, exactly PPO. Async mode trains on data up to ``max_staleness``
versions old and corrects for it with the decoupled objective of Hilton et al. (2021, "Batch
size-invariance for policy optimization"): values are recomputed with the current network for
GAE, the ratio r = pi_theta / pi_prox is clipped around the proximal policy (the network at the
start of the update), and each sample is weighted by the truncated importance weight
w = min(rho_bar, pi_prox / mu) against the behaviour policy mu that produced it. With fresh data
pi_prox = mu, w = 1 and this is PPO again.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from zddrl.algos.core import LearnerCore, explained_variance, schedule
from zddrl.algos.returns import LOG_RATIO_BOUND, gae, truncated_importance_weights
from zddrl.algos.rollout import Rollout, terminal, truncation_bootstrap, truncations

LOSS_FIGURES = ("policy_loss", "value_loss", "entropy", "approx_kl", "clipfrac")
"""What ``ppo_loss`` reports; averaged over the samples of every shard."""


class Batch(NamedTuple):
    """Flat ``[M, ...]`` training batch (M = env steps of all trajectories)."""

    obs: torch.Tensor
    actions: torch.Tensor
    logp: torch.Tensor
    """Log-probs the ratio is taken against: behaviour (sync) or proximal (async)."""
    weights: torch.Tensor
    """Truncated importance weights min(rho_bar, pi_prox / mu): ones in sync mode."""
    values: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor


def ppo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    value: torch.Tensor,
    old_value: torch.Tensor,
    returns: torch.Tensor,
    entropy: torch.Tensor,
    clip: float,
    vf_coef: float,
    ent_coef: float,
    clip_vloss: bool = False,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO's clipped surrogate + value loss - entropy bonus (Schulman et al. 2017, eq. 7 and 9).

    All inputs ``[B]``. ``weights`` (optional, no grad) scale each sample's surrogate: the truncated
    importance weights of the decoupled objective. The log-ratio is bounded by ``LOG_RATIO_BOUND``. Returns
    the scalar loss to minimise and its parts as floats (plus the k3 estimate of KL(old || new) and the
    fraction of clipped ratios).
    """
    log_ratio = (logp - old_logp).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)  # finite whatever old_logp says
    ratio = log_ratio.exp()
    surrogate = torch.max(-adv * ratio, -adv * ratio.clamp(1 - clip, 1 + clip))
    policy_loss = (surrogate if weights is None else weights * surrogate).mean()
    if clip_vloss:
        v_clipped = old_value + (value - old_value).clamp(-clip, clip)
        value_loss = 0.5 * torch.max((value - returns) ** 2, (v_clipped - returns) ** 2).mean()
    else:
        value_loss = 0.5 * ((value - returns) ** 2).mean()
    entropy_mean = entropy.mean()
    loss = policy_loss + vf_coef * value_loss - ent_coef * entropy_mean
    with torch.no_grad():
        approx_kl = ((ratio - 1) - log_ratio).mean()
        clipfrac = ((ratio - 1).abs() > clip).float().mean()
    return loss, {
        "policy_loss": policy_loss.item(),
        "value_loss": value_loss.item(),
        "entropy": entropy_mean.item(),
        "approx_kl": approx_kl.item(),
        "clipfrac": clipfrac.item(),
    }


class PPOLearner(LearnerCore):
    """``update(trajectories) -> figures`` for sync and async PPO (see the module docstring)."""

    # ---------------------------------------------------------------- batch
    def make_batch(self, trajectories: Sequence[Rollout]) -> Batch:
        """GAE per trajectory (each ``[T, N]``), then everything flattened to ``[M]`` (M may be 0 on a
        shard that got no data this update; it still takes part in every collective)."""
        a, s = self.algo, self.settings
        recompute = a.schedule != "sync"  # stale data: values and log-probs of the current network
        parts: dict[str, list[np.ndarray]] = defaultdict(list)
        rewards_of = self.learning_rewards(trajectories)
        for traj, rewards in zip(trajectories, rewards_of):
            x = traj.arrays
            T, N = x["rewards"].shape
            obs_flat = x["obs"].reshape(T * N, *x["obs"].shape[2:])
            if recompute:
                values = self.value(obs_flat).reshape(T, N)
                next_value = self.value(x["next_obs"])
                trunc_value = truncation_bootstrap(x, self.value(truncations(x)[1]))
            else:
                values, next_value, trunc_value = x["values"], x["next_value"], truncation_bootstrap(x)
            adv, ret = gae(
                rewards,
                values,
                terminal(x),
                x["truncated"],
                next_value,
                trunc_value,
                gamma=a.gamma,
                gae_lambda=s.gae_lambda,
            )
            parts["obs"].append(obs_flat)
            parts["actions"].append(x["actions"].reshape(T * N, *x["actions"].shape[2:]))
            parts["logp"].append(x["logp"].reshape(-1))
            parts["values"].append(np.asarray(values, dtype=np.float32).reshape(-1))
            parts["advantages"].append(adv.numpy().reshape(-1))
            parts["returns"].append(ret.numpy().reshape(-1))
        cat = {k: np.concatenate(v) for k, v in parts.items()} if trajectories else self._empty()
        obs = self.tensor(self.normalize(cat["obs"]))  # the statistics the actors used for this data
        if self.obs_rms is not None:
            self.obs_rms.update(cat["obs"], self.group)
        actions, behaviour = self.tensor(cat["actions"]), self.tensor(cat["logp"])
        logp, weights = behaviour, torch.ones_like(behaviour)
        if recompute and len(behaviour):
            with torch.no_grad():
                logp = self.evaluate(obs, actions)[0]  # proximal policy: this update's start (as the steps compute it)
            weights = truncated_importance_weights(logp, behaviour, s.rho_bar)
        return Batch(obs, actions, logp, weights, *(self.tensor(cat[k]) for k in ("values", "advantages", "returns")))

    def _empty(self) -> dict[str, np.ndarray]:
        """A batch of no samples with the right trailing shapes and dtypes."""
        spec = self.spec
        actions = np.zeros(0, np.int64) if spec.discrete else np.zeros((0, spec.action_dim), np.float32)
        return {
            "obs": np.zeros((0, *spec.obs_shape), spec.obs_dtype),
            "actions": actions,
            **{k: np.zeros(0, np.float32) for k in ("logp", "values", "advantages", "returns")},
        }

    # ---------------------------------------------------------------- update
    def update(self, trajectories: Sequence[Rollout], staleness: float = 0.0) -> dict[str, float]:
        """``epochs`` x ``minibatches`` optimizer steps on this shard's share of the batch.

        Every shard takes the same number of steps: minibatch j is the j-th of ``minibatches``
        near-equal slices of this shard's permuted samples, and the step's gradient is the
        sample-weighted mean over the shards (so it equals one learner's step on the union).
        """
        batch = self.make_batch(trajectories)
        a, s = self.algo, self.settings
        M = batch.obs.shape[0]
        total = int(self.group.sum(M)[0])
        lr = self.set_lr(staleness)
        clip = schedule(s.clip, s.clip_schedule, self.steps_trained / a.total_steps)
        sums: dict[str, float] = defaultdict(float)
        mbs = s.minibatches
        for _ in range(s.epochs):
            perm = torch.randperm(M, device=self.device)
            slices = [perm[j * M // mbs : (j + 1) * M // mbs] for j in range(mbs)]
            # Each minibatch's advantages are standardised over that minibatch on every shard; the
            # statistics of the epoch's k minibatches travel in one all-reduce, not one per step.
            stats = self._advantage_stats(batch.advantages, slices) if s.norm_adv else [None] * mbs
            for idx, stat in zip(slices, stats):
                figures, grad_norm = self._minibatch_step(batch, idx, clip, stat)
                for name, v in figures.items():
                    sums[name] += v * len(idx)
                if grad_norm is not None:
                    sums["grad_norm"] += grad_norm
                    sums["steps"] += 1
        self.steps_trained += total
        pooled = self.group.sum(*(sums[k] for k in LOSS_FIGURES), batch.weights.sum())
        samples_seen = total * s.epochs
        figures = {k: v / max(samples_seen, 1) for k, v in zip(LOSS_FIGURES, pooled)}
        return {
            **figures,
            "grad_norm": sums["grad_norm"] / max(sums["steps"], 1),
            "lr": lr,
            "clip": clip,
            "explained_variance": explained_variance(batch.values, batch.returns, self.group),
            "batch_steps": total,
            "is_weight_mean": pooled[-1] / max(total, 1),
        }

    def _advantage_stats(
        self, advantages: torch.Tensor, slices: list[torch.Tensor]
    ) -> list[tuple[float, float] | None]:
        """(mean, unbiased std) of the advantages of each minibatch, pooled over the shards (float64 sums,
        one all-reduce for all of them); None for a minibatch of fewer than 2 samples in all."""
        adv = advantages.double()
        local = [(len(i), adv[i].sum(), (adv[i] ** 2).sum()) for i in slices]
        sums = self.group.sum(*(x for triple in local for x in triple))
        stats = []
        for n, s, ss in zip(sums[0::3], sums[1::3], sums[2::3]):
            mean = s / n if n else 0.0
            stats.append(None if n < 2 else (mean, max((ss - n * mean * mean) / (n - 1), 0.0) ** 0.5))
        return stats

    def _minibatch_step(
        self, batch: Batch, idx: torch.Tensor, clip: float, adv_stat: tuple[float, float] | None
    ) -> tuple[dict[str, float], float | None]:
        """One optimizer step, advantages standardised with ``adv_stat`` (mean, std) if given; this
        shard's loss figures (none if its slice is empty) and the global gradient norm (None: no
        shard had a sample, no step taken)."""
        a, s = self.algo, self.settings
        adv = batch.advantages[idx]
        if adv_stat is not None:
            adv = (adv - adv_stat[0]) / (adv_stat[1] + 1e-8)
        loss: torch.Tensor | None = None
        figures: dict[str, float] = {}
        if len(idx):
            logp, entropy, value = self.evaluate(batch.obs[idx], batch.actions[idx])
            weights = None if a.schedule == "sync" else batch.weights[idx]
            loss, figures = ppo_loss(
                logp,
                batch.logp[idx],
                adv,
                value,
                batch.values[idx],
                batch.returns[idx],
                entropy,
                clip,
                s.vf_coef,
                s.ent_coef,
                s.clip_vloss,
                weights,
            )
        return figures, self.step_optimizer(loss, len(idx))
