"""PPO (Schulman et al. 2017), sync or async: the clipped surrogate, with truncated importance weights against
stale behaviour policies under the async schedule (Hilton et al. 2021; ``learner.PPOLearner``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from zddrl.algos.actor_critic import ACTOR_CRITIC_FIGURES, acting_policy, actor_critic_model, check_actor_critic
from zddrl.algos.spec import AlgorithmSpec, Figure
from zddrl.config import SCHEDULES, Config
from zddrl.tomlconf import require

if TYPE_CHECKING:  # pragma: no cover
    from zddrl.algos.ppo.learner import PPOLearner
    from zddrl.envs import EnvSpec
    from zddrl.shards.group import ShardGroup


@dataclass(frozen=True)
class PPOSettings:
    """PPO's own ``[algo]`` keys."""

    gae_lambda: float = 0.95
    """GAE lambda (1 = Monte-Carlo returns, 0 = one-step TD)."""
    epochs: int = 10
    """Passes over each batch."""
    minibatches: int = 4
    """Minibatches per epoch (minibatch size = batch / minibatches)."""
    clip: float = 0.2
    """Ratio clip epsilon (start value of its schedule); also the value-clip range."""
    clip_schedule: str = "constant"
    """constant | linear (to 0 at total_steps)."""
    vf_coef: float = 0.5
    """Weight of the value loss."""
    ent_coef: float = 0.0
    """Weight of the entropy bonus."""
    norm_adv: bool = True
    """Normalise advantages per minibatch."""
    clip_vloss: bool = False
    """Clip the value update like the policy ratio."""
    rho_bar: float = 1.0
    """Async schedule: truncation of the importance weights against the behaviour policy."""

    def __post_init__(self) -> None:
        require(0.0 <= self.gae_lambda <= 1.0, "algo.gae_lambda must be in [0, 1]")
        require(self.epochs >= 1 and self.minibatches >= 1, "algo.epochs and algo.minibatches must be >= 1")
        require(self.clip > 0, "algo.clip must be > 0")
        require(self.clip_schedule in SCHEDULES, f"algo.clip_schedule must be one of {SCHEDULES}")
        require(self.rho_bar > 0, "algo.rho_bar must be > 0")


def _learner(config: Config, env: EnvSpec, group: ShardGroup) -> PPOLearner:
    from zddrl.algos.ppo.learner import PPOLearner

    return PPOLearner(config, env, group)


ALGORITHM = AlgorithmSpec(
    name="ppo",
    settings=PPOSettings,
    schedules=("sync", "async"),
    learner=_learner,
    acting_model=actor_critic_model,
    acting_policy=acting_policy,
    figures=(
        *ACTOR_CRITIC_FIGURES,
        Figure("approx_kl"),
        Figure("clipfrac"),
        Figure("is_weight_mean"),
        Figure("clip", "perf"),
    ),
    check=check_actor_critic,
)
