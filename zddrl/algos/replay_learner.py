"""What the replay algorithms (apex, sac) share: intake into the buffer and the gradient steps the replay ratio owes.

An update takes in the batch's rollouts (``replay_buffer.prioritized.PrioritizedReplay.insert_arrays``: n-step
returns, the policy version that acted, the actor's initial priorities where it sends them), then takes
``replay.replay_ratio`` gradient steps per env step taken in, once the buffer (all shards) holds
``replay.learning_starts`` transitions. Fractions carry over to the next update, so over a run the ratio holds
exactly. The learner reads no more data before it has taken them: that throttles intake, and the credit
window makes the actors wait (docs/configuration.md, ``[replay]``).

Shards: each keeps its own buffer of the data the broker routed to it; all take the same number of gradient
steps (the owed count is computed from the steps of every shard), each on a batch of its own, with the
gradients averaged (``LearnerCore.step_optimizer``).

``replay.placement = "service"``: the buffer is not here but in ``zddrl replay`` processes, which take the
trajectories in; the learner node attaches a ``ReplaySource`` (``zddrl/replay/client.py``) that samples from
them, and an update takes the steps owed for the env steps they took in since the last one (the main shard's
count: every shard sees the same replays). No sockets here.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import torch

from zddrl.algos.core import LearnerCore
from zddrl.algos.replay_buffer.prioritized import PrioritizedReplay, TransitionBatch
from zddrl.algos.rollout import Rollout
from zddrl.algos.spec import algorithm_of
from zddrl.config import Config
from zddrl.envs import EnvSpec
from zddrl.shards.group import ShardGroup

REPLAY_FIGURES = ("replay_size", "replay_fill", "replay_bytes", "grad_steps_total")
"""Figures of the buffer that `zddrl status` shows next to the learner's (besides the metrics row)."""


class ReplaySource(Protocol):
    """What the gradient steps need of a buffer: ``PrioritizedReplay``, or a learner's link to replay services."""

    @property
    def max_priority(self) -> float: ...
    @property
    def stale_updates(self) -> int: ...
    @property
    def dropped_by_version(self) -> int: ...
    def __len__(self) -> int: ...
    @property
    def beta(self) -> float: ...
    @property
    def fill(self) -> float: ...
    @property
    def nbytes(self) -> int: ...
    def sample(self, batch: int) -> TransitionBatch | None: ...
    def update_priorities(self, ids: np.ndarray, td_errors: np.ndarray) -> int: ...
    def drop_older_than(self, version: int) -> int: ...
    def td_cap(self) -> float: ...


class RemoteIntake(ReplaySource, Protocol):
    """A replay service placement's source also says what the replays took in since it was last asked."""

    def intake(self) -> tuple[int, int]:
        """``(env steps, newest policy version)`` taken in by the replays since the last call."""
        ...


