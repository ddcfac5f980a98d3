"""Networks of the user's own, one factory per algorithm family (docs/extending.md), each with layer normalisation,
which none of zddrl's built-in MLPs has. The learner and every actor call the factory with the run's
``zddrl.envs.EnvSpec`` and ``[model]`` section:

- ``model.kind = "nets:make"`` (ppo, impala): one torso shared by the policy and value heads; ``forward(obs)`` returns
  ``(dist_params, value)``: the logits (Discrete) or the mean and log standard deviation side by side (Box), and V.
- ``model.kind = "nets:make_q"`` (apex): ``forward(obs)`` returns Q-values, one per action.
- ``model.kind = "nets:make_sac"`` (sac): the policy, ``forward(obs) -> (mean, log_std)``, and with ``critic=True``
  one critic, ``forward(obs, action) -> Q``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from zddrl.config import ModelConfig
from zddrl.envs import EnvSpec


def torso(size: int, hidden: tuple[int, ...]) -> tuple[nn.Sequential, int]:
    """Linear, LayerNorm, tanh per width of ``model.hidden``; the torso and its output width."""
    layers: list[nn.Module] = []
    for width in hidden:
        layers += [nn.Linear(size, width), nn.LayerNorm(width), nn.Tanh()]
        size = width
    return nn.Sequential(*layers), size


class SharedTorso(nn.Module):
    def __init__(self, env: EnvSpec, model: ModelConfig) -> None:
        super().__init__()
        self.torso, size = torso(math.prod(env.obs_shape), model.hidden)
        self.discrete = env.discrete
        self.pi = nn.Linear(size, env.action_dim)
        self.v = nn.Linear(size, 1)
        nn.init.orthogonal_(self.pi.weight, 0.01)
        nn.init.zeros_(self.pi.bias)
        if not env.discrete:
            self.log_std = nn.Parameter(torch.full((env.action_dim,), model.log_std_init))

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.torso(obs.flatten(1).float())
        out = self.pi(x)
        if not self.discrete:
            out = torch.cat([out, self.log_std.expand_as(out)], dim=1)
        return out, self.v(x).squeeze(-1)


def make(env: EnvSpec, model: ModelConfig) -> nn.Module:
    return SharedTorso(env, model)


class QNet(nn.Module):
    def __init__(self, env: EnvSpec, model: ModelConfig) -> None:
        super().__init__()
        self.torso, size = torso(math.prod(env.obs_shape), model.hidden)
        self.q = nn.Linear(size, env.action_dim)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.q(self.torso(obs.flatten(1).float()))


def make_q(env: EnvSpec, model: ModelConfig) -> nn.Module:
    return QNet(env, model)


class GaussianNet(nn.Module):
    def __init__(self, env: EnvSpec, model: ModelConfig) -> None:
        super().__init__()
        self.torso, size = torso(math.prod(env.obs_shape), model.hidden)
        self.mu, self.log_std = nn.Linear(size, env.action_dim), nn.Linear(size, env.action_dim)

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.torso(obs.flatten(1).float())
        return self.mu(x), self.log_std(x)


class Critic(nn.Module):
    def __init__(self, env: EnvSpec, model: ModelConfig) -> None:
        super().__init__()
        self.torso, size = torso(math.prod(env.obs_shape) + env.action_dim, model.hidden)
        self.q = nn.Linear(size, 1)

    def forward(self, obs: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        return self.q(self.torso(torch.cat([obs.flatten(1).float(), action], dim=1))).squeeze(-1)


def make_sac(env: EnvSpec, model: ModelConfig, critic: bool = False) -> nn.Module:
    return Critic(env, model) if critic else GaussianNet(env, model)
