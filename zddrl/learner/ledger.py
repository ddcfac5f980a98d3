"""The main learner shard's record of a run: counting, drops, the metrics row, summary, checkpoints.

``RunLedger`` is mixed into ``LearnerNode``: these methods read and write its state (progress,
lag, version, run log). Only the main shard (rank 0) calls them; records of what the other shards
received reach it through the shards' exchange (``LearnerNode._poll``).
"""
from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import numpy as np

from zddrl.config import ConfigError
from zddrl.learner.progress import Progress
from zddrl.ops.status import request_status

LAG_WINDOW = 20
"""Updates over which a steadily growing median actor lag raises a warning."""
FLEET_QUERY_TIMEOUT_S = 1.0


def _tally(drops: dict[str, int], peer_id: str) -> int:
    """Count one more drop of ``peer_id``'s data; its count when this drop is worth a log line (the first,
    then every 100th), else 0."""
    drops[peer_id] += 1
    n = drops[peer_id]
    return n if n == 1 or n % 100 == 0 else 0


class RunLedger:
    """Counting and records of a learner node (see the module docstring)."""

    def _drop_stale(self, r: dict[str, Any], staleness: int) -> None:
        n = _tally(self.progress.dropped_stale, r["peer_id"])
        if n:
            self.log.warning(f"dropped stale data from {r['peer_id']}: version {r['version']} is {staleness} "
                             f"behind {self.version} (max_staleness {self.algo.max_staleness}; {n} so far)")

    def _watch_lag(self) -> None:
        """Warn when the median actor lag keeps growing: the 'actors never get new parameters' failure."""
        if not self.lag:
            return
        self.lag_medians.append(float(np.median(list(self.lag.values()))))
        m = list(self.lag_medians)
        if len(m) == LAG_WINDOW and all(b >= a for a, b in zip(m, m[1:])) and m[-1] - m[0] >= 3:
            self.log.warning(f"median actor lag keeps growing ({m[0]:.0f} -> {m[-1]:.0f} versions over "
                             f"{LAG_WINDOW} updates): are parameters reaching the actors?")
            self.lag_medians.clear()

    def _account(self, r: dict[str, Any]) -> None:
        """Every received trajectory, on any shard, counts toward env steps and episode returns, accepted
        or not (main shard; ``r`` is its record)."""
        self.lag[r["peer_id"]] = self.version - r["version"]
        self.progress.count_steps(r["peer_id"], r["total_env_steps"], r["env_steps"], r["incarnation"])
        expected = self.hashes.get(r["version"])
        if expected is not None and r["param_hash"] != expected:
            self.log.error(f"actor {r['peer_id']} acts with parameters {r['param_hash']} that were never published "
                           f"for version {r['version']} (published {expected})")
        self.progress.add_episodes(r["ep_returns"])
        if self.algo.mode == "sync" and r["peer_id"] not in self.fleet:  # joined after the last look
            self._refresh_fleet()

    def _drop_late(self, r: dict[str, Any]) -> None:
        if r["peer_id"] in self.stragglers and self.version - r["version"] <= 1:
            # It missed the round by less than one update: wait for it again (up to the straggler
            # timeout) rather than leave it out for the rest of the run.
            self.stragglers.discard(r["peer_id"])
            self.log.info(f"{r['peer_id']} is only one version late: back in the quota")
        n = _tally(self.progress.dropped_late, r["peer_id"])
        if n:
            self.log.warning(f"dropped late data from {r['peer_id']}: version {r['version']}, round "
                             f"{self.version} ({n} so far from this actor)")

    def _drop_invalid(self, r: dict[str, Any]) -> None:
        n = _tally(self.progress.dropped_invalid, r["peer_id"])
        if n:
            self.log.warning(f"dropped a trajectory from {r['peer_id']} (seq {r['seq']}) that this run cannot train "
                             f"on: {r['invalid']} ({n} so far from this actor)")

    def total_env_steps(self) -> int:
        return self.progress.env_steps()

    def return_mean(self) -> float:
        return self.progress.return_mean()

    def wall_s(self) -> float:
        """Seconds of this run, earlier incarnations (before a resume) included."""
        return self.progress.wall_before + time.time() - self.t0

    def _log_update(self, figures: dict[str, float], round_s: float, update_s: float, actors: int) -> None:
        wall = self.wall_s()
        steps = self.total_env_steps()
        ret = self.return_mean()
        p = self.progress
        row = {"wall_s": wall, "env_steps": steps, "policy_version": self.version, "sps": steps / wall,
               "return_mean_20": ret, "episodes": p.episodes, "staleness_mean": 0.0, "staleness_max": 0,
               "staleness_hist": f"0:{figures.get('batch_steps', 0)}", **figures,
               "dropped_late": sum(p.dropped_late.values()), "dropped_stale": sum(p.dropped_stale.values()),
               "dropped_invalid": sum(p.dropped_invalid.values()), "skipped_steps": self.core.skipped_steps,
               "actors": actors, "rollout_len": self.rollout_len,
               "round_s": round_s, "update_s": update_s}
        self.runlog.write(row)
        self.last_row = row
        if not self.progress.target and ret >= self.config.train.until_return:
            self.progress.target = {"wall_s_to_target": round(wall, 3), "env_steps_to_target": steps,
                                    "return_at_target": round(ret, 2)}
            self.log.info(f"target return {self.config.train.until_return} reached: {ret:.1f} after {steps} env "
                          f"steps, {wall:.2f} s")

    def _finished(self) -> bool:
        t = self.config.train
        return bool(self.progress.target) or self.total_env_steps() >= t.max_steps or time.time() - self.t0 >= t.max_seconds

    def _summary(self) -> dict[str, Any]:
        wall = self.wall_s()
        steps = self.total_env_steps()
        target = self.config.train.until_return
        return {"target_return": None if math.isinf(target) else target, "reached": bool(self.progress.target),
                "wall_s_to_target": self.progress.target.get("wall_s_to_target"),
                "env_steps_to_target": self.progress.target.get("env_steps_to_target"),
                "return_at_target": self.progress.target.get("return_at_target"), "total_env_steps": steps,
                "wall_s": round(wall, 3), "sps": round(steps / max(wall, 1e-9), 1),
                "return_mean_20": None if math.isnan(self.return_mean()) else round(self.return_mean(), 2),
                "episodes": self.progress.episodes, "policy_version": self.version, "updates": self.progress.updates,
                "dropped_late": dict(self.progress.dropped_late), "dropped_stale": dict(self.progress.dropped_stale),
                "dropped_invalid": dict(self.progress.dropped_invalid), "lag": dict(self.lag), "mode": self.algo.mode,
                "seed": self.config.env.seed,
                "run_id": self.run_id, "shards": self.group.world_size,
                "shard_trajectories": list(self.shard_trajectories)}

    def _record_hosts(self) -> None:
        """Add the fleet's hosts to meta.json (best effort: the broker may be gone)."""
        body = request_status(self.connect, FLEET_QUERY_TIMEOUT_S, self.ctx)
        if body is None:
            return
        self.runlog.meta({"hosts": sorted({m["host"] for m in body["members"].values() if m.get("host")}),
                          "actors": sorted(p for p, m in body["members"].items() if m["role"] == "actor")})

    def _maybe_checkpoint(self) -> None:
        t = self.config.train
        due_updates = t.checkpoint_every and self.progress.updates % t.checkpoint_every == 0
        if (due_updates and self.progress.updates != self.last_checkpoint_updates) or \
                time.monotonic() >= self.next_checkpoint_s:
            self._checkpoint()

    def _checkpoint(self, final: bool = False) -> None:
        state = {**self.core.state(), "policy_version": self.version, "config": self.config.to_dict(),
                 "progress": self.progress.state(self.wall_s()), "rollout_len": self.rollout_len,
                 "env_steps": self.total_env_steps()}
        path = self.runlog.checkpoint(state, f"ckpt-{self.version:08d}.pt", keep=self.config.train.keep_checkpoints)
        if final:
            self.runlog.checkpoint(state, "final.pt")
        self.last_checkpoint_updates = self.progress.updates
        self.next_checkpoint_s = time.monotonic() + self.config.train.checkpoint_every_s
        self.log.debug(f"checkpoint {path.name} written")

    def _restore(self, state: dict[str, Any], path: Path) -> None:
        """Continue where the checkpoint stopped: weights, optimizer, schedules, statistics, RNG, counters."""
        saved = state.get("config", {})
        for section in ("env", "model"):
            if saved.get(section) != self.config.to_dict()[section]:
                raise ConfigError(f"--resume: the [{section}] of {path.name} differs from this config; resume "
                                  f"with the run's own config.toml")
        self.core.load_state(state)
        self.version = int(state["policy_version"])
        self.rollout_len = int(state.get("rollout_len", self.rollout_len))
        self.progress = Progress.from_state(state["progress"])
        self.log.info(f"resumed from {path}: version {self.version}, {self.progress.env_steps()} env steps, "
                      f"{self.progress.updates} updates")
