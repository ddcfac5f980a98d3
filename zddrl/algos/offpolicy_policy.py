"""Actor-side inference of the replay algorithms: the Q-network Ape-X acts with (its epsilon-greedy policy is
zddrl.algos.apex.policy) and SAC's squashed Gaussian.

Each policy takes a forward function: the built-in MLPs' in numpy (``NumpyDuelingQ``, ``NumpyGaussian``, several
times cheaper per step than a torch call), a network of the user's own in torch (``torch_policy.TorchForward``).
The numpy maths mirrors ``zddrl.algos.offpolicy_nets`` (tests check both against torch). Like ``NumpyPolicy``
their ``act(obs, rng, deterministic)`` returns an ``ActOutput`` and ``value(obs)`` a state value; Ape-X's also
returns ``Q(s, a)`` of the action taken, from which the actor computes its TD errors (``td_errors``): the
initial priorities of what it sends (Horgan et al. 2018).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from zddrl.algos.flat import unflatten
from zddrl.algos.policy import ACTIVATIONS, ActOutput

LOG_STD_MIN, LOG_STD_MAX = -20.0, 2.0
SQUASH_EPS = 1e-6


class _Torso:
    """Linear layers ``{prefix}.{i}`` (even indices), each followed by the activation."""

    def __init__(self, weights: Mapping[str, np.ndarray], activation: str) -> None:
        indices = sorted(int(k.split(".")[1]) for k in weights if k.startswith("torso.") and k.endswith(".weight"))
        if not indices:
            raise ValueError("the layout has no torso layers")
        self.layers = [
            (np.ascontiguousarray(weights[f"torso.{i}.weight"].T), weights[f"torso.{i}.bias"].copy()) for i in indices
        ]
        self.act_fn = ACTIVATIONS[activation]

    def __call__(self, x: np.ndarray) -> np.ndarray:
        x = x.reshape(x.shape[0], -1)
        for w, b in self.layers:
            x = self.act_fn(x @ w + b)
        return x


def _linear(weights: Mapping[str, np.ndarray], name: str) -> tuple[np.ndarray, np.ndarray]:
    return np.ascontiguousarray(weights[f"{name}.weight"].T), weights[f"{name}.bias"].copy()


class NumpyDuelingQ:
    """``offpolicy_nets.DuelingQ``'s forward pass in numpy: ``q(obs) -> [N, actions]``."""

    def __init__(self, flat: np.ndarray, layout: list, activation: str) -> None:
        weights = unflatten(np.asarray(flat, dtype=np.float32), layout)
        self.torso = _Torso(weights, activation)
        self.value_head = _linear(weights, "value")
        self.advantage_head = _linear(weights, "advantage")

    def __call__(self, obs: np.ndarray) -> np.ndarray:
        x = self.torso(obs)
        adv = x @ self.advantage_head[0] + self.advantage_head[1]
        return x @ self.value_head[0] + self.value_head[1] + adv - adv.mean(axis=1, keepdims=True)


class NumpyGaussian:
    """``offpolicy_nets.SquashedGaussian``'s forward pass in numpy: ``(mu, log_std)`` before the squashing."""

    def __init__(self, flat: np.ndarray, layout: list, activation: str) -> None:
        weights = unflatten(np.asarray(flat, dtype=np.float32), layout)
        self.torso = _Torso(weights, activation)
        self.mu = _linear(weights, "mu")
        self.log_std = _linear(weights, "log_std")

    def __call__(self, obs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        x = self.torso(obs)
        return x @ self.mu[0] + self.mu[1], x @ self.log_std[0] + self.log_std[1]


class SACPolicy:
    """``a = tanh(u)``, ``u ~ N(mu(s), sigma(s))``, scaled to the action bounds; no critic on the actor (values 0).
    ``gaussian(obs) -> (mu, log_std)``: ``NumpyGaussian`` or a torch network (``torch_policy.TorchForward``)."""

    def __init__(
        self,
        gaussian: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]],
        outputs: int,
        low: tuple[float, ...],
        high: tuple[float, ...],
    ) -> None:
        self.gaussian, self.outputs = gaussian, outputs
        lo, hi = np.asarray(low, np.float32), np.asarray(high, np.float32)
        self.mid, self.half = (hi + lo) / 2, (hi - lo) / 2

    def value(self, obs: np.ndarray) -> np.ndarray:
        return np.zeros(obs.shape[0], dtype=np.float32)

    def act(self, obs: np.ndarray, rng: np.random.Generator, deterministic: bool = False) -> ActOutput:
        mu, log_std = self.gaussian(obs)
        log_std = np.clip(log_std, LOG_STD_MIN, LOG_STD_MAX)
        noise = np.zeros_like(mu) if deterministic else rng.standard_normal(mu.shape, dtype=np.float32)
        a = np.tanh(mu + np.exp(log_std) * noise)
        logp = (-0.5 * noise**2 - log_std - 0.5 * np.log(2 * np.pi)).sum(axis=1)
        logp -= np.log1p(-(a**2) + SQUASH_EPS).sum(axis=1)
        zeros = np.zeros(obs.shape[0], dtype=np.float32)
        return ActOutput((self.mid + self.half * a).astype(np.float32), logp.astype(np.float32), zeros)
