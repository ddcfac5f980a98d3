"""IMPALA (Espeholt et al. 2018): V-trace actor-critic on data of older policies (``learner.ImpalaLearner``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from zddrl.algos.actor_critic import ACTOR_CRITIC_FIGURES, acting_policy, actor_critic_model, check_actor_critic
from zddrl.algos.spec import AlgorithmSpec, Figure
from zddrl.config import Config
from zddrl.tomlconf import require

if TYPE_CHECKING:  # pragma: no cover
    from zddrl.algos.impala.learner import ImpalaLearner
    from zddrl.envs import EnvSpec
    from zddrl.shards.group import ShardGroup


@dataclass(frozen=True)
class ImpalaSettings:
    """IMPALA's own ``[algo]`` keys."""

    epochs: int = 10
    """Passes over each batch (the paper: 1)."""
    minibatches: int = 4
    """Optimizer steps per pass, each on a share of the batch's env columns (whole trajectories)."""
    vf_coef: float = 0.5
    """Weight of the value loss."""
    ent_coef: float = 0.0
    """Weight of the entropy bonus."""
    rho_bar: float = 1.0
    """V-trace rho-bar: truncation of the importance weights in the targets and the policy gradient."""
    c_bar: float = 1.0
    """V-trace trace-cutting c-bar."""

    def __post_init__(self) -> None:
        require(self.epochs >= 1 and self.minibatches >= 1, "algo.epochs and algo.minibatches must be >= 1")
        require(self.rho_bar > 0 and self.c_bar > 0, "algo.rho_bar and algo.c_bar must be > 0")


def _learner(config: Config, env: EnvSpec, group: ShardGroup) -> ImpalaLearner:
    from zddrl.algos.impala.learner import ImpalaLearner

    return ImpalaLearner(config, env, group)


ALGORITHM = AlgorithmSpec(
    name="impala",
    settings=ImpalaSettings,
    schedules=("async",),
    learner=_learner,
    acting_model=actor_critic_model,
    acting_policy=acting_policy,
    figures=(*ACTOR_CRITIC_FIGURES, Figure("rho_mean")),
    check=check_actor_critic,
    fixed_rollout_len=True,
)
