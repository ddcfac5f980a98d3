"""A network of the user's own for the actor-critic algorithms (``model.kind = "nets:make"``): one torso shared by
the policy and value heads, with layer normalisation, which none of zddrl's built-in MLPs has.

``make(env, model)`` is called by the learner and by every actor with the run's ``zddrl.envs.EnvSpec`` and
``[model]`` section; ``forward(obs)`` returns ``(dist_params, value)``: the logits for a Discrete action space,
the mean and log standard deviation side by side for a Box one, and ``V(obs)`` (docs/extending.md).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from zddrl.config import ModelConfig
from zddrl.envs import EnvSpec


class SharedTorso(nn.Module):
    def __init__(self, env: EnvSpec, model: ModelConfig) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        size = math.prod(env.obs_shape)
        for width in model.hidden:  # the run's model.hidden sizes the torso
            layers += [nn.Linear(size, width), nn.LayerNorm(width), nn.Tanh()]
            size = width
        self.torso = nn.Sequential(*layers)
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
