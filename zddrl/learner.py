"""Learner node: the transport shell around the PPO core.

It announces the run (hello with the run spec), publishes version-0 parameters, then runs rounds.
Sync mode (distributed PPO): a round collects trajectories of the current version until the
batch is full (``algo.batch_size`` env steps summed over actors) or the round has taken more than
``straggler_factor`` times the median round; then one PPO update and version v+1 is published.
Late data for a closed version is dropped, counted per actor and logged, never trained on.
Each round, the learner asks the broker which actors are connected; the next round's per-env
rollout length is ``ceil(batch_size / envs of all actors)``, so the total batch stays fixed when
actors join or leave, and a round also closes as soon as every connected actor has reported.
"""
from __future__ import annotations

import math
import statistics
import threading
import time
import uuid
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np
import zmq
from loguru import logger

from . import protocol as P
from .channel import CREDIT_WINDOW, DataChannel
from .client import BrokerLink, Refused, hello_fields
from .config import Config, ConfigError
from .envs import probe_spec
from .core import LearnerCore
from .impala import ImpalaLearner
from .ppo import PPOLearner
from .progress import Progress
from .proc import rss_mb
from .runlog import RunLog, latest_checkpoint, load_checkpoint
from .status import request_status

RECV_POLL_MS = 20
WELCOME_TIMEOUT_S = 60.0
FIRST_ROUNDS_TIMEOUT_S = 10.0
"""Straggler timeout until three rounds give a median to scale."""
FLEET_QUERY_TIMEOUT_S = 1.0
LAG_WINDOW = 20
"""Updates over which a steadily growing median actor lag raises a warning."""
STATS_EVERY_S = 1.0
REPORTED_FIGURES = ("policy_loss", "value_loss", "entropy", "approx_kl", "clipfrac", "explained_variance",
                    "grad_norm", "lr", "staleness_mean", "staleness_max", "staleness_hist", "is_weight_mean",
                    "rho_mean", "sps")
"""The last update's figures that go to `zddrl status` with the learner's stats."""
MEDIAN_WINDOW = 50


