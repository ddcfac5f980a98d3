"""What every learner core shares: the model, the optimizer, normalisers, parameters and state.

Algorithm cores (``PPOLearner`` for sync/async PPO, ``ImpalaLearner`` for V-trace, ``ApexLearner`` and
``SACLearner`` on a replay buffer, a user's own) subclass ``LearnerCore`` and implement
``update(trajectories, staleness) -> figures``; the algorithm's spec (``zddrl.algos.spec``) builds the network
that travels to the actors. No sockets here.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from zddrl.algos.autocast import agreed_autocast
from zddrl.algos.flat import normalize_obs
from zddrl.algos.model import flatten_params
from zddrl.algos.optim import Adam
from zddrl.algos.rollout import Rollout, terminal
from zddrl.algos.spec import Figure, algorithm_of
from zddrl.config import Config
from zddrl.envs import EnvSpec
from zddrl.logs import RateLimitedLog
from zddrl.shards.group import ShardGroup

PROFILE_REGIONS = ("forward", "value", "backward", "gradients", "optimizer")
"""The parts of an update named for torch.profiler (``zddrl.<region>``; ``zddrl bench learner --profile`` sums them):
the training forward pass, no-grad value passes (bootstraps, targets), backward, the gradients' average over the
shards and clipping, and the optimizer's step."""
_profiled = [False]
"""Whether regions are recorded: a record_function costs several microseconds even with no profiler running, a
nullcontext a tenth of one (set by ``profile_regions``)."""


def profile_regions(on: bool) -> None:
    """Name the update's regions for a torch.profiler session (off: no cost in a run)."""
    _profiled[0] = on


def region(name: str) -> contextlib.AbstractContextManager:
    """One of PROFILE_REGIONS, as a context manager."""
    return torch.profiler.record_function(f"zddrl.{name}") if _profiled[0] else contextlib.nullcontext()


class RunningMeanStd:
    """Running mean and variance over the leading axis (Chan et al. parallel update)."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.mean = np.zeros(shape, dtype=np.float64)
        self.var = np.ones(shape, dtype=np.float64)
        self.count = 1e-4

    def update(self, x: np.ndarray, group: ShardGroup | None = None) -> None:
        """Fold the rows of ``x`` in. With a sharded ``group``, every shard must call this (with its
        own rows, possibly none) and all end with the statistics of all shards' rows together."""
        n = x.shape[0]
        mean = x.mean(axis=0) if n else np.zeros(self.mean.shape)
        var = x.var(axis=0) if n else np.zeros(self.mean.shape)
        if group is not None and group.sharded:
            n, mean, var = _pooled_moments(group, n, mean, var)
        if n == 0:
            return
        delta, total = mean - self.mean, self.count + n
        self.mean = self.mean + delta * n / total
        self.var = (self.var * self.count + var * n + delta**2 * self.count * n / total) / total
        self.count = total


def _pooled_moments(group: ShardGroup, n: int, mean: np.ndarray, var: np.ndarray) -> tuple[int, np.ndarray, np.ndarray]:
    """(count, mean, variance) of the union of every shard's rows (float64 sums, one all-reduce)."""
    flat_mean, flat_var = np.asarray(mean, np.float64).reshape(-1), np.asarray(var, np.float64).reshape(-1)
    sums = group.sum(n, *(n * flat_mean), *(n * (flat_var + flat_mean**2)))
    total = int(round(sums[0]))
    if total == 0:
        return 0, mean, var
    k = flat_mean.size
    pooled_mean = np.array(sums[1 : 1 + k]) / total
    pooled_var = np.maximum(np.array(sums[1 + k :]) / total - pooled_mean**2, 0.0)
    return total, pooled_mean.reshape(np.shape(mean)), pooled_var.reshape(np.shape(mean))


REWARD_STREAMS_KEPT = 4096
"""Actors whose running discounted returns are kept (least recently seen dropped first; a dropped actor's next
rollout starts from 0 again): memory bounded whatever the peer ids."""


