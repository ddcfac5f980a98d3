"""PPO with a KL penalty instead of the clipped ratio (Schulman et al. 2017, section 4, fixed coefficient): an
algorithm that needs an array of its own.

The penalty ``KL(behaviour || current)`` needs the whole distribution the actors sampled from, not only the
log-probability of the action taken: each step the actors record their policy's logits (``behaviour_logits``,
``float32 [T, N, n]`` for ``n`` actions), declared in the spec below (``DeclaredArray``). The learner's hello tells
the brokers, which check every trajectory against the declaration; the actors fill it from their policy's
``ActOutput.extras``. Each batch takes ``epochs`` full-batch steps on
``-ratio * advantage + vf_coef * value_loss + kl_coef * KL``. Nothing under zddrl/ names this file or its array
(docs/extending.md, "Declared arrays").

Run it with `zddrl train examples/plugins/ppo_kl_cartpole.toml`; a host that joins from the network imports it
only if it allows it: ``zddrl actor --allow-code ppo_kl:ALGORITHM``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from zddrl import gae
from zddrl.algos.actor_critic import ACTOR_CRITIC_FIGURES, actor_critic_model
from zddrl.algos.core import LearnerCore
from zddrl.algos.policy import ActOutput, sample
from zddrl.algos.rollout import Rollout, terminal, truncations
from zddrl.algos.spec import ActingVersion, AlgorithmSpec, DeclaredArray, Figure
from zddrl.algos.torch_policy import TorchForward
from zddrl.config import Config
from zddrl.envs import EnvSpec

LOGITS = "behaviour_logits"


@dataclass(frozen=True)
class PPOKLSettings:
    """Its own ``[algo]`` keys."""

    epochs: int = 4
    """Full-batch gradient steps per batch."""
    gae_lambda: float = 0.95
    vf_coef: float = 0.5
    ent_coef: float = 0.0
    kl_coef: float = 1.0
    """Weight of ``KL(behaviour || current)``, averaged over the batch's steps."""


def _arrays(config: Config, env: EnvSpec) -> tuple[DeclaredArray, ...]:
    """One row of logits per step and env: its shape is the env's number of actions."""
    return (DeclaredArray(LOGITS, "float32", (env.action_dim,)),)


class LogitsPolicy:
    """The actor-critic network in torch on the actors, sampling as zddrl's own policies do (``sample``), with the
    logits it sampled from as this step's declared row."""

    def __init__(self, v: ActingVersion) -> None:
        self.net = TorchForward(actor_critic_model(v.config, v.env), v.flat, v.layout)
        self.outputs = v.env.action_dim

    def value(self, obs: np.ndarray) -> np.ndarray:
        return self.net(obs.astype(np.float32))[1]

    def act(self, obs: np.ndarray, rng: np.random.Generator, deterministic: bool = False) -> ActOutput:
        logits, values = self.net(obs.astype(np.float32))
        out = sample(logits, values, np.zeros(0, np.float32), rng, deterministic)
        return out._replace(extras={LOGITS: logits})


class PPOKLLearner(LearnerCore):
    def update(self, trajectories: Sequence[Rollout], staleness: float = 0.0) -> dict[str, float]:
        s = self.settings
        lr = self.set_lr(staleness)
        obs, actions, adv, ret, behaviour = self._batch(trajectories)
        old = torch.log_softmax(behaviour, dim=1)
        old_logp = old.gather(1, actions.long().unsqueeze(1)).squeeze(1)
        if len(adv) > 1:
            adv = (adv - adv.mean()) / (adv.std() + 1e-8)
        for _ in range(s.epochs):  # every shard takes the same number of steps (empty batches join the collectives)
            logits, values = self.model(obs)
            log_probs = torch.log_softmax(logits, dim=1)
            logp = log_probs.gather(1, actions.long().unsqueeze(1)).squeeze(1)
            entropy = -(log_probs.exp() * log_probs).sum(dim=1)
            kl = (old.exp() * (old - log_probs)).sum(dim=1)  # KL(behaviour || current) per step
            policy_loss = -(torch.exp(logp - old_logp) * adv).mean()
            value_loss = 0.5 * ((ret - values) ** 2).mean()
            loss = policy_loss + s.vf_coef * value_loss - s.ent_coef * entropy.mean() + s.kl_coef * kl.mean()
            grad_norm = self.step_optimizer(loss if len(obs) else None, len(obs))
        total = int(self.group.sum(len(obs))[0])
        self.steps_trained += total
        return {
            "policy_loss": float(policy_loss),
            "value_loss": float(value_loss),
            "entropy": float(entropy.mean()),
            "kl": float(kl.mean()),
            "grad_norm": grad_norm or 0.0,
            "lr": lr,
            "batch_steps": total,
        }

    def _batch(self, trajectories: Sequence[Rollout]) -> tuple[torch.Tensor, ...]:
        """Observations, actions, advantages, returns and behaviour logits of every step, flattened ``[M, ...]``."""
        parts: dict[str, list[np.ndarray]] = {"obs": [], "actions": [], "adv": [], "ret": [], "logits": []}
        for traj, rewards in zip(trajectories, self.learning_rewards(trajectories)):
            x = traj.arrays
            T, N = rewards.shape
            trunc_idx, _, trunc_values = truncations(x)
            trunc_value = np.zeros((T, N), np.float32)
            trunc_value.reshape(-1)[trunc_idx] = trunc_values
            adv, ret = gae(
                rewards, x["values"], terminal(x), x["truncated"], x["next_value"], trunc_value,
                gamma=self.algo.gamma, gae_lambda=self.settings.gae_lambda,
            )  # fmt: skip
            parts["obs"].append(x["obs"].reshape(T * N, *x["obs"].shape[2:]))
            parts["actions"].append(x["actions"].reshape(-1))
            parts["adv"].append(adv.numpy().reshape(-1))
            parts["ret"].append(ret.numpy().reshape(-1))
            parts["logits"].append(x[LOGITS].reshape(T * N, -1))  # [T, N, n], checked against the declaration
        obs, actions, adv, ret, logits = (np.concatenate(parts[k]) for k in ("obs", "actions", "adv", "ret", "logits"))
        return tuple(self.tensor(a) for a in (obs, actions, adv, ret, logits))


def _check(config: Config, env: EnvSpec) -> str:
    if not env.discrete:
        return "ppo_kl needs a Discrete action space (its actors record logits)"
    if config.algo.normalize_obs or config.model.is_custom or config.model.kind != "mlp":
        return "ppo_kl runs the built-in MLP on raw observations (model.kind 'mlp', algo.normalize_obs false)"
    return ""


ALGORITHM = AlgorithmSpec(
    name="ppo_kl",
    settings=PPOKLSettings,
    schedules=("sync",),
    learner=PPOKLLearner,
    acting_model=actor_critic_model,
    acting_policy=LogitsPolicy,
    figures=(*ACTOR_CRITIC_FIGURES[:3], Figure("kl")),
    check=_check,
    arrays=_arrays,
)
