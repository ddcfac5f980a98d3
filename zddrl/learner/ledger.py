"""The main learner shard's record of a run: counting, drops, actor lag, the metrics row and the summary.

Only the main shard (rank 0) keeps one; the records of what the other shards received reach it through
the shards' exchange (``intake/records.py``). Every received trajectory the run could train on counts toward env steps
(its ``T * N``) and episode returns (summed from its rewards, ``intake/episodes.py``), trained on or not; every refused
one is counted per actor, breaks that actor's episode streams, and is logged with its reason (aggregated: one
line per ``logs.LOG_EVERY_S`` with a count). Late and stale drops are logged the first, then every 100th time
per actor.

The target (``train.until_return``) is the learner's to declare. With ``target_kind = "eval"`` it compares its own
evaluations. With ``"train"`` the training return (the last 20 episodes, sums of the actors' rewards) says when
to look, and the learner's own evaluation confirms (``train.confirm_target``, on by default): the run stops only
if ``train.eval_episodes`` deterministic episodes with the current network, played by the learner on its own envs,
reach the target too. One actor's rewards can then hold the training return at 1e5 forever without ending the run.
A confirmation that fails is retried while the training return stays at the target, after a wait that keeps
confirmations under ``CONFIRM_SHARE`` of the learner's time, and logged (aggregated).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from zddrl.config import Config
from zddrl.intake.episodes import Episodes
from zddrl.intake.records import Record
from zddrl.learner.progress import Progress
from zddrl.logs import RateLimitedLog

LAG_WINDOW = 20
"""Updates over which a steadily growing median actor lag raises a warning."""
LAG_KEPT = 4096
"""Actors whose lag is remembered (the least recently heard-from forgotten first): one entry per peer id ever seen
would grow without bound in a long run with churning actors."""
CONFIRM_SHARE = 0.1
"""Most of the learner's time that confirming a target may take: after a confirmation of ``s`` seconds that failed,
the next waits ``(1 / CONFIRM_SHARE - 1) x s`` (a CartPole one takes well under a second)."""
HASHES_KEPT = 256
"""Published versions whose parameter hash is remembered for the actors' hash check. Bounded: a multi-day
run publishes millions of versions; data older than this many versions is stale in every mode."""


def _tally(drops: dict[str, int], peer_id: str) -> int:
    """Count one more drop of ``peer_id``'s data; its count when this drop is worth a log line (the first,
    then every 100th), else 0."""
    drops[peer_id] += 1
    n = drops[peer_id]
    return n if n == 1 or n % 100 == 0 else 0


class Ledger:
    """``published`` per version, ``account`` or ``drop_*`` per received trajectory, ``row`` per update."""

    def __init__(
        self,
        config: Config,
        log: Any,
        t0: float,
        world_size: int = 1,
        progress: Progress | None = None,
        confirm: Callable[[], float] | None = None,
    ) -> None:
        self.config = config
        self.confirm = confirm
        """Plays the learner's own evaluation now, its mean return: what confirms a training return's target. None:
        nothing can (with ``train.confirm_target`` a training return then never ends the run)."""
        self.next_confirm = 0.0
        """Monotonic time before which no confirmation is tried again (``CONFIRM_SHARE``)."""
        self.log = log
        self.t0 = t0
        self.progress = progress or Progress()
        self.lag: dict[str, int] = {}
        """Per actor: staleness of its newest trajectory (learner version - its version)."""
        self.lag_medians: deque[float] = deque(maxlen=LAG_WINDOW)
        self.hashes: dict[int, str] = {}
        """Parameter hash of each of the newest HASHES_KEPT published versions."""
        self.shard_trajectories = [0] * world_size
        """Trajectories each shard received: how the broker spread the stream."""
        self.last_row: dict[str, Any] = {}
        self.first_s: dict[str, float] = {}
        """Seconds from ``t0`` (the command's start) to this incarnation's first trajectory and first update."""
        self.episodes = Episodes()
        self._ratelog = RateLimitedLog()

    def published(self, version: int, param_hash: str) -> None:
        self.hashes[version] = param_hash
        while len(self.hashes) > HASHES_KEPT:
            del self.hashes[next(iter(self.hashes))]  # insertion order: the oldest version first

    def received(self, per_shard: list[int]) -> None:
        for shard, n in enumerate(per_shard):
            self.shard_trajectories[shard] += n

    def account(self, r: Record, version: int) -> None:
        """A trajectory received by any shard: its steps, episodes and lag; its parameter hash checked."""
        self.first_s.setdefault("wall_s_first_trajectory", round(time.time() - self.t0, 3))
        self.lag.pop(r.peer_id, None)  # re-inserted last: the dict's order is least recently heard-from first
        self.lag[r.peer_id] = version - r.policy_version  # 0..version: admit.refusal bounds the version
        while len(self.lag) > LAG_KEPT:
            del self.lag[next(iter(self.lag))]
        self.progress.count_steps(r.env_steps)
        expected = self.hashes.get(r.policy_version)
        if expected is not None and r.param_hash != expected:
            self._ratelog.log(
                "foreign-params",
                f"actor {r.peer_id} acts with parameters {r.param_hash!r} that were never published "
                f"for version {r.policy_version} (published {expected})",
                "ERROR",
            )
        episodes = self.episodes.add(r.peer_id, r.incarnation, r.seq, r.segments)
        self.progress.add_episodes([ret for ret, _ in episodes])

    def intake(self, env_steps: int, returns: list[float], invalid: int) -> None:
        """What replay services took in (``replay.placement = "service"``): they count steps, episodes and refusals
        as a shard does (``zddrl/replay/store.py``) and report the sums; their refusals count under ``replay``."""
        if env_steps:
            self.first_s.setdefault("wall_s_first_trajectory", round(time.time() - self.t0, 3))
        self.progress.count_steps(env_steps)
        self.progress.add_episodes(returns)
        if invalid:
            self.progress.dropped_invalid["replay"] += invalid

    def drop_stale(self, r: Record, version: int) -> None:
        n = _tally(self.progress.dropped_stale, r.peer_id)
        if n:
            self.log.warning(
                f"dropped stale data from {r.peer_id}: version {r.policy_version} is "
                f"{version - r.policy_version} behind {version} (max_staleness "
                f"{self.config.bus.max_staleness}; {n} so far)"
            )

    def drop_late(self, r: Record, version: int) -> None:
        n = _tally(self.progress.dropped_late, r.peer_id)
        if n:
            self.log.warning(
                f"dropped late data from {r.peer_id}: version {r.policy_version}, round {version} "
                f"({n} so far from this actor)"
            )

    def drop_invalid(self, r: Record) -> None:
        """A trajectory the run cannot train on: counted for its actor. Its episode streams go on where its rewards
        were read and finite (a refusal for content); a column with a non-finite reward, or all of them when it was
        not read (a refusal on shape or header), loses its current episode."""
        self.progress.dropped_invalid[r.peer_id] += 1
        self.episodes.add(r.peer_id, r.incarnation, r.seq, r.segments)  # None (unread) breaks every column
        self._ratelog.warning(
            "invalid",
            f"dropped a trajectory from {r.peer_id} (seq {r.seq}) that this run cannot train on: {r.invalid} "
            f"({self.progress.dropped_invalid[r.peer_id]} so far from this actor)",
        )

    def watch_lag(self) -> None:
        """Warn when the median actor lag keeps growing: the 'actors never get new parameters' failure."""
        if not self.lag:
            return
        self.lag_medians.append(float(np.median(list(self.lag.values()))))
        m = list(self.lag_medians)
        if len(m) == LAG_WINDOW and all(b >= a for a, b in zip(m, m[1:])) and m[-1] - m[0] >= 3:
            self.log.warning(
                f"median actor lag keeps growing ({m[0]:.0f} -> {m[-1]:.0f} versions over "
                f"{LAG_WINDOW} updates): are parameters reaching the actors?"
            )
            self.lag_medians.clear()

    def env_steps(self) -> int:
        return self.progress.env_steps()

    def return_mean(self) -> float:
        return self.progress.return_mean()

    def wall_s(self) -> float:
        """Seconds of this run, earlier incarnations (before a resume) included."""
        return self.progress.wall_before + time.time() - self.t0

    def finished(self) -> bool:
        t = self.config.train
        return bool(self.progress.target) or self.env_steps() >= t.max_steps or time.time() - self.t0 >= t.max_seconds

    def row(self, figures: dict[str, Any], **columns: Any) -> dict[str, Any]:
        """The metrics row of an update (``columns``: version, actors, rollout length, timings, skipped steps);
        records the target the first time the return reaches it."""
        self._ratelog.flush()
        self.first_s.setdefault("wall_s_first_update", round(time.time() - self.t0, 3))
        wall, steps, ret, p = self.wall_s(), self.env_steps(), self.return_mean(), self.progress
        row = {
            "wall_s": wall,
            "env_steps": steps,
            "sps": steps / wall,
            "return_mean_20": ret,
            "episodes": p.episodes,
            "staleness_mean": 0.0,
            "staleness_max": 0,
            "staleness_hist": f"0:{figures.get('batch_steps', 0)}",
            **figures,
            "dropped_late": sum(p.dropped_late.values()),
            "dropped_stale": sum(p.dropped_stale.values()),
            "dropped_invalid": sum(p.dropped_invalid.values()),
            **columns,
        }
        row["eval_return"] = p.eval_return
        row["target_kind"] = self.config.train.target_kind
        self.last_row = row
        target, value = self.config.train.until_return, self.target_value()
        if not p.target and value >= target:
            confirmed = self._confirmation(value)
            row["eval_return"] = p.eval_return
            if confirmed is not None:
                p.target = {
                    "wall_s_to_target": round(wall, 3),
                    "env_steps_to_target": steps,
                    "return_at_target": round(value, 2),
                }
                self.log.info(
                    f"target return {target} ({self.config.train.target_kind}) reached: {value:.1f} after {steps} "
                    f"env steps, {wall:.2f} s{confirmed}"
                )
        return row

    def _confirmation(self, value: float) -> str | None:
        """Whether a target the training return ``value`` reached is confirmed by the learner's own evaluation (see
        the module docstring): None when it is not, else what the log line adds ("" when nothing needs confirming)."""
        t = self.config.train
        if t.target_kind != "train":
            return ""
        if not t.confirm_target:
            return " (not confirmed: train.confirm_target = false)"
        started = time.monotonic()
        if self.confirm is None or started < self.next_confirm:
            return None
        evaluated = self.progress.eval_return = float(self.confirm())
        spent = time.monotonic() - started
        self.next_confirm = started + spent / CONFIRM_SHARE
        if evaluated >= t.until_return:
            return f"; confirmed by the learner's own evaluation: {evaluated:.1f} over {t.eval_episodes} episodes"
        self._ratelog.info(
            "unconfirmed",
            f"the training return {value:.1f} reached the target {t.until_return:g}, but the learner's own "
            f"evaluation returned {evaluated:.1f} ({t.eval_episodes} deterministic episodes): not confirmed, the run "
            f"goes on",
        )
        return None

    def target_value(self) -> float:
        """What the target is compared with: the training return (last 20 episodes) or the newest evaluation's."""
        return self.progress.eval_return if self.config.train.target_kind == "eval" else self.return_mean()

    def drops(self) -> dict[str, int]:
        p = self.progress
        return {
            "dropped_late": sum(p.dropped_late.values()),
            "dropped_stale": sum(p.dropped_stale.values()),
            "dropped_invalid": sum(p.dropped_invalid.values()),
        }

    def summary(self, **run: Any) -> dict[str, Any]:
        """summary.json (docs/run-directory.md); ``run``: policy version, mode, seed, run id, shards."""
        wall, steps, ret, p = self.wall_s(), self.env_steps(), self.return_mean(), self.progress
        target = self.config.train.until_return
        return {
            "target_return": None if math.isinf(target) else target,
            "target_kind": self.config.train.target_kind,
            "eval_return": None if math.isnan(p.eval_return) else round(p.eval_return, 2),
            "reached": bool(p.target),
            "wall_s_to_target": p.target.get("wall_s_to_target"),
            "env_steps_to_target": p.target.get("env_steps_to_target"),
            "return_at_target": p.target.get("return_at_target"),
            "total_env_steps": steps,
            "wall_s": round(wall, 3),
            "sps": round(steps / max(wall, 1e-9), 1),
            "return_mean_20": None if math.isnan(ret) else round(ret, 2),
            "episodes": p.episodes,
            "updates": p.updates,
            "dropped_late": dict(p.dropped_late),
            "dropped_stale": dict(p.dropped_stale),
            "dropped_invalid": dict(p.dropped_invalid),
            "lag": dict(self.lag),
            "shard_trajectories": list(self.shard_trajectories),
            "wall_s_first_trajectory": self.first_s.get("wall_s_first_trajectory"),
            "wall_s_first_update": self.first_s.get("wall_s_first_update"),
            **run,
        }