class RewardScaler:
    """Divides rewards by the running std of the discounted return, tracked per (actor, env) stream.

    A batch is scaled as a whole: the statistics take in every trajectory of the update (on every
    shard) first, then all of them are divided by the same std, so neither the order the data
    arrived in nor how it was split over shards changes the result.
    """

    def __init__(self, gamma: float) -> None:
        self.gamma = gamma
        self.rms = RunningMeanStd(())
        self.returns: dict[str, np.ndarray] = {}

    def discounted(self, peer_id: str, rewards: np.ndarray, done: np.ndarray) -> np.ndarray:
        """``[T, N]`` running discounted returns of ``peer_id``'s streams; the streams move on."""
        ret = self.returns.get(peer_id)
        if ret is None or ret.shape[0] != rewards.shape[1]:
            ret = np.zeros(rewards.shape[1])
        seen = np.empty(rewards.shape)
        for t in range(rewards.shape[0]):
            ret = ret * self.gamma + rewards[t]
            seen[t] = ret
            ret = np.where(done[t], 0.0, ret)
        self.returns.pop(peer_id, None)  # re-inserted last: the dict's order is least recently seen first
        self.returns[peer_id] = ret
        while len(self.returns) > REWARD_STREAMS_KEPT:
            del self.returns[next(iter(self.returns))]
        return seen

    def scale(
        self, streams: Sequence[tuple[str, int, np.ndarray, np.ndarray]], group: ShardGroup | None = None
    ) -> list[np.ndarray]:
        """``(peer_id, seq, rewards [T, N], done [T, N])`` per trajectory -> the scaled rewards, float32.

        Streams advance in (peer_id, seq) order. With shards, every shard runs every stream of the
        batch (the rewards of all shards' trajectories travel in one exchange: ``T * N`` floats each),
        so each stream continues from its own previous trajectory wherever that one was trained,
        and every shard ends with the same statistics; each keeps the scaled rewards of its own.
        """
        everything = list(streams)
        if group is not None and group.sharded:
            parts = group.exchange(
                [
                    [peer_id, seq, _packed(rewards, np.float32), _packed(done, np.bool_)]
                    for peer_id, seq, rewards, done in streams
                ]
            )
            everything = [
                (peer_id, seq, _unpacked(r, np.float32), _unpacked(d, np.bool_))
                for part in parts
                for peer_id, seq, r, d in part
            ]
        everything.sort(key=lambda x: (x[0], x[1]))
        seen = [self.discounted(peer_id, rewards, done).reshape(-1) for peer_id, _, rewards, done in everything]
        self.rms.update(np.concatenate(seen) if seen else np.zeros(0))
        std = np.sqrt(self.rms.var + 1e-8)
        return [(rewards / std).astype(np.float32) for _, _, rewards, _ in streams]


def _packed(array: np.ndarray, dtype: type) -> list:
    """An array as msgpack-able ``[shape, raw bytes of dtype]`` (for the shards' exchange)."""
    return [list(array.shape), np.ascontiguousarray(array, dtype=dtype).tobytes()]


def _unpacked(packed: list, dtype: type) -> np.ndarray:
    shape, raw = packed
    return np.frombuffer(raw, dtype=dtype).reshape(shape)


def schedule(value: float, kind: str, progress: float) -> float:
    """``constant``, or ``linear`` from ``value`` to 0 as ``progress`` goes 0 -> 1."""
    return value * max(0.0, 1.0 - progress) if kind == "linear" else value


def explained_variance(pred: torch.Tensor, target: torch.Tensor, group: ShardGroup | None = None) -> float:
    """1 - Var(target - pred) / Var(target) over the samples of every shard (``[M]`` each)."""
    y, r = target.double(), (target - pred).double()
    n, sy, syy, sr, srr = (group or ShardGroup()).sum(y.numel(), y.sum(), (y * y).sum(), r.sum(), (r * r).sum())
    if n < 2:
        return float("nan")
    var_y, var_r = syy / n - (sy / n) ** 2, srr / n - (sr / n) ** 2
    return float("nan") if var_y <= 0 else 1.0 - var_r / var_y


CORE_FIGURES = (Figure("grad_norm"), Figure("lr", "perf"), Figure("batch_steps", "perf"))
"""What every core's ``update`` reports (its algorithm's spec declares the rest)."""


