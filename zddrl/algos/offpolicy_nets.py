"""The networks of the replay algorithms: Ape-X's dueling Q-network and SAC's squashed Gaussian policy and twin critics.

What travels to the actors is the acting network alone (``DuelingQ`` for apex, ``SquashedGaussian`` for sac) as
the flat float32 buffer of ``model.flatten_params``; actors rebuild it in numpy (``zddrl.algos.offpolicy_policy``), so
the layer names here are part of that contract: ``torso.{i}`` (Linear layers at even indices, each followed by
the activation), then the heads.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from zddrl.algos.model import ACTIVATIONS
from zddrl.config import ModelConfig
from zddrl.envs import EnvSpec

LOG_STD_MIN, LOG_STD_MAX = -20.0, 2.0
"""Bounds of SAC's log standard deviation (Haarnoja et al. 2018; SB3 and CleanRL clamp alike)."""
SQUASH_EPS = 1e-6
"""Inside ``log(1 - tanh(u)^2 + eps)``: keeps the log-determinant finite where tanh saturates."""


def torso(sizes: list[int], activation: str) -> nn.Sequential:
    """Linear + activation per hidden layer (orthogonal init, gain sqrt 2, zero bias)."""
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 1):
        linear = nn.Linear(sizes[i], sizes[i + 1])
        nn.init.orthogonal_(linear.weight, math.sqrt(2))
        nn.init.zeros_(linear.bias)
        layers += [linear, ACTIVATIONS[activation]()]
    return nn.Sequential(*layers)


def head(width: int, outputs: int, gain: float) -> nn.Linear:
    linear = nn.Linear(width, outputs)
    nn.init.orthogonal_(linear.weight, gain)
    nn.init.zeros_(linear.bias)
    return linear


class DuelingQ(nn.Module):
    """``Q(s, a) = V(s) + A(s, a) - mean_a' A(s, a')`` on one torso (Wang et al. 2016)."""

    def __init__(self, spec: EnvSpec, config: ModelConfig) -> None:
        super().__init__()
        if not spec.discrete:
            raise ValueError("apex needs a discrete action space (Discrete)")
        obs_dim = int(np.prod(spec.obs_shape))
        self.torso = torso([obs_dim, *config.hidden], config.activation)
        self.value = head(config.hidden[-1], 1, 1.0)
        self.advantage = head(config.hidden[-1], spec.action_dim, 1.0)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        x = self.torso(obs.flatten(1).float())
        adv = self.advantage(x)
        return self.value(x) + adv - adv.mean(dim=1, keepdim=True)


class SquashedPolicy(nn.Module):
    """SAC's policy from any ``forward(obs) -> (mu, log_std)``: ``a = tanh(u)``, ``u ~ N(mu(s), sigma(s))``, in
    ``[-1, 1]^A`` (actors scale to the bounds). ``SquashedGaussian`` is zddrl's; ``custom_model.CustomGaussian``
    the user's."""

    def sample(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A reparameterised action in ``[-1, 1]`` and its log-density ``[B]`` (tanh's Jacobian included)."""
        mu, log_std = self(obs)
        noise = torch.randn_like(mu)
        u = mu + log_std.exp() * noise
        a = torch.tanh(u)
        logp = (-0.5 * noise.pow(2) - log_std - 0.5 * math.log(2 * math.pi)).sum(-1)
        return a, logp - torch.log1p(-a.pow(2) + SQUASH_EPS).sum(-1)

    def greedy(self, obs: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self(obs)[0])


class SquashedGaussian(SquashedPolicy):
    """SAC's policy network: an MLP torso, then the mean and the log standard deviation heads."""

    def __init__(self, spec: EnvSpec, config: ModelConfig) -> None:
        super().__init__()
        if spec.discrete:
            raise ValueError("sac needs a continuous action space (1-D Box)")
        obs_dim = int(np.prod(spec.obs_shape))
        self.torso = torso([obs_dim, *config.hidden], config.activation)
        self.mu = head(config.hidden[-1], spec.action_dim, 0.01)
        self.log_std = head(config.hidden[-1], spec.action_dim, 0.01)

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.torso(obs.flatten(1).float())
        return self.mu(x), self.log_std(x).clamp(LOG_STD_MIN, LOG_STD_MAX)


class TwinQ(nn.Module):
    """Two independent ``Q(s, a)`` MLPs (Fujimoto et al. 2018's clipped double Q, as SAC uses them)."""

    def __init__(self, spec: EnvSpec, config: ModelConfig) -> None:
        super().__init__()
        width = int(np.prod(spec.obs_shape)) + spec.action_dim
        self.q1 = nn.Sequential(torso([width, *config.hidden], config.activation), head(config.hidden[-1], 1, 1.0))
        self.q2 = nn.Sequential(torso([width, *config.hidden], config.activation), head(config.hidden[-1], 1, 1.0))

    def forward(self, obs: torch.Tensor, actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.cat([obs.flatten(1).float(), actions], dim=1)
        return self.q1(x).squeeze(-1), self.q2(x).squeeze(-1)
