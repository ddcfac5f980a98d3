"""What a learner has seen of its run: env steps, episodes, returns, drops, the target. Survives resumes.

Env steps are counted from what actors report (each trajectory carries the actor's cumulative
``total_env_steps``), relative to the first report seen from that actor in this learner's life:
actor hosts outlive runs and learner restarts, so their totals include steps this run never saw.
Steps and wall time of earlier incarnations of the run (before a resume) are carried as offsets.
"""

from __future__ import annotations

import math
from collections import defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

RETURN_WINDOW = 20


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
    actor_steps: dict[str, int] = field(default_factory=dict)
    actor_streams: dict[str, list] = field(default_factory=dict)
    """Per actor: [incarnation, lowest total before a message, highest total, steps of earlier incarnations]."""
    dropped_late: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    dropped_stale: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    dropped_invalid: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    """Per actor: trajectories that did not fit the run (algos.rollout.mismatch), never trained on."""
    target: dict[str, Any] = field(default_factory=dict)
    """``wall_s_to_target``, ``env_steps_to_target`` and ``return_at_target`` once the target return was reached."""

    def count_steps(self, peer_id: str, reported_total: Any, env_steps: int, incarnation: Any = None) -> None:
        """Count an actor's steps from the cumulative totals it reports, in any arrival order.

        The steps of one actor process (``incarnation``) are its highest total minus its lowest
        total before a message: a message arriving after a later one (learner shards each take their
        own share of an actor's stream) changes nothing, nor does a resend. A new incarnation (the
        process restarted with the same id) starts a new stream on top of what was counted.
        Without an incarnation, a total lower than the highest seen is taken as a restart.
        """
        if not isinstance(reported_total, int):  # a client that does not report totals: add up
            self.actor_steps[peer_id] = self.actor_steps.get(peer_id, 0) + env_steps
            return
        stream = self.actor_streams.get(peer_id)
        restarted = stream is not None and (
            stream[0] != incarnation if incarnation is not None else reported_total < stream[2]
        )
        if stream is None or restarted:
            carried = self.actor_steps.get(peer_id, 0)
            stream = self.actor_streams[peer_id] = [incarnation, reported_total - env_steps, reported_total, carried]
        stream[1] = min(stream[1], reported_total - env_steps)
        stream[2] = max(stream[2], reported_total)
        self.actor_steps[peer_id] = stream[3] + stream[2] - stream[1]

    def add_episodes(self, returns: Sequence[float]) -> None:
        for r in returns:
            self.returns.append(float(r))
        self.episodes += len(returns)

    def env_steps(self) -> int:
        return self.steps_before + sum(self.actor_steps.values())

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
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Progress:
        p = cls(
            episodes=int(state["episodes"]),
            updates=int(state["updates"]),
            steps_before=int(state["env_steps"]),
            wall_before=float(state["wall_s"]),
            target=dict(state["target"]),
        )
        p.returns.extend(float(r) for r in state["returns"])
        p.dropped_late.update(state["dropped_late"])
        p.dropped_stale.update(state["dropped_stale"])
        p.dropped_invalid.update(state.get("dropped_invalid", {}))  # checkpoints of zddrl before 0.3 lack it
        return p
