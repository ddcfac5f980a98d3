"""A2C (Mnih et al. 2016, the synchronous variant): one gradient step per batch on the policy gradient with GAE
advantages, an entropy bonus and a value loss. A complete zddrl algorithm in one file of the user's own.

Run it with `zddrl train examples/plugins/a2c_cartpole.toml`, whose ``algo.name = "a2c:ALGORITHM"`` names the
``ALGORITHM`` object below; this file's directory (the config's) is importable, so nothing needs installing.
Hosts that join from the network import it only if they allow it: ``zddrl actor --allow-code a2c:ALGORITHM``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from zddrl import gae
from zddrl.algos.actor_critic import ACTOR_CRITIC_FIGURES, acting_policy, actor_critic_model, check_actor_critic
from zddrl.algos.core import LearnerCore
from zddrl.algos.rollout import Rollout, terminal, truncation_bootstrap
from zddrl.algos.spec import AlgorithmSpec


@dataclass(frozen=True)
class A2CSettings:
    """A2C's own ``[algo]`` keys (next to the shared ones: ``lr``, ``gamma``, ``batch_size``, ...)."""

    gae_lambda: float = 1.0
    """GAE lambda (1: the n-step returns of the paper)."""
    vf_coef: float = 0.5
    """Weight of the value loss."""
    ent_coef: float = 0.0
    """Weight of the entropy bonus."""
    norm_adv: bool = False
    """Standardise the advantages of each batch."""


class A2CLearner(LearnerCore):
    """``update(trajectories)``: GAE per trajectory with the behaviour values the actors sent, then one step."""

    def update(self, trajectories: Sequence[Rollout], staleness: float = 0.0) -> dict[str, float]:
        s = self.settings
        lr = self.set_lr(staleness)
        obs, actions, advantages, returns = self._batch(trajectories)
        logp, entropy, values = self.evaluate(obs, actions)
        if s.norm_adv and len(advantages) > 1:
            advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
        policy_loss = -(advantages * logp).mean()
        value_loss = 0.5 * ((returns - values) ** 2).mean()
        loss = policy_loss + s.vf_coef * value_loss - s.ent_coef * entropy.mean()
        grad_norm = self.step_optimizer(loss if len(obs) else None, len(obs))
        total = int(self.group.sum(len(obs))[0])
        self.steps_trained += total
        return {
            "policy_loss": policy_loss.item(),  # .item(): float() of a tensor that requires grad warns
            "value_loss": value_loss.item(),
            "entropy": entropy.mean().item(),
            "grad_norm": grad_norm or 0.0,
            "lr": lr,
            "batch_steps": total,
        }

    def _batch(self, trajectories: Sequence[Rollout]) -> tuple[torch.Tensor, ...]:
        """Observations, actions, advantages and returns of every step, flattened ``[M, ...]``."""
        parts: dict[str, list[np.ndarray]] = {"obs": [], "actions": [], "adv": [], "ret": []}
        for traj, rewards in zip(trajectories, self.learning_rewards(trajectories)):
            x = traj.arrays
            T, N = rewards.shape
            adv, ret = gae(
                rewards, x["values"], terminal(x), x["truncated"], x["next_value"], truncation_bootstrap(x),
                gamma=self.algo.gamma, gae_lambda=self.settings.gae_lambda,
            )  # fmt: skip
            parts["obs"].append(x["obs"].reshape(T * N, *x["obs"].shape[2:]))
            parts["actions"].append(x["actions"].reshape(T * N, *x["actions"].shape[2:]))
            parts["adv"].append(adv.numpy().reshape(-1))
            parts["ret"].append(ret.numpy().reshape(-1))
        obs, actions, adv, ret = (np.concatenate(parts[k]) for k in ("obs", "actions", "adv", "ret"))
        return self.tensor(self.normalize(obs)), self.tensor(actions), self.tensor(adv), self.tensor(ret)


ALGORITHM = AlgorithmSpec(
    name="a2c",
    settings=A2CSettings,
    schedules=("sync",),  # on-policy without a correction for stale data
    learner=A2CLearner,
    acting_model=actor_critic_model,  # zddrl's actor-critic networks (model.kind), or one of the user's own
    acting_policy=acting_policy,
    figures=ACTOR_CRITIC_FIGURES[:3],  # policy_loss, value_loss, entropy (grad_norm, lr, batch_steps: every core's)
    check=check_actor_critic,
)
