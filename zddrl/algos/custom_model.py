"""A network of the user's own for the actor-critic algorithms: ``model.kind = "package.module:make"``.

``make(env: zddrl.envs.EnvSpec, model: zddrl.config.ModelConfig) -> torch.nn.Module`` builds it; its
``forward(obs)`` takes a batch of raw observations ``[B, *env.obs_shape]`` (float32, or uint8 pixels to scale
itself) and returns ``(dist_params, value)``: the logits ``[B, env.action_dim]`` for a Discrete action space,
or the Gaussian's mean and log standard deviation side by side, ``[B, 2 * env.action_dim]``, for a Box one;
and the state value ``[B]``. Tensors only: the exporters (``zddrl export``) trace it.

Learner and actors build the same network with the same call, so its parameters travel by name and shape
(``model.flatten_params``). A recurrent network will add ``initial_state(batch) -> state`` and take and return
the state in ``forward(obs, state, first)``; a module without ``initial_state`` is feed-forward, so this
interface stays as it is when that comes.
"""

from __future__ import annotations

import torch
from torch import nn

from zddrl.config import ConfigError, ModelConfig
from zddrl.envs import EnvSpec
from zddrl.plugin import load


def build_custom(env: EnvSpec, config: ModelConfig) -> nn.Module:
    """The user's module, checked: an ``nn.Module`` whose forward gives the shapes the interface promises."""
    make = load(config.kind, "model.kind")
    net = make(env, config)
    if not isinstance(net, nn.Module):
        raise ConfigError(f"model.kind {config.kind!r} returned a {type(net).__name__}, not a torch.nn.Module")
    probe = torch.zeros((2, *env.obs_shape), dtype=torch.uint8 if env.obs_dtype == "uint8" else torch.float32)
    with torch.no_grad():
        out = net(probe)
    width = env.action_dim if env.discrete else 2 * env.action_dim
    ok = isinstance(out, tuple) and len(out) == 2 and all(isinstance(t, torch.Tensor) for t in out)
    if not ok or tuple(out[0].shape) != (2, width) or tuple(out[1].shape) != (2,):
        got = [tuple(t.shape) for t in out] if isinstance(out, tuple) else type(out).__name__
        raise ConfigError(
            f"model.kind {config.kind!r}: forward(obs [2, *obs_shape]) must return (dist_params [2, {width}], "
            f"value [2]), got {got} (docs/extending.md)"
        )
    return net


class CustomActorCritic(nn.Module):
    """The user's network behind the interface the actor-critic cores use (``model.ActorCritic``'s)."""

    def __init__(self, env: EnvSpec, config: ModelConfig) -> None:
        super().__init__()
        self.discrete = env.discrete
        self.action_dim = env.action_dim
        self.net = build_custom(env, config)

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.net(obs)

    def features(self, obs: torch.Tensor) -> torch.Tensor:
        return obs  # the user's network is one piece: nothing to split off for the autocast path

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        return self.net(obs)[1]

    def distribution_of(self, params: torch.Tensor) -> torch.distributions.Distribution:
        if self.discrete:
            return torch.distributions.Categorical(logits=params, validate_args=False)
        mean, log_std = params.split(self.action_dim, dim=1)
        return torch.distributions.Normal(mean, log_std.exp(), validate_args=False)

    def distribution(self, obs: torch.Tensor) -> torch.distributions.Distribution:
        return self.distribution_of(self.net(obs)[0])

    def evaluate(self, obs: torch.Tensor, actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(log-prob of ``actions``, entropy, value), each ``[B]``."""
        params, value = self.net(obs)
        dist = self.distribution_of(params)
        if self.discrete:
            return dist.log_prob(actions.long()), dist.entropy(), value
        return dist.log_prob(actions).sum(-1), dist.entropy().sum(-1), value

    def evaluate_features(
        self, x: torch.Tensor, actions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.evaluate(x, actions)
