"""Soft actor-critic (Haarnoja et al. 2018) on a replay buffer, for continuous actions (``learner.SACLearner``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from zddrl.algos.offpolicy_policy import NumpyGaussian, SACPolicy
from zddrl.algos.replay_spec import REPLAY_ALGO_FIGURES, replay_algo_refusal
from zddrl.algos.spec import ActingVersion, AlgorithmSpec, Figure, ReplayFeed
from zddrl.config import Config
from zddrl.tomlconf import require

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from zddrl.algos.sac.learner import SACLearner
    from zddrl.envs import EnvSpec
    from zddrl.shards.group import ShardGroup


@dataclass(frozen=True)
class SACSettings:
    """SAC's own ``[algo]`` keys."""

    tau: float = 0.005
    """Polyak factor of the target critics (``target += tau * (online - target)`` per gradient step)."""
    init_temperature: float = 1.0
    """Initial entropy temperature (the papers' alpha)."""
    autotune_temperature: bool = True
    """Tune the temperature towards a target entropy of ``-action_dim`` (Haarnoja et al. 2018b)."""

    def __post_init__(self) -> None:
        require(0.0 < self.tau <= 1.0, "algo.tau must be in (0, 1]")
        require(self.init_temperature > 0, "algo.init_temperature must be > 0")


def _learner(config: Config, env: EnvSpec, group: ShardGroup) -> SACLearner:
    from zddrl.algos.sac.learner import SACLearner

    return SACLearner(config, env, group)


def _model(config: Config, env: EnvSpec) -> torch.nn.Module:
    if config.model.is_custom:
        from zddrl.algos.custom_model import CustomGaussian

        return CustomGaussian(env, config.model)
    from zddrl.algos.offpolicy_nets import SquashedGaussian

    return SquashedGaussian(env, config.model)


def _policy(v: ActingVersion) -> SACPolicy:
    """The squashed Gaussian in numpy (the built-in MLP) or torch (a network of the user's own)."""
    if v.config.model.is_custom:
        from zddrl.algos.torch_policy import TorchForward

        forward = TorchForward(_model(v.config, v.env), v.flat, v.layout)
        return SACPolicy(forward, v.env.action_dim, v.env.action_low, v.env.action_high)
    gaussian = NumpyGaussian(v.flat, v.layout, v.config.model.activation)
    return SACPolicy(gaussian, gaussian.mu[1].shape[0], v.env.action_low, v.env.action_high)


def _check(config: Config, env: EnvSpec) -> str:
    if env.discrete:
        return "algo.name 'sac' needs a continuous (1-D Box) action space"
    if not np.all(np.isfinite(env.action_low + env.action_high)):
        return "algo.name 'sac' needs finite action bounds (it squashes actions into them)"
    return replay_algo_refusal(config, env)


def _export(net: torch.nn.Module, env: EnvSpec, obs_rms: Mapping | None) -> torch.nn.Module:
    from zddrl.algos.exported import SquashedGaussianPolicy

    return SquashedGaussianPolicy(net, env, obs_rms)


ALGORITHM = AlgorithmSpec(
    name="sac",
    settings=SACSettings,
    schedules=("async",),
    learner=_learner,
    acting_model=_model,
    acting_policy=_policy,
    figures=(
        *REPLAY_ALGO_FIGURES,
        Figure("critic_loss"),
        Figure("actor_loss"),
        Figure("q_mean"),
        Figure("entropy"),
        Figure("temperature"),
    ),
    check=_check,
    replay=ReplayFeed(),
    export=_export,
    bounded_actions=True,
)
