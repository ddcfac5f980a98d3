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
from typing import NamedTuple, Sequence

import numpy as np
import torch

from .core import LearnerCore, explained_variance, schedule
from .protocol import Trajectory
from .returns import gae, truncated_importance_weights


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


def ppo_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, value: torch.Tensor,
             old_value: torch.Tensor, returns: torch.Tensor, entropy: torch.Tensor, clip: float, vf_coef: float,
             ent_coef: float, clip_vloss: bool = False,
             weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO's clipped surrogate + value loss - entropy bonus (Schulman et al. 2017, eq. 7 and 9).

    All inputs ``[B]``. ``weights`` (optional, no grad) scale each sample's surrogate: the truncated
    importance weights of the decoupled objective. Returns the scalar loss to minimise and its
    parts as floats (plus the k3 estimate of KL(old || new) and the fraction of clipped ratios).
    """
    log_ratio = logp - old_logp
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
    return loss, {"policy_loss": policy_loss.item(), "value_loss": value_loss.item(), "entropy": entropy_mean.item(),
                  "approx_kl": approx_kl.item(), "clipfrac": clipfrac.item()}


class PPOLearner(LearnerCore):
    """``update(trajectories) -> figures`` for sync and async PPO (see the module docstring)."""

    # ---------------------------------------------------------------- batch
    def make_batch(self, trajectories: Sequence[Trajectory]) -> Batch:
        """GAE per trajectory (each ``[T, N]``), then everything flattened to ``[M]``."""
        a = self.algo
        recompute = a.mode != "sync"  # stale data: values and log-probs of the current network
        parts: dict[str, list[np.ndarray]] = defaultdict(list)
        for traj in trajectories:
            x = traj.arrays
            T, N = x["rewards"].shape
            rewards = x["rewards"]
            if self.reward_scaler is not None:
                rewards = self.reward_scaler(traj.sender, rewards, x["terminated"] | x["truncated"])
            obs_flat = x["obs"].reshape(T * N, *x["obs"].shape[2:])
            if recompute:
                values = self.value(obs_flat).reshape(T, N)
                next_value, trunc_values = self.value(x["next_obs"]), self.value(x["trunc_obs"])
            else:
                values, next_value, trunc_values = x["values"], x["next_value"], x["trunc_value"]
            trunc_value = np.zeros((T, N), dtype=np.float32)
            trunc_value.reshape(-1)[x["trunc_idx"]] = trunc_values
            adv, ret = gae(rewards, values, x["terminated"], x["truncated"], next_value, trunc_value,
                           gamma=a.gamma, gae_lambda=a.gae_lambda)
            parts["obs"].append(obs_flat)
            parts["actions"].append(x["actions"].reshape(T * N, *x["actions"].shape[2:]))
            parts["logp"].append(x["logp"].reshape(-1))
            parts["values"].append(np.asarray(values, dtype=np.float32).reshape(-1))
            parts["advantages"].append(adv.numpy().reshape(-1))
            parts["returns"].append(ret.numpy().reshape(-1))
        cat = {k: np.concatenate(v) for k, v in parts.items()}
        obs = torch.as_tensor(self.normalize(cat["obs"]))  # the statistics the actors used for this data
        if self.obs_rms is not None:
            self.obs_rms.update(cat["obs"])
        actions, behaviour = torch.as_tensor(cat["actions"]), torch.as_tensor(cat["logp"])
        logp, weights = behaviour, torch.ones_like(behaviour)
        if recompute:
            with torch.no_grad():
                logp = self.model.evaluate(obs, actions)[0]  # proximal policy: this update's start
            weights = truncated_importance_weights(logp, behaviour, a.rho_bar)
        return Batch(obs, actions, logp, weights, *(torch.as_tensor(cat[k]) for k in ("values", "advantages",
                                                                                       "returns")))

    # ---------------------------------------------------------------- update
    def update(self, trajectories: Sequence[Trajectory], staleness: float = 0.0) -> dict[str, float]:
        batch = self.make_batch(trajectories)
        a = self.algo
        lr = self.set_lr(staleness)
        clip = schedule(a.clip, a.clip_schedule, self.steps_trained / a.total_steps)
        M = batch.obs.shape[0]
        mb_size = max(1, M // a.minibatches)
        sums: dict[str, float] = defaultdict(float)
        n = 0
        for _ in range(a.epochs):
            perm = torch.randperm(M)
            for start in range(0, M - mb_size + 1, mb_size):
                figures = self._minibatch_step(batch, perm[start:start + mb_size], clip)
                for k, v in figures.items():
                    sums[k] += v
                n += 1
        self.steps_trained += M
        return {**{k: v / n for k, v in sums.items()}, "lr": lr, "clip": clip,
                "explained_variance": explained_variance(batch.values, batch.returns), "batch_steps": M,
                "is_weight_mean": float(batch.weights.mean())}

    def _minibatch_step(self, batch: Batch, idx: torch.Tensor, clip: float) -> dict[str, float]:
        a = self.algo
        logp, entropy, value = self.model.evaluate(batch.obs[idx], batch.actions[idx])
        adv = batch.advantages[idx]
        if a.norm_adv and adv.numel() > 1:
            adv = (adv - adv.mean()) / (adv.std() + 1e-8)
        weights = None if a.mode == "sync" else batch.weights[idx]
        loss, figures = ppo_loss(logp, batch.logp[idx], adv, value, batch.values[idx], batch.returns[idx], entropy,
                                 clip, a.vf_coef, a.ent_coef, a.clip_vloss, weights)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), a.max_grad_norm)
        self.optimizer.step()
        return {**figures, "grad_norm": grad_norm.item()}