class LearnerNode:
    """``LearnerNode(connect, config, run_dir).run(stop) -> summary``."""

    def __init__(self, connect: str, config: Config, run_dir: str | Path, *, t0: float | None = None,
                 peer_id: str = "learner-0", context: zmq.Context | None = None, resume: bool = False) -> None:
        self.connect = connect
        self.config = config
        self.algo = config.algo
        self.t0 = t0 if t0 is not None else time.time()
        self.peer_id = peer_id
        self.ctx = context or zmq.Context.instance()
        self.run_id = f"{config.name}-{uuid.uuid4().hex[:8]}"
        self.log = logger.bind(role="learner", peer=peer_id)
        self.spec = probe_spec(config.env.id, config.env.max_episode_steps)
        self.core: LearnerCore = (ImpalaLearner if config.algo.mode == "impala" else PPOLearner)(config, self.spec)
        self.version = 0
        self.progress = Progress()
        self.param_hash = ""
        self.published: P.Parameters | None = None
        self.hashes: dict[int, str] = {}
        self.lag: dict[str, int] = {}
        """Per actor: staleness of its newest trajectory (learner version - its version)."""
        self.lag_medians: deque[float] = deque(maxlen=LAG_WINDOW)
        self.next_stats = 0.0
        self.link: BrokerLink | None = None
        self.pending: list[P.Trajectory] = []
        """Accounted trajectories to use first: taken off a replaced data socket, or collected before a
        re-welcome interrupted a round."""
        self.last_row: dict[str, Any] = {}
        self.timing = {"updates": 0, "samples": 0, "wait_s": 0.0, "update_s": 0.0}
        """Since the last stats report: updates, samples trained on, seconds waiting for data / updating."""
        self.last_checkpoint_updates = -1
        self.report_times: deque[float] = deque(maxlen=MEDIAN_WINDOW)
        """Seconds from a round's start to each actor's in-time report, over recent rounds."""
        self.stragglers: set[str] = set()
        """Actors that missed the last round: left out of the next round's quota until they keep up."""
        self.rollout_len = config.env.rollout_len
        self.fleet: dict[str, int] = {}
        """Connected actors and their env counts, as the broker last reported them."""
        checkpoint = latest_checkpoint(Path(run_dir)) if resume else None
        if resume and checkpoint is None:
            raise ConfigError(f"--resume: no checkpoint in {Path(run_dir) / 'checkpoints'}")
        if checkpoint is not None:
            self._restore(load_checkpoint(checkpoint), checkpoint)
        self.runlog = RunLog(run_dir, config.to_dict(), resume_version=self.version if resume else None)
        self.next_checkpoint_s = time.monotonic() + config.train.checkpoint_every_s

    # ---------------------------------------------------------------- main loop
    def run(self, stop: threading.Event) -> dict[str, Any]:
        hello = P.Hello(role="learner", peer_id=self.peer_id, run_id=self.run_id, run=self.config.to_dict(),
                        **hello_fields())
        link = self.link = BrokerLink(self.connect, hello, context=self.ctx).start()
        channel = None
        crashed = False
        try:
            if link.wait_welcome(WELCOME_TIMEOUT_S) is None or link.refused:
                if link.refused:
                    raise Refused(link.refused)
                raise RuntimeError(f"no broker answered at {self.connect} within {WELCOME_TIMEOUT_S:.0f} s")
            channel = DataChannel(self.ctx, link, self.peer_id, link.welcome.max_message_bytes, self._window())
            self._refresh_fleet()
            self._publish(channel)
            self.runlog.meta({"run_id": self.run_id, "mode": self.algo.mode, "resumed_from_version": self.version,
                              "broker": self.connect})
            self.log.info(f"run {self.run_id}: {self.config.env.id}, mode {self.algo.mode}, "
                          f"batch {self.algo.batch_size} steps, version {self.version} published")
            step = self._round if self.algo.mode == "sync" else self._stream
            while not stop.is_set() and not self._finished():
                channel = self._reconnect_if_needed(link, channel)
                step(channel, stop)
                self._report(link)
                self._maybe_checkpoint()
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:
            crashed = True  # the state may be half-updated: never write it over the last good checkpoint
            link.report_crash(exc)  # forensics: `zddrl status` shows why the learner died
            raise
        finally:
            summary = self._summary()
            self.runlog.summary(summary)
            self._record_hosts()
            if not crashed:
                self._checkpoint(final=True)
            self.runlog.close()
            if channel is not None:
                channel.close()
            link.close(reason="learner finished")
        return summary

    def _window(self) -> int:
        """Credit window. Async modes keep it near one batch: every message queued ahead of the learner
        is a version older by the time it is trained on."""
        if self.algo.mode == "sync":
            return CREDIT_WINDOW
        per_batch = math.ceil(self.algo.batch_size / (self.config.env.rollout_len * self.config.env.num_envs))
        return per_batch + 1

    def _reconnect_if_needed(self, link: BrokerLink, channel: DataChannel) -> DataChannel:
        """After a new welcome: re-grant credit (the broker's restarted at zero) and re-publish the
        current parameters (a restarted broker has none). The data socket is kept while the learners
        port is the same, so trajectories already on their way are not lost."""
        if link.generation == channel.generation:
            return channel
        self.log.warning("re-welcomed by the broker: granting credit and publishing parameters again")
        if link.endpoint("learners") == channel.endpoint:
            channel.regrant(link.generation)
        else:
            self.pending.extend(t for t in map(self._take, channel.drain()) if t is not None)
            channel.close()
            channel = DataChannel(self.ctx, link, self.peer_id, link.welcome.max_message_bytes, self._window())
        if self.published is not None:
            channel.send(self.published)
        return channel

    # ---------------------------------------------------------------- one sync round
    def _round(self, channel: DataChannel, stop: threading.Event) -> None:
        """Collect version-v data until the batch is full, every expected actor reported, or the
        straggler timeout; then update and publish v+1."""
        started = time.monotonic()
        batch: list[P.Trajectory] = []
        steps, reported = 0, set()
        expected = self.fleet.keys() - self.stragglers
        timeout = self._straggler_timeout()
        while not stop.is_set():
            if steps >= self.algo.batch_size:
                break
            if batch and expected and reported >= expected:
                break  # in sync mode each actor sends one rollout per version: nothing more will come
            if batch and time.monotonic() - started > timeout:
                self.log.info(f"round {self.version} closed by the straggler rule after {timeout * 1000:.0f} ms with "
                              f"{steps} of {self.algo.batch_size} steps; late: {sorted(expected - reported)}")
                break
            msg = self._receive(channel)
            if msg is None:
                if self._finished() or self._rewelcomed(channel):
                    self.pending.extend(batch)  # still version v: the round goes on after the renewal
                    return
                continue
            if msg.sender not in self.fleet:  # joined after the last look: count it in from now on
                self._refresh_fleet()
                expected = self.fleet.keys() - self.stragglers
            if msg.policy_version != self.version:
                self._drop_late(msg)
                continue
            batch.append(msg)
            reported.add(msg.sender)
            self.report_times.append(time.monotonic() - started)
            steps += msg.env_steps
        if not batch or stop.is_set():
            return
        round_s = time.monotonic() - started
        figures, update_s = self._train(batch)
        self._refresh_fleet(reported)
        self._publish(channel)
        self._log_update(figures, round_s, update_s, len(reported))

    def _receive(self, channel: DataChannel) -> P.Trajectory | None:
        """The next trajectory of this run, accounted and its credit returned; None after a quiet poll."""
        if self.pending:
            return self.pending.pop(0)  # accounted when it first arrived
        msg = channel.recv(RECV_POLL_MS)
        if isinstance(msg, P.Trajectory):
            channel.ack()  # only trajectories cost credit
        return self._take(msg)

    def _take(self, msg: P.Message | None) -> P.Trajectory | None:
        """A trajectory of this run, accounted; anything else is ignored."""
        if not isinstance(msg, P.Trajectory):
            return None
        if msg.run_id != self.run_id:  # another run's data (a broker serving two runs): never trained on
            self.log.warning(f"ignored a trajectory of run {msg.run_id!r} from {msg.sender}")
            return None
        self._account(msg)
        return msg

    def _rewelcomed(self, channel: DataChannel) -> bool:
        """The broker welcomed us again (restart, expiry): the round loop must hand back control so
        that credit and parameters are renewed, or it would wait for data that cannot come."""
        return self.link is not None and self.link.generation != channel.generation

    def _train(self, batch: list[P.Trajectory], staleness: float = 0.0) -> tuple[dict[str, float], float]:
        """One update on ``batch``; the version moves on. Returns the figures and the seconds it took."""
        t0 = time.monotonic()
        batch.sort(key=lambda t: (t.sender, t.seq))  # arrival order must not change what is learned
        figures = self.core.update(batch, staleness=staleness)
        self.progress.updates += 1
        self.version += 1
        return figures, time.monotonic() - t0

    # ---------------------------------------------------------------- async / impala
    def _stream(self, channel: DataChannel, stop: threading.Event) -> None:
        """Take data as it arrives; drop what is more than ``max_staleness`` versions old; update once
        a batch is full; publish every ``publish_every`` updates. Actors never wait."""
        started = time.monotonic()
        batch: list[P.Trajectory] = []
        steps = 0
        while not stop.is_set() and steps < self.algo.batch_size:
            if self._finished():  # also while everything arriving is dropped (no quiet poll then)
                return
            msg = self._receive(channel)
            if msg is None:
                if self._finished() or self._rewelcomed(channel):
                    self.pending.extend(batch)  # what was collected counts toward the next batch
                    return
                continue
            staleness = self.version - msg.policy_version
            if not 0 <= staleness <= self.algo.max_staleness:
                self._drop_stale(msg, staleness)
                continue
            batch.append(msg)
            steps += msg.env_steps
        if not batch or stop.is_set():
            return
        round_s = time.monotonic() - started
        staleness = np.repeat([self.version - t.policy_version for t in batch], [t.env_steps for t in batch])
        figures, update_s = self._train(batch, float(staleness.mean()))
        if self.progress.updates % self.algo.publish_every == 0:
            self._publish(channel)
        hist = np.bincount(staleness)
        figures.update(staleness_mean=float(staleness.mean()), staleness_max=int(staleness.max()),
                       staleness_hist=" ".join(f"{v}:{n}" for v, n in enumerate(hist) if n))
        self._watch_lag()
        self._log_update(figures, round_s, update_s, len({t.sender for t in batch}))

    def _drop_stale(self, msg: P.Trajectory, staleness: int) -> None:
        self.progress.dropped_stale[msg.sender] += 1
        n = self.progress.dropped_stale[msg.sender]
        if n == 1 or n % 100 == 0:
            self.log.warning(f"dropped stale data from {msg.sender}: version {msg.policy_version} is {staleness} "
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

    def _report(self, link: BrokerLink) -> None:
        """Stats for `zddrl status`, at most once per STATS_EVERY_S."""
        now = time.monotonic()
        if now < self.next_stats:
            return
        elapsed = now - self.next_stats + STATS_EVERY_S
        self.next_stats = now + STATS_EVERY_S
        ret = self.return_mean()
        timing, self.timing = self.timing, {"updates": 0, "samples": 0, "wait_s": 0.0, "update_s": 0.0}
        row = {k: v for k, v in self.last_row.items() if k in REPORTED_FIGURES and isinstance(v, (int, float, str))}
        link.send(P.Stats(sender=self.peer_id, role="learner", stats={
            **row, "policy_version": self.version, "updates": self.progress.updates,
            "env_steps": self.total_env_steps(), "return_mean_20": None if math.isnan(ret) else ret,
            "updates_per_s": timing["updates"] / elapsed, "samples_per_s": timing["samples"] / elapsed,
            "wait_data_share": timing["wait_s"] / elapsed, "rss_mb": rss_mb(),
            **{f"lag/{actor}": lag for actor, lag in self.lag.items()},
            "dropped_late": sum(self.progress.dropped_late.values()),
            "dropped_stale": sum(self.progress.dropped_stale.values())}))

    def _straggler_timeout(self) -> float:
        """``straggler_factor`` x the median time actors take to report (floored); generous until known."""
        if len(self.report_times) < 3:
            return FIRST_ROUNDS_TIMEOUT_S
        return max(self.algo.min_round_timeout_s, self.algo.straggler_factor * statistics.median(self.report_times))

    def _refresh_fleet(self, reported: set[str] | None = None) -> None:
        """Ask the broker which actors are connected and how many envs each steps; actors that missed
        this round become stragglers; size the next rollouts so that one from every other actor makes
        exactly one batch."""
        body = request_status(self.connect, FLEET_QUERY_TIMEOUT_S, self.ctx)
        if body is not None:
            default = self.config.env.num_envs
            self.fleet = {peer: m["num_envs"] or default for peer, m in body["members"].items()
                          if m["role"] == "actor"}
        if reported is not None:
            late = self.fleet.keys() - reported
            if late - self.stragglers:
                self.log.warning(f"stragglers {sorted(late - self.stragglers)} missed round {self.version - 1}: "
                                 "their data is dropped until they keep up")
            self.stragglers = late
        envs = sum(n for peer, n in self.fleet.items() if peer not in self.stragglers)
        if envs and self.algo.mode == "sync":  # async modes keep env.rollout_len
            self.rollout_len = max(1, math.ceil(self.algo.batch_size / envs))

    def _account(self, msg: P.Trajectory) -> None:
        """Every received trajectory counts toward env steps and episode returns, accepted or not."""
        self.lag[msg.sender] = self.version - msg.policy_version
        total = msg.info.get("total_env_steps")
        self.progress.count_steps(msg.sender, total, msg.env_steps)
        expected = self.hashes.get(msg.policy_version)
        if expected is not None and msg.param_hash != expected:
            self.log.error(f"actor {msg.sender} acts with parameters {msg.param_hash} that were never published "
                           f"for version {msg.policy_version} (published {expected})")
        self.progress.add_episodes(msg.arrays["ep_returns"])

    def _drop_late(self, msg: P.Trajectory) -> None:
        if msg.sender in self.stragglers and self.version - msg.policy_version <= 1:
            # It missed the round by less than one update: wait for it again (up to the straggler
            # timeout) rather than leave it out for the rest of the run.
            self.stragglers.discard(msg.sender)
            self.log.info(f"{msg.sender} is only one version late: back in the quota")
        self.progress.dropped_late[msg.sender] += 1
        n = self.progress.dropped_late[msg.sender]
        if n == 1 or n % 100 == 0:
            self.log.warning(f"dropped late data from {msg.sender}: version {msg.policy_version}, round "
                             f"{self.version} ({n} so far from this actor)")

    # ---------------------------------------------------------------- publishing and reporting
    def _publish(self, channel: DataChannel) -> None:
        flat, layout, extra = self.core.params()
        self.param_hash = P.param_hash(flat)
        self.hashes[self.version] = self.param_hash
        self.published = P.Parameters(run_id=self.run_id, sender=self.peer_id, policy_version=self.version,
                                      param_hash=self.param_hash, layout=layout, arrays={"flat": flat, **extra},
                                      meta={"rollout_len": self.rollout_len})
        channel.send(self.published)

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
        row = {"wall_s": wall, "env_steps": steps, "policy_version": self.version, "sps": steps / wall,
               "return_mean_20": ret, "episodes": self.progress.episodes, "staleness_mean": 0.0, "staleness_max": 0,
               "staleness_hist": f"0:{figures.get('batch_steps', 0)}", **figures, "dropped_late": sum(self.progress.dropped_late.values()),
               "dropped_stale": sum(self.progress.dropped_stale.values()), "actors": actors, "rollout_len": self.rollout_len,
               "round_s": round_s, "update_s": update_s}
        self.runlog.write(row)
        self.last_row = row
        self.timing["updates"] += 1
        self.timing["samples"] += int(figures.get("batch_steps", 0))
        self.timing["wait_s"] += round_s
        self.timing["update_s"] += update_s
        if not self.progress.target and ret >= self.config.train.until_return:
            self.progress.target = {"wall_s_to_target": round(wall, 3), "env_steps_to_target": steps}
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
                "env_steps_to_target": self.progress.target.get("env_steps_to_target"), "total_env_steps": steps,
                "wall_s": round(wall, 3), "sps": round(steps / max(wall, 1e-9), 1),
                "return_mean_20": None if math.isnan(self.return_mean()) else round(self.return_mean(), 2),
                "episodes": self.progress.episodes, "policy_version": self.version, "updates": self.progress.updates,
                "dropped_late": dict(self.progress.dropped_late), "dropped_stale": dict(self.progress.dropped_stale),
                "lag": dict(self.lag), "mode": self.algo.mode, "seed": self.config.env.seed,
                "run_id": self.run_id}

    def _record_hosts(self) -> None:
        """Add the fleet's hosts to meta.json (best effort: the broker may be gone)."""
        body = request_status(self.connect, FLEET_QUERY_TIMEOUT_S, self.ctx)
        if body is None:
            return
        self.runlog.meta({"hosts": sorted({m["host"] for m in body["members"].values() if m.get("host")}),
                          "actors": sorted(p for p, m in body["members"].items() if m["role"] == "actor")})

    # ---------------------------------------------------------------- checkpoints
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
