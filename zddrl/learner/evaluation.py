"""The learner's own deterministic evaluations: the target of runs whose training returns cannot be one, and the
confirmation of those whose training returns are.

Training episodes of Ape-X mix every actor's exploration (an epsilon of 0.4 on some envs), so their returns
say little of the greedy policy; ``train.target_kind = "eval"`` compares ``train.until_return`` with the mean
return of ``train.eval_episodes`` deterministic episodes instead, run by the main learner shard every
``train.eval_every`` env steps with the current network (``LearnerCore.greedy``). Each evaluation runs one
episode per env, all envs side by side, on envs of their own seed stream (``env.seed + 1_000_000 + k``, never
an actor's), fresh each time.

Training returns are sums of the actors' rewards: one actor key could send any. So with ``target_kind = "train"``
a training return that reaches the target is confirmed by one such evaluation before the run stops
(``confirm``, off the ``eval_every`` schedule; ``ledger.Ledger``): the actors' numbers say when to look, the
learner's own episodes say whether the target is reached.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from zddrl.config import Config
from zddrl.envs import VecEnv, evaluation_factory

EVAL_SEED_OFFSET = 1_000_000
"""Evaluation envs are seeded from ``env.seed + EVAL_SEED_OFFSET`` on: no actor env has such a seed."""
EVAL_STEP_LIMIT = 100_000
"""Steps after which an evaluation stops episodes still running (counted with their return so far): an env without a
time limit must not hang the learner on a policy that never ends an episode (Atari's 108,000 frames at 4 a step are
27,000 steps)."""


class Evaluator:
    """``due(env_steps)`` says when; ``run(greedy)`` plays the episodes and returns their mean return."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.every = config.train.eval_every
        self.next_at = self.every
        self.runs = 0
        self.last_s = 0.0
        """Seconds the last evaluation took."""

    def due(self, env_steps: int) -> bool:
        return self.every > 0 and env_steps >= self.next_at

    def run(self, greedy: Callable[[np.ndarray], np.ndarray], env_steps: int) -> float:
        """The scheduled evaluation at ``env_steps``: its mean return; the next is due ``eval_every`` steps on."""
        mean = self.confirm(greedy)
        self.next_at = (env_steps // self.every + 1) * self.every
        return mean

    def confirm(self, greedy: Callable[[np.ndarray], np.ndarray]) -> float:
        """One evaluation now, off the schedule (a target's confirmation): its mean return."""
        t0 = time.monotonic()
        env, episodes = self.config.env, self.config.train.eval_episodes
        first = env.seed + EVAL_SEED_OFFSET + self.runs * episodes
        vec = VecEnv(evaluation_factory(env), list(range(first, first + episodes)))
        returns = np.zeros(episodes)
        done = np.zeros(episodes, dtype=bool)
        try:
            for _ in range(EVAL_STEP_LIMIT):
                if done.all():
                    break
                _, rewards, terminated, truncated, _ = vec.step(greedy(vec.obs))
                returns += np.where(done, 0.0, rewards)
                done |= terminated | truncated
        finally:
            vec.close()
        self.runs += 1
        self.last_s = time.monotonic() - t0
        return float(returns.mean())
