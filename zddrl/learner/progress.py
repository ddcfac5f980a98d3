"""What a learner has seen of its run: env steps, episodes, returns, drops, the target. Survives resumes.

Env steps are the ``T * N`` of every received rollout that the run could train on (trained on or dropped as
late or stale: those steps were sampled all the same), read from its arrays; the actor's own cumulative
``total_env_steps`` is not believed (one message claiming 1e15 would end the run). Episode returns are the
learner's own sums of the rewards it verified (``intake/episodes.py``), never the actor's. Steps and wall time of
earlier incarnations of the run (before a resume) are carried as offsets.
"""

from __future__ import annotations

import math
from collections import defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

RETURN_WINDOW = 20
PROGRESS_LINE_EVERY_S = 5.0
"""How often a learner logs its progress line (the same period as `zddrl train`'s when not on a terminal)."""


def progress_line(elapsed_s: float, env_steps: int, sps: float, return_mean: float, version: int | str) -> str:
    """The one line a run's progress is shown in: `zddrl train` prints it from metrics.csv, a learner logs it.
    ``return_mean``: NaN before RETURN_WINDOW episodes have finished (shown as "-")."""
    ret = "-" if math.isnan(return_mean) else f"{return_mean:.6g}"  # .6g: as metrics.csv writes it
    return f"[{elapsed_s:6.1f} s] steps {env_steps:>9,}  sps {sps:>7.0f}  return {ret:>7}  version {version}"


@dataclass
class Progress:
    returns: deque = field(default_factory=lambda: deque(maxlen=RETURN_WINDOW))
    """Returns of the last RETURN_WINDOW finished training episodes."""
    episodes: int = 0
    updates: int = 0
    steps_before: int = 0
    """Env steps of earlier incarnations of this run (resume)."""
    wall_before: float = 0.0
    """Wall seconds of earlier incarnations of this run (resume)."""
    steps: int = 0
    """Env steps of the rollouts this incarnation received that the run could train on."""
    dropped_late: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    dropped_stale: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    dropped_invalid: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    """Per actor: trajectories that did not fit the run (algos.rollout.mismatch), never trained on."""
    eval_return: float = math.nan
    """Mean return of the newest deterministic evaluation (``evaluation.py``); NaN before the first."""
    target: dict[str, Any] = field(default_factory=dict)
    """``wall_s_to_target``, ``env_steps_to_target`` and ``return_at_target`` once the target return was reached."""

    def count_steps(self, env_steps: int) -> None:
        """Count the ``T * N`` steps of one received rollout that the run could train on."""
        self.steps += env_steps

    def add_episodes(self, returns: Sequence[float]) -> None:
        for r in returns:
            self.returns.append(float(r))
        self.episodes += len(returns)

    def env_steps(self) -> int:
        return self.steps_before + self.steps

    def return_mean(self) -> float:
        return float(np.mean(self.returns)) if len(self.returns) >= RETURN_WINDOW else math.nan

    def state(self, wall_s: float) -> dict[str, Any]:
        """Plain values for a checkpoint (loadable with ``torch.load(weights_only=True)``)."""
        return {
            "returns": list(self.returns),
            "episodes": self.episodes,
            "updates": self.updates,
            "env_steps": self.env_steps(),
            "wall_s": wall_s,
            "dropped_late": dict(self.dropped_late),
            "dropped_stale": dict(self.dropped_stale),
            "dropped_invalid": dict(self.dropped_invalid),
            "target": dict(self.target),
            "eval_return": self.eval_return,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Progress:
        p = cls(
            episodes=int(state["episodes"]),
            updates=int(state["updates"]),
            steps_before=int(state["env_steps"]),
            wall_before=float(state["wall_s"]),
            target=dict(state["target"]),
            eval_return=float(state.get("eval_return", math.nan)),
        )
        p.returns.extend(float(r) for r in state["returns"])
        p.dropped_late.update(state["dropped_late"])
        p.dropped_stale.update(state["dropped_stale"])
        p.dropped_invalid.update(state.get("dropped_invalid", {}))  # checkpoints of zddrl before 0.3 lack it
        return p
