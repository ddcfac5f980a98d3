"""Soft actor-critic's learner core (Haarnoja et al. 2018, arXiv:1801.01290 and 1812.05905) on a replay buffer.

Per gradient step on a sampled batch ``(s, a, G, gamma^k, s')`` (``a`` scaled to ``[-1, 1]`` from the env's
bounds; actors send the actions they executed)::

    y      = G + gamma^k (min_j Q'_j(s', a') - alpha log pi(a'|s')),   a' ~ pi(.|s')
    L_Q    = 1/2 sum_j mean_i w_i (Q_j(s, a) - y)^2                      (twin critics, one optimizer)
    L_pi   = mean_i (alpha log pi(a~|s) - min_j Q_j(s, a~)),           a~ ~ pi(.|s) (reparameterised)
    L_alpha = -mean_i log alpha (log pi(a~|s) + target_entropy),       target_entropy = -action_dim

and the target critics follow by Polyak averaging (``algo.tau``). With ``replay.n_step`` > 1 the n-step return
leaves out the entropy bonus of the intermediate steps (1, the paper's, is what the examples use). The policy
(``SquashedGaussian``) is what travels to the actors; critics and temperature stay here. No sockets here.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import torch

from zddrl.algos.checks import spec_refusal
from zddrl.algos.offpolicy_nets import TwinQ
from zddrl.algos.optim import Adam
from zddrl.algos.replay_buffer.prioritized import TransitionBatch
from zddrl.algos.replay_learner import ReplayLearner
from zddrl.config import Config, ModelConfig
from zddrl.envs import EnvSpec
from zddrl.shards.group import ShardGroup


def twin_critics(spec: EnvSpec, model: ModelConfig) -> torch.nn.Module:
    """SAC's MLP critics, or the user's when the network factory builds critics too (``custom_model``)."""
    if model.is_custom:
        from zddrl.algos.custom_model import CustomTwinQ, takes_critic

        if takes_critic(model):
            return CustomTwinQ(spec, model)
    return TwinQ(spec, model)


class SACLearner(ReplayLearner):
    def __init__(self, config: Config, spec: EnvSpec, group: ShardGroup | None = None) -> None:
        why = spec_refusal(config, spec)
        if why:
            raise ValueError(why)
        super().__init__(config, spec, group)
        a = config.algo
        self.critic = twin_critics(spec, config.model).to(self.device)
        self.group.sync_module(self.critic.parameters())
        self.critic_target = copy.deepcopy(self.critic).requires_grad_(False)
        self.critic_optimizer = Adam(self.critic.parameters(), lr=a.lr)
        s = self.settings
        self.log_alpha = torch.tensor(
            [math.log(s.init_temperature)], device=self.device, requires_grad=s.autotune_temperature
        )
        self.alpha_optimizer = Adam([self.log_alpha], lr=a.lr) if s.autotune_temperature else None
        self.target_entropy = -float(spec.action_dim)
        low, high = np.asarray(spec.action_low, np.float32), np.asarray(spec.action_high, np.float32)
        self.action_mid = self.tensor((high + low) / 2)
        self.action_half = self.tensor((high - low) / 2)

    def set_lr(self, staleness: float = 0.0) -> float:
        lr = super().set_lr(staleness)
        for optimizer in (self.critic_optimizer, self.alpha_optimizer):
            if optimizer is not None:
                optimizer.param_groups[0]["lr"] = lr
        return lr

    def train_step(self, batch: TransitionBatch | None) -> dict[str, float]:
        figures = self._learn(batch) if batch is not None else self._idle()
        with torch.no_grad():  # on every shard alike
            target: list[torch.Tensor] = list(self.critic_target.parameters())
            online: list[torch.Tensor] = list(self.critic.parameters())
            torch._foreach_lerp_(target, online, self.settings.tau)
        return figures

    def _idle(self) -> dict[str, float]:
        """A shard with nothing to sample takes part in the three gradient all-reduces."""
        self.step_optimizer(None, 0, self.critic_optimizer)
        self.step_optimizer(None, 0)
        if self.alpha_optimizer is not None:
            self.step_optimizer(None, 0, self.alpha_optimizer)
        return {}

    def _learn(self, batch: TransitionBatch) -> dict[str, float]:
        b = self.batch_tensors(batch)
        n = len(batch.ids)
        alpha = self.log_alpha.detach().exp()
        actions = (b["actions"] - self.action_mid) / self.action_half
        with torch.no_grad():
            next_a, next_logp = self.model.sample(b["next_obs"])
            q1_next, q2_next = self.critic_target(b["next_obs"], next_a)
            y = b["returns"] + b["discounts"] * (torch.minimum(q1_next, q2_next) - alpha * next_logp)
        q1, q2 = self.critic(b["obs"], actions)
        w = b["weights"]
        critic_loss = 0.5 * ((w * (q1 - y).pow(2)).mean() + (w * (q2 - y).pow(2)).mean())
        self.step_optimizer(critic_loss, n, self.critic_optimizer)
        self.update_priorities(batch, (q1 - y).detach())

        self.critic.requires_grad_(False)  # the policy's loss moves the policy only
        new_a, logp = self.model.sample(b["obs"])
        q1_pi, q2_pi = self.critic(b["obs"], new_a)
        self.critic.requires_grad_(True)
        actor_loss = (alpha * logp - torch.minimum(q1_pi, q2_pi)).mean()
        grad_norm = self.step_optimizer(actor_loss, n)
        figures = {
            "critic_loss": float(critic_loss.detach()),
            "actor_loss": float(actor_loss.detach()),
            "q_mean": float(q1.detach().mean()),
            "entropy": float(-logp.detach().mean()),
            "temperature": float(alpha),
            "is_weight_mean": float(w.mean()),
        }
        if self.alpha_optimizer is not None:
            alpha_loss = -(self.log_alpha * (logp.detach() + self.target_entropy)).mean()
            self.step_optimizer(alpha_loss, n, self.alpha_optimizer)
        if grad_norm is not None:
            figures["grad_norm"] = grad_norm
        return figures

    def greedy(self, obs: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            a = self.model.greedy(self.tensor(obs))
            return (self.action_mid + self.action_half * a).cpu().numpy()

    def state(self) -> dict:
        state = {
            **super().state(),
            "critic": self.critic.state_dict(),
            "critic_target": self.critic_target.state_dict(),
            "critic_optimizer": self.critic_optimizer.state_dict(),
            "log_alpha": self.log_alpha.detach().clone(),
        }
        if self.alpha_optimizer is not None:
            state["alpha_optimizer"] = self.alpha_optimizer.state_dict()
        return state

    def load_state(self, state: dict) -> None:
        super().load_state(state)
        self.critic.load_state_dict(state["critic"])
        self.critic_target.load_state_dict(state["critic_target"])
        self.critic_optimizer.load_state_dict(state["critic_optimizer"])
        with torch.no_grad():
            self.log_alpha.copy_(state["log_alpha"])
        if self.alpha_optimizer is not None and "alpha_optimizer" in state:
            self.alpha_optimizer.load_state_dict(state["alpha_optimizer"])
