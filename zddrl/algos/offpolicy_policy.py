"""Actor-side inference of the replay algorithms: Ape-X's epsilon-greedy Q and SAC's squashed Gaussian.

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
from zddrl.algos.replay_buffer.nstep import nstep_td_errors

LOG_STD_MIN, LOG_STD_MAX = -20.0, 2.0
SQUASH_EPS = 1e-6


def apex_epsilons(eps_base: float, eps_alpha: float, first: int, count: int, total: int) -> np.ndarray:
    """Exploration of envs ``first .. first + count - 1`` of ``total``: ``eps_base ** (1 + eps_alpha i / (total - 1))``
    (Horgan et al. 2018). Indices past ``total - 1`` start the schedule over (an actor beyond the planned fleet
    explores like one within it, never all at the smallest epsilon); a fleet of one env explores at ``eps_base``."""
    i = np.arange(first, first + count) % max(total, 1)
    return (eps_base ** (1.0 + eps_alpha * i / max(total - 1, 1))).astype(np.float32)


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


class QPolicy:
    """Epsilon-greedy on a Q-function ``q(obs) -> [N, actions]`` (numpy ``NumpyDuelingQ``, or a torch network
    through ``torch_policy.TorchForward``); ``eps`` ``[N]``: each env's exploration (``apex_epsilons``)."""

    def __init__(
        self, q: Callable[[np.ndarray], np.ndarray], outputs: int, eps: np.ndarray, gamma: float, n_step: int
    ) -> None:
        self.q, self.outputs = q, outputs
        self.eps = np.asarray(eps, dtype=np.float32)
        self.gamma, self.n_step = gamma, n_step

    def value(self, obs: np.ndarray) -> np.ndarray:
        """``max_a Q(s, a)``: the greedy policy's value, what n-step targets bootstrap from."""
        return self.q(obs).max(axis=1)

    def act(self, obs: np.ndarray, rng: np.random.Generator, deterministic: bool = False) -> ActOutput:
        q = self.q(obs)
        n, k = q.shape
        greedy = q.argmax(axis=1)
        actions = greedy
        if not deterministic:
            explore = rng.random(n, dtype=np.float32) < self.eps
            actions = np.where(explore, rng.integers(k, size=n), greedy)
        rows = np.arange(n)
        prob = self.eps / k + (1.0 - self.eps) * (actions == greedy)
        return ActOutput(
            actions.astype(np.int64),
            np.log(prob).astype(np.float32),
            q.max(axis=1).astype(np.float32),
            q[rows, actions].astype(np.float32),
        )

    def td_errors(self, arrays: Mapping[str, np.ndarray], q_taken: np.ndarray) -> np.ndarray:
        """The initial priorities of what this actor sampled (the actor sends them when its policy has this)."""
        return nstep_td_errors(arrays, q_taken, self.gamma, self.n_step)


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