def acting_model(config: Config, spec: EnvSpec) -> torch.nn.Module:
    """The network whose parameters travel to the actors (what a checkpoint's ``model`` holds): the algorithm's."""
    return algorithm_of(config).acting_model(config, spec)


class LearnerCore:
    """Model + optimizer + normalisation; ``params()`` is what travels to the actors."""

    model: Any
    """The network that travels to the actors (``acting_model``)."""

    def __init__(self, config: Config, spec: EnvSpec, group: ShardGroup | None = None) -> None:
        self.group = group or ShardGroup()
        torch.set_num_threads(config.learner.torch_threads)
        self.config = config
        self.spec = spec
        self.algo = config.algo
        self.settings: Any = config.algo.settings
        """The algorithm's own ``[algo]`` keys (its spec's ``settings`` dataclass)."""
        self.device = self.group.device
        torch.manual_seed(config.env.seed)  # the network starts the same on every shard ...
        self.model = acting_model(config, spec).to(self.device)
        self.group.sync_module(self.model.parameters())  # ... and surely so, whatever the device
        self.autocast = agreed_autocast(config, self.model, spec, self.device, self.group)
        """``learner.autocast`` as this host runs it (``auto`` resolved), and why."""
        torch.manual_seed(config.env.seed + self.group.rank)  # minibatch order differs by shard
        self.optimizer = Adam(self.model.parameters(), lr=config.algo.lr, eps=1e-5)
        self.obs_rms = RunningMeanStd(spec.obs_shape) if config.algo.normalize_obs else None
        self.reward_scaler = RewardScaler(config.algo.gamma) if config.algo.normalize_reward else None
        self.steps_trained = 0
        self.skipped_steps = 0
        """Optimizer steps not taken because the gradient was not finite."""
        self._ratelog = RateLimitedLog()
        """A poisoned run can skip every step: one line per interval with a count, not one per step."""

    def update(self, trajectories, staleness: float = 0.0) -> dict[str, float]:  # pragma: no cover - interface
        raise NotImplementedError

    def evaluate(self, obs: torch.Tensor, actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``model.evaluate`` (log-prob, entropy, value) for training, under ``learner.autocast``: with ``bf16`` the
        torso (the CNN: nearly all of the compute) runs in bfloat16 where torch's autocast allows (convolutions,
        matrix products), and the heads, the distribution, the losses and Adam in float32 on its output: log-probs
        and values keep float32's precision, which the importance ratios and V-trace targets need."""
        with region("forward"):
            if self.autocast.mode == "off":
                return self.model.evaluate(obs, actions)
            with torch.autocast(self.device.type, dtype=torch.bfloat16):
                x = self.model.features(obs)
            return self.model.evaluate_features(x.float(), actions)

    def refusal(self, arrays) -> str:
        """Why this core cannot take a rollout that fits the run (``rollout.mismatch``), or "": its ``life_lost``
        must be there exactly when the run has ``env.episodic_life`` (else its returns would silently change)."""
        episodic = self.config.env.episodic_life
        if ("life_lost" in arrays) != episodic:
            return f"life_lost {'missing in a run with' if episodic else 'in a run without'} env.episodic_life"
        return ""

    def greedy(self, obs: np.ndarray) -> np.ndarray:
        """The deterministic actions the current network takes on raw ``obs`` ``[K, *obs]`` (evaluation)."""
        with torch.no_grad():
            dist = self.model.distribution(self.tensor(self.normalize(obs)))
            actions = dist.probs.argmax(dim=1) if self.spec.discrete else dist.mean
        return actions.cpu().numpy()

    def params(self) -> tuple[np.ndarray, list, dict[str, np.ndarray]]:
        flat, layout = flatten_params(self.model)
        extra = {}
        if self.obs_rms is not None:
            extra = {"obs_mean": self.obs_rms.mean.astype(np.float32), "obs_var": self.obs_rms.var.astype(np.float32)}
        return flat, layout, extra

    def learning_rewards(self, trajectories: Sequence[Rollout]) -> list[np.ndarray]:
        """Each trajectory's ``[T, N]`` rewards as the loss sees them: their sign with ``env.clip_rewards``
        (Mnih et al. 2015), then divided by the return's std with ``algo.normalize_reward``. The wire keeps the
        env's own rewards, which the learner's episode figures sum (intake/episodes.py): true returns."""
        rewards = [t.arrays["rewards"] for t in trajectories]
        if self.config.env.clip_rewards:
            rewards = [np.sign(r) for r in rewards]
        if self.reward_scaler is not None:
            rewards = self.reward_scaler.scale(
                [
                    (t.peer_id, t.seq, r, terminal(t.arrays) | t.arrays["truncated"])
                    for t, r in zip(trajectories, rewards)
                ],
                self.group,
            )
        return rewards

    def normalize(self, obs: np.ndarray) -> np.ndarray:
        """Observations as the actors feed them to the network (same statistics, same clip)."""
        if self.obs_rms is None:
            return obs
        return normalize_obs(obs, self.obs_rms.mean, self.obs_rms.var)

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
        with torch.no_grad(), region("value"):
            return self.model.value(self.tensor(self.normalize(obs))).cpu().numpy()

    def tensor(self, x: np.ndarray) -> torch.Tensor:
        """A training input on this shard's device."""
        return torch.as_tensor(x, device=self.device)

    def step_optimizer(self, loss: torch.Tensor | None, weight: int, optimizer: Adam | None = None) -> float | None:
        """Backward, average the gradients over the shards (``weight`` = samples behind this shard's
        ``loss``; None when it had none), clip, step. Returns the gradient norm before clipping, or
        None when no shard had a sample (no step then: Adam's momentum would move the weights).
        ``optimizer``: the model's unless given (SAC steps its critics and temperature with their own)."""
        optimizer = optimizer or self.optimizer
        params = optimizer.params
        self._ratelog.flush()
        optimizer.zero_grad(set_to_none=True)
        with region("backward"):
            if loss is not None:
                loss.backward()
            else:
                for p in params:
                    p.grad = torch.zeros_like(p)
        with region("gradients"):
            if self.group.average_gradients(params, weight) == 0:
                return None
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, self.algo.max_grad_norm))
        if not math.isfinite(grad_norm):
            # One poisoned sample (a finite but absurd log-probability, say) must not turn every weight into
            # NaN for good. Gradients are all-reduced, so every shard sees the same norm and skips alike.
            self.skipped_steps += 1
            self._ratelog.warning(
                "skipped-step", f"skipped an optimizer step: gradient norm {grad_norm} ({self.skipped_steps} so far)"
            )
            return None
        with region("optimizer"):
            optimizer.step()
        return grad_norm

    def state(self) -> dict:
        """Everything an update depends on, as tensors and plain values (``weights_only`` loadable)."""
        state = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "steps_trained": self.steps_trained,
            "skipped_steps": self.skipped_steps,
            "torch_rng": torch.get_rng_state(),
        }
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
        self.skipped_steps = int(state.get("skipped_steps", 0))  # checkpoints before protocol 3 lack it
        torch.set_rng_state(state["torch_rng"])  # the main shard's generator, saved by it
        if self.group.rank:  # other shards must not draw the main shard's minibatch order
            torch.manual_seed(self.config.env.seed * 1_000_003 + self.group.rank * 7919 + self.steps_trained)
        if self.obs_rms is not None and "obs_rms" in state:
            _load_rms(self.obs_rms, state["obs_rms"])
        if self.reward_scaler is not None and "reward_rms" in state:
            _load_rms(self.reward_scaler.rms, state["reward_rms"])
            self.reward_scaler.returns = {k: v.numpy() for k, v in state.get("reward_returns", {}).items()}


def _rms_state(rms: RunningMeanStd) -> dict:
    return {"mean": torch.as_tensor(rms.mean), "var": torch.as_tensor(rms.var), "count": float(rms.count)}


def _load_rms(rms: RunningMeanStd, state: dict) -> None:
    rms.mean, rms.var, rms.count = state["mean"].numpy(), state["var"].numpy(), float(state["count"])
