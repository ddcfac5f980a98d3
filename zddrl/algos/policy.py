"""Actor-side inference in numpy: the learner's ``ActorCritic`` rebuilt from a parameter message.

Actors do not import torch: for the MLPs used on vector observations a numpy forward pass is
several times cheaper per step than a torch call, and an actor host starts in a fraction of the
time. The maths mirrors ``zddrl.algos.model.ActorCritic`` exactly (tests check it against torch).
CNN policies run in torch instead (``zddrl.algos.torch_policy``, chosen by ``actor_critic_policy``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import NamedTuple, Protocol

import numpy as np

from zddrl.algos.flat import normalize_obs, unflatten


def _relu(x: np.ndarray) -> np.ndarray:
    return np.maximum(x, 0.0)


def _silu(x: np.ndarray) -> np.ndarray:
    return x * (0.5 + 0.5 * np.tanh(0.5 * x))  # x * sigmoid(x), with no overflow for large |x|


def _erf(x: np.ndarray) -> np.ndarray:
    """erf to within 1.5e-7 (Abramowitz and Stegun 7.1.26): numpy has none, and float32 activations need no more."""
    a = np.abs(x)
    t = 1.0 / (1.0 + 0.3275911 * a)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    return np.sign(x) * (1.0 - poly * np.exp(-a * a))


def _gelu(x: np.ndarray) -> np.ndarray:
    return (0.5 * x * (1.0 + _erf(x * np.float32(1 / np.sqrt(2))))).astype(x.dtype, copy=False)  # torch's exact GELU


def _elu(x: np.ndarray) -> np.ndarray:
    return np.where(x > 0, x, np.expm1(np.minimum(x, 0.0)))


def _leaky_relu(x: np.ndarray) -> np.ndarray:
    return np.where(x > 0, x, np.float32(0.01) * x)


ACTIVATIONS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "tanh": np.tanh,
    "relu": _relu,
    "silu": _silu,
    "gelu": _gelu,
    "elu": _elu,
    "leaky_relu": _leaky_relu,
}
"""``model.activation`` in numpy: zddrl.algos.model.ACTIVATIONS' torch modules mirrored (tests/actor/test_policy.py)."""


class ActOutput(NamedTuple):
    actions: np.ndarray
    """``[N]`` int64 (Discrete) or ``[N, A]`` float32 (Box, before clipping to the bounds)."""
    logp: np.ndarray
    """``[N]`` float32 behaviour log-probabilities."""
    values: np.ndarray
    """``[N]`` float32 state values."""
    extras: Mapping[str, np.ndarray] | None = None
    """This step's rows ``[N, *shape]`` of the algorithm's declared per-step arrays (``AlgorithmSpec.arrays``), by
    name; None: none."""


class Policy(Protocol):
    """What an actor host acts with: ``NumpyPolicy`` (MLPs) or ``torch_policy.TorchPolicy`` (CNNs).

    A policy whose algorithm declares arrays (``AlgorithmSpec.arrays``) may also have ``begin_rollout() ->
    {name: [N, *shape]}`` (per-rollout arrays, at the rollout's first step) and ``finish_rollout(arrays) ->
    {name: array}`` (any declared array, from the whole rollout's: zddrl.actor.rollout.collect)."""

    @property
    def outputs(self) -> int: ...

    def value(self, obs: np.ndarray) -> np.ndarray: ...

    def act(self, obs: np.ndarray, rng: np.random.Generator, deterministic: bool = False) -> ActOutput: ...


class NumpyPolicy:
    """``act(obs, rng)`` samples actions; ``value(obs)`` evaluates the critic. Inputs are raw observations."""

    def __init__(
        self,
        flat: np.ndarray,
        layout: list,
        activation: str,
        discrete: bool,
        obs_mean: np.ndarray | None = None,
        obs_var: np.ndarray | None = None,
    ) -> None:
        weights = unflatten(np.asarray(flat, dtype=np.float32), layout)
        self.pi = self._layers(weights, "pi")
        self.v = self._layers(weights, "v")
        self.act_fn = ACTIVATIONS[activation]
        self.discrete = discrete
        self.log_std = np.zeros(0, np.float32) if discrete else np.asarray(weights["log_std"], dtype=np.float32)
        """Box actions: the Gaussian's state-independent log std (empty for discrete actions)."""
        self.obs_mean = None if obs_mean is None else np.asarray(obs_mean, dtype=np.float32)
        self.obs_var = None if obs_var is None else np.asarray(obs_var, dtype=np.float32)

    @staticmethod
    def _layers(weights: dict[str, np.ndarray], prefix: str) -> list[tuple[np.ndarray, np.ndarray]]:
        indices = sorted(int(k.split(".")[1]) for k in weights if k.startswith(prefix + ".") and k.endswith(".weight"))
        # W.T made contiguous once per version, not per step.
        return [
            (np.ascontiguousarray(weights[f"{prefix}.{i}.weight"].T), weights[f"{prefix}.{i}.bias"].copy())
            for i in indices
        ]

    def _forward(self, layers: list[tuple[np.ndarray, np.ndarray]], x: np.ndarray) -> np.ndarray:
        for i, (w, b) in enumerate(layers):
            x = x @ w + b
            if i < len(layers) - 1:
                x = self.act_fn(x)
        return x

    def prepare(self, obs: np.ndarray) -> np.ndarray:
        return normalize_obs(obs.reshape(obs.shape[0], -1), self.obs_mean, self.obs_var)

    def value(self, obs: np.ndarray) -> np.ndarray:
        return self._forward(self.v, self.prepare(obs))[:, 0]

    @property
    def outputs(self) -> int:
        """Size of the policy's output: the number of actions (Discrete) or the action vector's length (Box)."""
        return int(self.pi[-1][1].shape[0]) if self.pi and self.v else 0  # 0: no policy or no value layers

    def act(self, obs: np.ndarray, rng: np.random.Generator, deterministic: bool = False) -> ActOutput:
        x = self.prepare(obs)
        return sample(self._forward(self.pi, x), self._forward(self.v, x)[:, 0], self.log_std, rng, deterministic)


def sample(
    out: np.ndarray, values: np.ndarray, log_std: np.ndarray, rng: np.random.Generator, deterministic: bool = False
) -> ActOutput:
    """Actions drawn from the policy's output ``out`` ``[N, A]`` with this actor's own generator: categorical
    over logits when ``log_std`` is empty (Discrete), else Gaussian around ``out``. Shared by every actor-side
    policy, so that numpy and torch inference draw the same actions from the same numbers."""
    if not log_std.size:
        logits = out - out.max(axis=1, keepdims=True)
        logp_all = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
        if deterministic:
            actions = logp_all.argmax(axis=1)
        else:  # inverse-CDF sampling: one uniform draw per env from this actor's own generator
            cdf = np.exp(logp_all).cumsum(axis=1)
            u = rng.random((out.shape[0], 1), dtype=np.float32) * cdf[:, -1:]
            actions = np.minimum((cdf < u).sum(axis=1), out.shape[1] - 1)
        logp = logp_all[np.arange(out.shape[0]), actions]
        return ActOutput(actions.astype(np.int64), logp.astype(np.float32), values.astype(np.float32))
    std = np.exp(log_std)
    noise = np.zeros_like(out) if deterministic else rng.standard_normal(out.shape, dtype=np.float32)
    actions = out + std * noise
    logp = (-0.5 * noise**2 - log_std - 0.5 * np.log(2 * np.pi)).sum(axis=1)
    return ActOutput(actions.astype(np.float32), logp.astype(np.float32), values.astype(np.float32))
