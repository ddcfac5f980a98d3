"""The PPO compute core: trajectories -> training batch -> clipped-surrogate updates. No sockets here.

``PPOLearner.update(trajectories)`` takes the decoded trajectory messages of one update, computes
GAE per trajectory with ``zddrl.gae`` (termination, truncation bootstrap and rollout cuts handled
there), runs the PPO epochs and returns the update's figures. ``params()`` gives the flat
parameter buffer, layout and normalisation statistics that travel to the actors.
"""
from __future__ import annotations

from collections import defaultdict
from typing import NamedTuple, Sequence

import numpy as np
import torch

from .config import Config
from .envs import EnvSpec
from .model import ActorCritic, flatten_params
from .optim import Adam
from .protocol import Trajectory
from .returns import gae


class RunningMeanStd:
    """Running mean and variance over the leading axis (Chan et al. parallel update)."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.mean = np.zeros(shape, dtype=np.float64)
        self.var = np.ones(shape, dtype=np.float64)
        self.count = 1e-4

    def update(self, x: np.ndarray) -> None:
        if len(x) == 0:
            return
        mean, var, n = x.mean(axis=0), x.var(axis=0), x.shape[0]
        delta, total = mean - self.mean, self.count + n
        self.mean = self.mean + delta * n / total
        self.var = (self.var * self.count + var * n + delta ** 2 * self.count * n / total) / total
        self.count = total


class RewardScaler:
    """Divides rewards by the running std of the discounted return, tracked per (actor, env) stream."""

    def __init__(self, gamma: float) -> None:
        self.gamma = gamma
        self.rms = RunningMeanStd(())
        self.returns: dict[str, np.ndarray] = {}

    def __call__(self, sender: str, rewards: np.ndarray, done: np.ndarray) -> np.ndarray:
        ret = self.returns.get(sender)
        if ret is None or ret.shape[0] != rewards.shape[1]:
            ret = np.zeros(rewards.shape[1])
        seen = np.empty(rewards.shape)
        for t in range(rewards.shape[0]):
            ret = ret * self.gamma + rewards[t]
            seen[t] = ret
            ret = np.where(done[t], 0.0, ret)
        self.returns[sender] = ret
        self.rms.update(seen.reshape(-1))
        return (rewards / np.sqrt(self.rms.var + 1e-8)).astype(np.float32)


class Batch(NamedTuple):
    """Flat ``[M, ...]`` training batch (M = env steps of all trajectories)."""

    obs: torch.Tensor
    actions: torch.Tensor
    logp: torch.Tensor
    values: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor


def schedule(value: float, kind: str, progress: float) -> float:
    """``constant``, or ``linear`` from ``value`` to 0 as ``progress`` goes 0 -> 1."""
    return value * max(0.0, 1.0 - progress) if kind == "linear" else value


def explained_variance(pred: torch.Tensor, target: torch.Tensor) -> float:
    var = target.var()
    return float("nan") if var == 0 else float(1 - (target - pred).var() / var)


def ppo_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, value: torch.Tensor,
             old_value: torch.Tensor, returns: torch.Tensor, entropy: torch.Tensor, clip: float, vf_coef: float,
             ent_coef: float, clip_vloss: bool = False) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO's clipped surrogate + value loss - entropy bonus (Schulman et al. 2017, eq. 7 and 9).

    All inputs ``[B]``. Returns the scalar loss to minimise and its parts as floats (plus the
    k3 estimate of KL(old || new) and the fraction of clipped ratios).
    """
    log_ratio = logp - old_logp
    ratio = log_ratio.exp()
    policy_loss = torch.max(-adv * ratio, -adv * ratio.clamp(1 - clip, 1 + clip)).mean()
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


