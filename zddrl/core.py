"""What every learner core shares: the model, the optimizer, normalisers, parameters and state.

Algorithm cores (``PPOLearner`` for sync/async PPO, ``ImpalaLearner`` for V-trace) subclass
``LearnerCore`` and implement ``update(trajectories) -> figures``. No sockets here.
"""
from __future__ import annotations

import numpy as np
import torch

from .config import Config
from .envs import EnvSpec
from .model import ActorCritic, flatten_params
from .optim import Adam


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


def schedule(value: float, kind: str, progress: float) -> float:
    """``constant``, or ``linear`` from ``value`` to 0 as ``progress`` goes 0 -> 1."""
    return value * max(0.0, 1.0 - progress) if kind == "linear" else value


def explained_variance(pred: torch.Tensor, target: torch.Tensor) -> float:
    var = target.var()
    return float("nan") if var == 0 else float(1 - (target - pred).var() / var)


class LearnerCore:
    """Model + optimizer + normalisation; ``params()`` is what travels to the actors."""

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

    def update(self, trajectories) -> dict[str, float]:  # pragma: no cover - interface
        raise NotImplementedError

    def params(self) -> tuple[np.ndarray, list, dict[str, np.ndarray]]:
        flat, layout = flatten_params(self.model)
        extra = {}
        if self.obs_rms is not None:
            extra = {"obs_mean": self.obs_rms.mean.astype(np.float32), "obs_var": self.obs_rms.var.astype(np.float32)}
        return flat, layout, extra

    def normalize(self, obs: np.ndarray) -> np.ndarray:
        """Observations as the actors feed them to the network (same statistics, same clip)."""
        if self.obs_rms is None:
            return obs
        std = np.sqrt(self.obs_rms.var + 1e-8)
        return np.clip((obs - self.obs_rms.mean) / std, -10.0, 10.0).astype(np.float32)

    def set_lr(self, staleness: float = 0.0) -> float:
        """Scheduled learning rate, divided by ``1 + staleness_lr_decay * staleness``; applied and returned."""
        a = self.algo
        lr = schedule(a.lr, a.lr_schedule, self.steps_trained / a.total_steps)
        lr /= 1.0 + a.staleness_lr_decay * staleness
        self.optimizer.param_groups[0]["lr"] = lr
        return lr

    def value(self, obs: np.ndarray) -> np.ndarray:
        """V(obs) with the current network (no grad), for ``[K, *obs]`` raw observations."""
        if len(obs) == 0:
            return np.zeros(0, dtype=np.float32)
        with torch.no_grad():
            return self.model.value(torch.as_tensor(self.normalize(obs))).numpy()

    def state(self) -> dict:
        """Everything an update depends on, as tensors and plain values (``weights_only`` loadable)."""
        state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                 "steps_trained": self.steps_trained, "torch_rng": torch.get_rng_state()}
        if self.obs_rms is not None:
            state["obs_rms"] = _rms_state(self.obs_rms)
        if self.reward_scaler is not None:
            state["reward_rms"] = _rms_state(self.reward_scaler.rms)
            state["reward_returns"] = {k: torch.as_tensor(v) for k, v in self.reward_scaler.returns.items()}
        return state

    def load_state(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps_trained = int(state["steps_trained"])
        torch.set_rng_state(state["torch_rng"])
        if self.obs_rms is not None and "obs_rms" in state:
            _load_rms(self.obs_rms, state["obs_rms"])
        if self.reward_scaler is not None and "reward_rms" in state:
            _load_rms(self.reward_scaler.rms, state["reward_rms"])
            self.reward_scaler.returns = {k: v.numpy() for k, v in state.get("reward_returns", {}).items()}


def _rms_state(rms: RunningMeanStd) -> dict:
    return {"mean": torch.as_tensor(rms.mean), "var": torch.as_tensor(rms.var), "count": float(rms.count)}


def _load_rms(rms: RunningMeanStd, state: dict) -> None:
    rms.mean, rms.var, rms.count = state["mean"].numpy(), state["var"].numpy(), float(state["count"])