class ReplayLearner(LearnerCore):
    """``update(trajectories)``: insert, then the owed gradient steps (``train_step`` of the subclass)."""

    def __init__(self, config: Config, spec: EnvSpec, group: ShardGroup | None = None) -> None:
        super().__init__(config, spec, group)
        rc = config.replay
        self.remote: RemoteIntake | None = None
        """The replay services' source (``attach``), with ``replay.placement = "service"``."""
        self.owed = 0.0
        """Gradient steps owed by the replay ratio and not taken yet (a fraction below 1 once paid)."""
        self.grad_steps = 0
        self.nonfinite_td = 0
        self.replay: PrioritizedReplay | None = None
        """The local buffer (``placement = "learner"``); None with the service placement."""
        feed = algorithm_of(config).replay
        self.priorities = feed.priorities if feed is not None else ""
        """The declared array of the actors' TD errors (``ReplayFeed.priorities``), or ""."""
        if rc.placement == "service":
            return
        self.replay = buffer_for(config, spec, config.env.seed * 7919 + self.group.rank)

    @property
    def source(self) -> ReplaySource:
        """Where batches come from: the local buffer or the attached replay services."""
        source = self.replay if self.replay is not None else self.remote
        if source is None:
            raise RuntimeError("the service placement's learner has no replay source attached")
        return source

    def attach(self, remote: RemoteIntake) -> None:
        """The service placement's source (the learner node's link to the replay services)."""
        self.remote = remote

    def refusal(self, arrays: Any) -> str:
        """Why a checked rollout cannot go into this buffer, or "": its block must fit the ring
        (``replay_buffer/prioritized.py``)."""
        why = super().refusal(arrays)
        return why or (block_refusal(arrays, self.replay.capacity) if self.replay is not None else "")

    def initial_td(self, arrays: Any) -> np.ndarray | None:
        """The TD errors that set new transitions' priorities: the declared array the spec's ``ReplayFeed`` names,
        capped at the largest priority seen (a number off the wire may not buy more replay); None: that largest
        priority."""
        td = arrays.get(self.priorities) if self.priorities else None
        return None if td is None or self.replay is None else self.replay.capped_td(td)

    def train_step(self, batch: TransitionBatch | None) -> dict[str, float]:  # pragma: no cover - interface
        """One gradient step on ``batch`` (None: this shard has nothing to sample; it joins the collectives)."""
        raise NotImplementedError

    def update(self, trajectories: Sequence[Rollout], staleness: float = 0.0) -> dict[str, float]:
        rc = self.config.replay
        steps, newest = 0, -1
        if self.remote is not None:  # the replays took the data in: count what they report
            steps, newest = self.remote.intake()
        for traj in trajectories:
            assert self.replay is not None, "the service placement's learner receives no trajectories"
            self.replay.insert_arrays(traj.arrays, traj.policy_version, self.initial_td(traj.arrays))
            steps += int(traj.arrays["rewards"].size)
            newest = max(newest, traj.policy_version)
        source = self.source
        total, held, newest_all = self._agreed(steps, len(source), newest)
        if rc.max_version_age and newest_all >= 0:
            source.drop_older_than(int(newest_all) - rc.max_version_age)
        self.steps_trained += int(total)
        lr = self.set_lr(staleness)
        if held < rc.learning_starts:
            owed = 0
        else:
            self.owed += rc.replay_ratio * total
            owed = int(self.owed)
            self.owed -= owed
        sums: dict[str, float] = defaultdict(float)
        for _ in range(owed):
            batch = source.sample(rc.batch_size) if len(source) else None
            for name, value in self.train_step(batch).items():
                sums[name] += value
            self.grad_steps += 1
        figures = {name: value / owed for name, value in sums.items()}
        figures.update(
            batch_steps=steps,
            grad_steps=owed,
            grad_steps_total=self.grad_steps,
            lr=lr,
            beta=source.beta,
            replay_size=len(source),
            replay_fill=round(source.fill, 4),
            replay_bytes=source.nbytes,
            replay_stale_updates=source.stale_updates,
            replay_dropped_by_version=source.dropped_by_version,
            nonfinite_td=self.nonfinite_td,
        )
        return figures

    def _agreed(self, steps: int, held: int, newest: int) -> tuple[int, int, int]:
        """Env steps taken in and transitions held by all shards, and the newest version any shard saw."""
        if not self.group.sharded:
            return steps, held, newest
        parts = self.group.exchange([steps, held, newest])
        if self.remote is not None:  # every shard asks the same replays: the main shard's count is the run's
            return parts[0][0], parts[0][1], parts[0][2]
        return sum(p[0] for p in parts), sum(p[1] for p in parts), max(p[2] for p in parts)

    def batch_tensors(self, batch: TransitionBatch) -> dict[str, torch.Tensor]:
        """A sampled batch on this shard's device."""
        return {
            "obs": self.tensor(batch.obs),
            "next_obs": self.tensor(batch.next_obs),
            "actions": self.tensor(batch.actions),
            "returns": self.tensor(batch.returns),
            "discounts": self.tensor(batch.discounts),
            "weights": self.tensor(batch.weights),
        }

    def update_priorities(self, batch: TransitionBatch, td: torch.Tensor) -> None:
        """New priorities ``|td|``; a non-finite TD error (a diverging network, an absurd reward) gets the largest
        priority the buffer allows instead of ending the run, and is counted."""
        if self.config.replay.alpha == 0:
            return
        errors = td.detach().abs().cpu().numpy()
        bad = ~np.isfinite(errors)
        if bad.any():
            self.nonfinite_td += int(bad.sum())
            errors = np.where(bad, self.td_cap(), errors)
            self._ratelog.warning(
                "nonfinite_td", f"{self.nonfinite_td} non-finite TD errors so far (given the top priority)"
            )
        self.source.update_priorities(batch.ids, errors)

    def td_cap(self) -> float:
        """The TD error whose priority is the largest seen so far: the most a transition may be given."""
        return self.source.td_cap()

    def state(self) -> dict:
        state = {**super().state(), "replay_owed": self.owed, "grad_steps": self.grad_steps}
        if self.config.train.checkpoint_replay and self.replay is not None:  # a replay service keeps its own
            state["replay"] = {
                k: torch.from_numpy(np.ascontiguousarray(v)) if isinstance(v, np.ndarray) else v
                for k, v in self.replay.state_dict().items()
            }
        return state

    def load_state(self, state: dict) -> None:
        super().load_state(state)
        self.owed = float(state.get("replay_owed", 0.0))
        self.grad_steps = int(state.get("grad_steps", 0))
        if self.replay is None:
            return
        if "replay" in state and self.group.is_main:
            self.replay.load_state_dict(state["replay"])  # the main shard's buffer: the others start afresh
        else:
            self.replay.rng = np.random.default_rng([self.config.env.seed, self.group.rank, self.steps_trained])


def buffer_for(config: Config, spec: EnvSpec, seed: int) -> PrioritizedReplay:
    """The buffer of ``config``'s run in either placement: ``replay.capacity`` transitions, stored in the env's
    dtypes (uint8 frames stay uint8; the networks scale them)."""
    rc = config.replay
    return PrioritizedReplay(
        rc.capacity,
        spec.obs_shape,
        np.dtype(spec.obs_dtype),
        () if spec.discrete else (spec.action_dim,),
        np.int64 if spec.discrete else np.float32,
        alpha=rc.alpha,
        beta0=rc.beta,
        beta_steps=rc.beta_steps,
        gamma=config.algo.gamma,
        n_step=rc.n_step,
        seed=seed,
        memory_fraction=rc.memory_fraction,
    )


def block_refusal(arrays: Any, capacity: int) -> str:
    """Why a checked rollout's block cannot go into a ring of ``capacity`` slots (``replay_buffer/prioritized.py``),
    or ""."""
    T, N = arrays["rewards"].shape
    block = (T + 1) * N + (len(arrays["trunc_idx"]) if "trunc_idx" in arrays else 0)
    if block > capacity:
        return f"a rollout of {block} replay slots ((T + 1) N + K), the buffer holds {capacity}"
    return ""