class PPOLearner:
    """``update(trajectories) -> figures``; ``params() -> (flat, layout, extra arrays)``."""

    def __init__(self, config: Config, spec: EnvSpec, seed_offset: int = 0) -> None:
        torch.manual_seed(config.env.seed + seed_offset)
        torch.set_num_threads(config.algo.torch_threads)
        self.config = config
        self.algo = config.algo
        self.model = ActorCritic(spec, config.model)
        self.optimizer = Adam(self.model.parameters(), lr=config.algo.lr, eps=1e-5)
        self.obs_rms = RunningMeanStd(spec.obs_shape) if config.algo.normalize_obs else None
        self.reward_scaler = RewardScaler(config.algo.gamma) if config.algo.normalize_reward else None
        self.steps_trained = 0

    # ---------------------------------------------------------------- parameters for the actors
    def params(self) -> tuple[np.ndarray, list, dict[str, np.ndarray]]:
        flat, layout = flatten_params(self.model)
        extra = {}
        if self.obs_rms is not None:
            extra = {"obs_mean": self.obs_rms.mean.astype(np.float32), "obs_var": self.obs_rms.var.astype(np.float32)}
        return flat, layout, extra

    def _normalize(self, obs: np.ndarray) -> np.ndarray:
        if self.obs_rms is None:
            return obs
        std = np.sqrt(self.obs_rms.var + 1e-8)
        return np.clip((obs - self.obs_rms.mean) / std, -10.0, 10.0).astype(np.float32)

    # ---------------------------------------------------------------- batch
    def make_batch(self, trajectories: Sequence[Trajectory]) -> Batch:
        """GAE per trajectory (each ``[T, N]``), then everything flattened to ``[M]``."""
        a = self.algo
        parts: dict[str, list[np.ndarray]] = defaultdict(list)
        for traj in trajectories:
            x = traj.arrays
            T, N = x["rewards"].shape
            rewards = x["rewards"]
            if self.reward_scaler is not None:
                rewards = self.reward_scaler(traj.sender, rewards, x["terminated"] | x["truncated"])
            trunc_value = np.zeros((T, N), dtype=np.float32)
            trunc_value.reshape(-1)[x["trunc_idx"]] = x["trunc_value"]
            adv, ret = gae(rewards, x["values"], x["terminated"], x["truncated"], x["next_value"], trunc_value,
                           gamma=a.gamma, gae_lambda=a.gae_lambda)
            parts["obs"].append(x["obs"].reshape(T * N, *x["obs"].shape[2:]))
            parts["actions"].append(x["actions"].reshape(T * N, *x["actions"].shape[2:]))
            for key in ("logp", "values"):
                parts[key].append(x[key].reshape(-1))
            parts["advantages"].append(adv.numpy().reshape(-1))
            parts["returns"].append(ret.numpy().reshape(-1))
        cat = {k: np.concatenate(v) for k, v in parts.items()}
        obs = self._normalize(cat["obs"])  # with the statistics the actors used for this version
        if self.obs_rms is not None:
            self.obs_rms.update(cat["obs"])
        return Batch(*(torch.as_tensor(cat[k] if k != "obs" else obs) for k in Batch._fields))

    # ---------------------------------------------------------------- update
    def update(self, trajectories: Sequence[Trajectory]) -> dict[str, float]:
        batch = self.make_batch(trajectories)
        a = self.algo
        progress = self.steps_trained / a.total_steps
        lr, clip = schedule(a.lr, a.lr_schedule, progress), schedule(a.clip, a.clip_schedule, progress)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
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
        with torch.no_grad():
            ev = explained_variance(batch.values, batch.returns)
        return {**{k: v / n for k, v in sums.items()}, "lr": lr, "clip": clip, "explained_variance": ev,
                "batch_steps": M}

    def _minibatch_step(self, batch: Batch, idx: torch.Tensor, clip: float) -> dict[str, float]:
        a = self.algo
        logp, entropy, value = self.model.evaluate(batch.obs[idx], batch.actions[idx])
        adv = batch.advantages[idx]
        if a.norm_adv and adv.numel() > 1:
            adv = (adv - adv.mean()) / (adv.std() + 1e-8)
        loss, figures = ppo_loss(logp, batch.logp[idx], adv, value, batch.values[idx], batch.returns[idx], entropy,
                                 clip, a.vf_coef, a.ent_coef, a.clip_vloss)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), a.max_grad_norm)
        self.optimizer.step()
        return {**figures, "grad_norm": grad_norm.item()}

    # ---------------------------------------------------------------- checkpoints
    def state(self) -> dict:
        state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                 "steps_trained": self.steps_trained}
        if self.obs_rms is not None:
            state["obs_rms"] = {"mean": torch.from_numpy(self.obs_rms.mean), "var": torch.from_numpy(self.obs_rms.var),
                                "count": self.obs_rms.count}
        return state
