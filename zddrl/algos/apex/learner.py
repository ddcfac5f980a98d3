"""Ape-X DQN's learner core: dueling double Q-learning on n-step returns from a prioritized replay buffer.

Horgan et al. 2018 (arXiv:1803.00933) on Wang et al. 2016 (dueling), van Hasselt et al. 2016 (double Q) and
Schaul et al. 2016 (prioritized replay). For a sampled transition ``(s_t, a_t, G_t, gamma^k, s_{t+k})``::

    y = G_t + gamma^k Q_target(s_{t+k}, argmax_a Q(s_{t+k}, a))      (gamma^k = 0 after a termination)
    loss = mean_i w_i huber(Q(s_t, a_t) - y)                         (w: the importance weights)

and the new priority of the transition is ``|Q(s_t, a_t) - y|``. The target network is a copy of the online one,
refreshed every ``algo.target_update_every`` gradient steps. Actors explore with a fixed epsilon of their own
and send the TD errors of what they sampled, computed with their copy of the network (``actor_td``, declared in
the spec): the initial priorities (``ReplayLearner.initial_td``), capped at the largest priority the buffer has
seen, so that a number off the wire may not buy its transition more replay. No sockets here.
"""

from __future__ import annotations

import copy

import numpy as np
import torch
import torch.nn.functional as F

from zddrl.algos.replay_buffer.prioritized import TransitionBatch
from zddrl.algos.replay_learner import ReplayLearner
from zddrl.config import Config
from zddrl.envs import EnvSpec
from zddrl.shards.group import ShardGroup


class ApexLearner(ReplayLearner):
    def __init__(self, config: Config, spec: EnvSpec, group: ShardGroup | None = None) -> None:
        super().__init__(config, spec, group)
        self.target = copy.deepcopy(self.model).requires_grad_(False)

    def train_step(self, batch: TransitionBatch | None) -> dict[str, float]:
        if batch is None:
            self.step_optimizer(None, 0)
            figures: dict[str, float] = {}
        else:
            figures = self._learn(batch)
        if (self.grad_steps + 1) % self.settings.target_update_every == 0:  # on every shard alike
            self.target.load_state_dict(self.model.state_dict())
        return figures

    def _learn(self, batch: TransitionBatch) -> dict[str, float]:
        b = self.batch_tensors(batch)
        n = len(batch.ids)
        # One online pass over s and s' (half the calls at small batches; the rows of s' get no gradient).
        q_all = self.model(torch.cat([b["obs"], b["next_obs"]]))
        with torch.no_grad():
            best = q_all[n:].argmax(dim=1, keepdim=True)
            boot = self.target(b["next_obs"]).gather(1, best).squeeze(1)
            y = b["returns"] + b["discounts"] * boot
        q = q_all[:n].gather(1, b["actions"].long().unsqueeze(1)).squeeze(1)
        td = q - y
        loss = (b["weights"] * F.smooth_l1_loss(q, y, reduction="none")).mean()
        grad_norm = self.step_optimizer(loss, n)
        self.update_priorities(batch, td)
        figures = {
            "loss": float(loss.detach()),
            "q_mean": float(q.detach().mean()),
            "td_abs_mean": float(td.detach().abs().mean()),
            "is_weight_mean": float(b["weights"].mean()),
        }
        if grad_norm is not None:
            figures["grad_norm"] = grad_norm
        return figures

    def greedy(self, obs: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return self.model(self.tensor(obs)).argmax(dim=1).cpu().numpy()

    def state(self) -> dict:
        return {**super().state(), "target": self.target.state_dict()}

    def load_state(self, state: dict) -> None:
        super().load_state(state)
        self.target.load_state_dict(state["target"])
