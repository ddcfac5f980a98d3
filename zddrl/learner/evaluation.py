"""The learner's own deterministic evaluations: the target of runs whose training returns cannot be one.

Training episodes of Ape-X mix every actor's exploration (an epsilon of 0.4 on some envs), so their returns
say little of the greedy policy; ``train.target_kind = "eval"`` compares ``train.until_return`` with the mean
return of ``train.eval_episodes`` deterministic episodes instead, run by the main learner shard every
``train.eval_every`` env steps with the current network (``LearnerCore.greedy``). Each evaluation runs one
episode per env, all envs side by side, on envs of their own seed stream (``env.seed + 1_000_000 + k``, never
an actor's), fresh each time.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from zddrl.config import Config
from zddrl.envs import VecEnv, evaluation_factory

EVAL_SEED_OFFSET = 1_000_000
"""Evaluation envs are seeded from ``env.seed + EVAL_SEED_OFFSET`` on: no actor env has such a seed."""


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
        t0 = time.monotonic()
        env, episodes = self.config.env, self.config.train.eval_episodes
        first = env.seed + EVAL_SEED_OFFSET + self.runs * episodes
        vec = VecEnv(evaluation_factory(env), list(range(first, first + episodes)))
        returns = np.zeros(episodes)
        done = np.zeros(episodes, dtype=bool)
        try:
            while not done.all():
                _, rewards, terminated, truncated, _ = vec.step(greedy(vec.obs))
                returns += np.where(done, 0.0, rewards)
                done |= terminated | truncated
        finally:
            vec.close()
        self.runs += 1
        self.next_at = (env_steps // self.every + 1) * self.every
        self.last_s = time.monotonic() - t0
        return float(returns.mean())
