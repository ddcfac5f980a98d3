"""Networks of the user's own: ``model.kind = "package.module:make"``, one factory per run, called as
``make(env: zddrl.envs.EnvSpec, model: zddrl.config.ModelConfig, **model.kwargs) -> torch.nn.Module`` by the learner
and by every actor, so that its parameters travel by name and shape (``model.flatten_params``). What ``forward`` must
return depends on the algorithm's family (tensors only: ``zddrl export`` traces it):

- actor-critic (ppo, impala, plug-ins such as examples/plugins' A2C): ``forward(obs) -> (dist_params, value)``:
  the logits ``[B, action_dim]`` (Discrete) or the Gaussian's mean and log standard deviation side by side,
  ``[B, 2 * action_dim]`` (Box); and the state value ``[B]``.
- Q-learning (apex): ``forward(obs) -> q`` ``[B, action_dim]``.
- SAC: ``forward(obs) -> (mean, log_std)``, each ``[B, action_dim]``, of the Gaussian before the tanh squashing
  (log_std is clamped to [-20, 2] after it). The critics are SAC's own MLPs unless the factory also takes
  ``critic=True``: ``make(env, model, critic=True)`` then builds one critic, ``forward(obs, action) -> q [B]``
  (actions in [-1, 1]), and the learner builds two (the twin critics).

``obs`` is a batch of raw observations ``[B, *env.obs_shape]``: float32, or uint8 pixels for the network to scale.
Every network is checked once when built, on a batch of two zero observations: a wrong shape is a one-line
ConfigError naming the interface, and so is a recurrent network (one with ``initial_state``, or whose ``forward`` needs
more than the family's inputs): recurrent cores, ``initial_state(batch)`` and ``forward(obs, state, episode_start) ->
(outputs, state)``, are not supported yet.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from zddrl.algos.offpolicy_nets import LOG_STD_MAX, LOG_STD_MIN, SquashedPolicy
from zddrl.config import ConfigError, ModelConfig
from zddrl.envs import EnvSpec
from zddrl.plugin import load

PROBE = 2
"""Observations in the batch each network is checked on."""


def build_custom(env: EnvSpec, config: ModelConfig, family: str, expected: tuple, **kwargs: Any) -> nn.Module:
    """The user's module for ``family``, checked: an ``nn.Module`` whose forward gives ``expected`` shapes (a tuple of
    shapes, or one shape) on a probe batch."""
    make = load(config.kind, "model.kind")
    unknown = kwargs_refusal(make, config)
    if unknown:
        raise ConfigError(unknown)
    net = make(env, config, **config.kwargs, **kwargs)
    if not isinstance(net, nn.Module):
        raise ConfigError(f"model.kind {config.kind!r} returned a {type(net).__name__}, not a torch.nn.Module")
    why = signature_refusal(net, config, family, len(probe_inputs(env, **kwargs)))
    if why:
        raise ConfigError(why)
    with torch.no_grad():
        out = net(*probe_inputs(env, **kwargs))
    got = tuple(tuple(t.shape) for t in out) if isinstance(out, tuple) else tuple(getattr(out, "shape", ()))
    if got != expected:
        raise ConfigError(
            f"model.kind {config.kind!r} ({family}): forward on a batch of {PROBE} must return shapes {expected}, "
            f"got {got} (docs/extending.md)"
        )
    return net


def signature_refusal(net: nn.Module, config: ModelConfig, family: str, inputs: int) -> str:
    """Why ``net``'s ``forward`` does not fit the family's call (``inputs`` tensors), or "": a recurrent network
    (``initial_state``, or a ``forward`` that needs more arguments, such as a state) is named as such in one line
    instead of failing inside the learner."""
    try:
        params = list(inspect.signature(net.forward).parameters.values())
    except (TypeError, ValueError):  # no signature to read: the probe call says
        return ""
    needed = [p.name for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    call = "forward(obs, action)" if inputs == 2 else "forward(obs)"
    if hasattr(net, "initial_state") or len(needed) > inputs:
        return (
            f"model.kind {config.kind!r} ({family}) looks recurrent (forward({', '.join(needed)})"
            f"{', initial_state' if hasattr(net, 'initial_state') else ''}): zddrl's algorithms call {call} on "
            "feed-forward networks, and recurrent cores (initial_state(batch), forward(obs, state, episode_start) "
            "-> (outputs, state)) are not supported yet (docs/extending.md)"
        )
    return ""


def kwargs_refusal(make: Any, config: ModelConfig) -> str:
    """Why ``make`` cannot take ``model.kwargs`` (a name its signature lacks, with no ``**kwargs``), or ""."""
    try:
        params = inspect.signature(make).parameters
    except (TypeError, ValueError):  # a callable without a signature: its call says
        return ""
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return ""
    unknown = sorted(set(config.kwargs) - set(params))
    if not unknown:
        return ""
    takes = [n for n, p in list(params.items())[2:] if p.kind is not inspect.Parameter.VAR_POSITIONAL]
    return f"model.kwargs {unknown}: model.kind {config.kind!r} takes no such keyword (it takes {takes or 'none'})"


def probe_inputs(env: EnvSpec, critic: bool = False) -> tuple[torch.Tensor, ...]:
    obs = torch.zeros((PROBE, *env.obs_shape), dtype=torch.uint8 if env.obs_dtype == "uint8" else torch.float32)
    return (obs, torch.zeros(PROBE, env.action_dim)) if critic else (obs,)


def takes_critic(config: ModelConfig) -> bool:
    """Whether the user's factory builds SAC's critics too (it takes a ``critic`` keyword)."""
    return "critic" in inspect.signature(load(config.kind, "model.kind")).parameters


class CustomActorCritic(nn.Module):
    """The user's actor-critic network behind the interface the actor-critic cores use (``model.ActorCritic``'s)."""

    def __init__(self, env: EnvSpec, config: ModelConfig) -> None:
        super().__init__()
        self.discrete = env.discrete
        self.action_dim = env.action_dim
        width = env.action_dim if env.discrete else 2 * env.action_dim
        self.net = build_custom(env, config, "actor-critic", ((PROBE, width), (PROBE,)))

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


class CustomQ(nn.Module):
    """The user's Q-network (apex): ``forward(obs) -> q [B, actions]``."""

    def __init__(self, env: EnvSpec, config: ModelConfig) -> None:
        super().__init__()
        self.net = build_custom(env, config, "Q", (PROBE, env.action_dim))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.net(obs)


class CustomGaussian(SquashedPolicy):
    """The user's SAC policy network: ``forward(obs) -> (mean, log_std)`` before the squashing (log_std clamped)."""

    def __init__(self, env: EnvSpec, config: ModelConfig) -> None:
        super().__init__()
        shape = (PROBE, env.action_dim)
        self.net = build_custom(env, config, "SAC policy", (shape, shape))

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mu, log_std = self.net(obs)
        return mu, log_std.clamp(LOG_STD_MIN, LOG_STD_MAX)


class CustomTwinQ(nn.Module):
    """Two of the user's critics, ``make(env, model, critic=True)``: ``forward(obs, actions) -> (q1, q2)``."""

    def __init__(self, env: EnvSpec, config: ModelConfig) -> None:
        super().__init__()
        self.q1, self.q2 = (build_custom(env, config, "SAC critic", (PROBE,), critic=True) for _ in range(2))

    def forward(self, obs: torch.Tensor, actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q1(obs, actions), self.q2(obs, actions)
