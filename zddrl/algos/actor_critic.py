"""What the actor-critic algorithms share (PPO, IMPALA, and a user's own such as examples/plugins' A2C): the
network that travels to the actors, the policy the actors build from it, and their common figures.

The network is ``model.ActorCritic`` for the built-in ``model.kind``s or the user's module for a
``module:callable`` kind (``custom_model.CustomActorCritic``). Actors act with the numpy MLP for ``mlp``
(several times cheaper per step than a torch call) and in torch, one thread, for everything else. torch is
imported only when a network is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from zddrl.algos.policy import NumpyPolicy, Policy
from zddrl.algos.spec import ActingVersion, Figure
from zddrl.config import Config, ModelConfig

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from zddrl.envs import EnvSpec

ACTOR_CRITIC_FIGURES = (Figure("policy_loss"), Figure("value_loss"), Figure("entropy"), Figure("explained_variance"))


def actor_critic_network(env: EnvSpec, model: ModelConfig) -> torch.nn.Module:
    """``ActorCritic`` for the built-in kinds, the user's network (wrapped) for a ``module:callable`` kind."""
    if model.is_custom:
        from zddrl.algos.custom_model import CustomActorCritic

        return CustomActorCritic(env, model)
    from zddrl.algos.model import ActorCritic

    return ActorCritic(env, model)


def actor_critic_model(config: Config, env: EnvSpec) -> torch.nn.Module:
    """The spec's ``acting_model``: ``actor_critic_network`` of the run's ``[model]``."""
    return actor_critic_network(env, config.model)


def actor_critic_policy(
    flat: np.ndarray,
    layout: list,
    model: ModelConfig,
    env: EnvSpec,
    obs_mean: np.ndarray | None = None,
    obs_var: np.ndarray | None = None,
) -> Policy:
    """numpy for the MLPs; torch, one thread, for the CNNs (numpy runs convolutions far slower: docs/benchmarks.md,
    actor inference) and custom networks. Raises on a layout that does not build this network."""
    if model.kind == "mlp":
        return NumpyPolicy(flat, layout, model.activation, env.discrete, obs_mean, obs_var)
    from zddrl.algos.torch_policy import TorchPolicy

    return TorchPolicy(actor_critic_network(env, model), flat, layout, env, obs_mean, obs_var)


def acting_policy(version: ActingVersion) -> Policy:
    """The spec's ``acting_policy``: ``actor_critic_policy`` of a version."""
    v, extras = version, version.extras
    return actor_critic_policy(v.flat, v.layout, v.config.model, v.env, extras.get("obs_mean"), extras.get("obs_var"))


def check_actor_critic(config: Config, env: EnvSpec) -> str:
    """A network of the user's own is one piece: ``learner.autocast`` has no torso of it to run in bfloat16."""
    if config.model.is_custom and config.learner.autocast == "bf16":
        return "learner.autocast = 'bf16' needs a built-in model.kind (a network of your own runs in float32)"
    return ""
