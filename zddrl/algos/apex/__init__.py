"""Ape-X DQN (Horgan et al. 2018): dueling double Q-learning on n-step returns from a prioritized replay buffer,
filled by epsilon-greedy actors of fixed epsilons (``learner.ApexLearner``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from zddrl.algos.apex.policy import QPolicy, apex_epsilons
from zddrl.algos.offpolicy_policy import NumpyDuelingQ
from zddrl.algos.replay_spec import REPLAY_ALGO_FIGURES, replay_algo_refusal
from zddrl.algos.spec import ActingVersion, AlgorithmSpec, DeclaredArray, Figure, ReplayFeed
from zddrl.config import Config
from zddrl.tomlconf import require

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from zddrl.algos.apex.learner import ApexLearner
    from zddrl.envs import EnvSpec
    from zddrl.shards.group import ShardGroup


@dataclass(frozen=True)
class ApexSettings:
    """Ape-X's own ``[algo]`` keys."""

    target_update_every: int = 500
    """Gradient steps between copies of the online Q-network into the target network."""
    eps_base: float = 0.4
    """Exploration of env ``i`` of ``N``: ``eps_base ** (1 + eps_alpha * i / (N - 1))`` (Horgan et al. 2018)."""
    eps_alpha: float = 7.0
    """See ``eps_base``."""

    def __post_init__(self) -> None:
        require(self.target_update_every >= 1, "algo.target_update_every must be >= 1")
        require(0.0 <= self.eps_base <= 1.0 and self.eps_alpha >= 0, "algo.eps_base in [0, 1], algo.eps_alpha >= 0")


def _learner(config: Config, env: EnvSpec, group: ShardGroup) -> ApexLearner:
    from zddrl.algos.apex.learner import ApexLearner

    return ApexLearner(config, env, group)


def _model(config: Config, env: EnvSpec) -> torch.nn.Module:
    if config.model.is_custom:
        from zddrl.algos.custom_model import CustomQ

        return CustomQ(env, config.model)
    from zddrl.algos.offpolicy_nets import DuelingQ

    return DuelingQ(env, config.model)


def _policy(v: ActingVersion) -> QPolicy:
    """Epsilon-greedy with this host's envs' places in the fleet's epsilon schedule; the Q-network in numpy (the
    built-in MLP) or torch (a network of the user's own)."""
    s, num_envs = v.config.algo.settings, v.num_envs or v.config.env.num_envs
    eps = apex_epsilons(s.eps_base, s.eps_alpha, v.actor_id * num_envs, num_envs, v.config.train.actors * num_envs)
    if v.config.model.is_custom:
        from zddrl.algos.torch_policy import TorchForward

        q: Callable[[np.ndarray], np.ndarray] = TorchForward(_model(v.config, v.env), v.flat, v.layout)
        outputs = v.env.action_dim  # load_flat refuses a layout of other sizes
    else:
        dueling = NumpyDuelingQ(v.flat, v.layout, v.config.model.activation)
        q, outputs = dueling, dueling.advantage_head[1].shape[0]
    return QPolicy(q, outputs, eps, v.config.algo.gamma, v.config.replay.n_step)


def _check(config: Config, env: EnvSpec) -> str:
    if not env.discrete:
        return "algo.name 'apex' needs a discrete (Discrete) action space"
    return replay_algo_refusal(config, env)


def _export(net: torch.nn.Module, env: EnvSpec, obs_rms: Mapping | None) -> torch.nn.Module:
    from zddrl.algos.exported import GreedyQPolicy

    return GreedyQPolicy(net, env, obs_rms)


ALGORITHM = AlgorithmSpec(
    name="apex",
    settings=ApexSettings,
    schedules=("async",),
    learner=_learner,
    acting_model=_model,
    acting_policy=_policy,
    figures=(*REPLAY_ALGO_FIGURES, Figure("loss"), Figure("q_mean"), Figure("td_abs_mean")),
    check=_check,
    arrays=(
        DeclaredArray("q_taken", "float32", sent=False),  # Q(s, a) of the action taken: what actor_td is made of
        DeclaredArray("actor_td", "float32"),  # the actor's n-step TD errors: its transitions' first priorities
    ),
    replay=ReplayFeed(priorities="actor_td"),
    export=_export,
)
