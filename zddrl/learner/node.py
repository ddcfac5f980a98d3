"""Learner node: the transport shell around the PPO core; one process per learner shard.

It announces the run (hello with the run spec), publishes version-0 parameters, then runs rounds.
Sync mode (distributed PPO): a round collects trajectories of the current version until the
batch is full (``algo.batch_size`` env steps summed over actors) or the round has taken more than
``straggler_factor`` times the median round; then one PPO update and version v+1 is published.
Late data for a closed version is dropped, counted per actor and logged, never trained on.
Each round, the learner asks the broker which actors are connected; the next round's per-env
rollout length is ``ceil(batch_size / envs of all actors)``, so the total batch stays fixed when
actors join or leave, and a round also closes as soon as every connected actor has reported. A
rollout the run cannot use (algos.rollout.mismatch: NaN rewards of a buggy env, say) is dropped and counted,
and its actor counts as reported; a round with no usable rollout at all publishes v+1 with the weights
unchanged, so that actors (which wait for a newer version) sample again.

Shards (``zddrl learner --gpus``): every shard takes its own share of the stream from the broker.
After each poll the shards exchange a record of every trajectory they received (peer_id, version,
steps, episode returns), so all of them count the same global batch and close a round or a batch
at the same poll; time-based decisions (straggler timeout, run limits) come from the main shard
(rank 0) in that same exchange. Then each shard trains on its own trajectories with gradients
averaged over the group (``shards.py``), and the main shard alone publishes, logs, checkpoints.
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

from zddrl import protocol as P
from zddrl.transport.channel import CREDIT_WINDOW, DataChannel
from zddrl.transport.link import BrokerLink, Refused, hello_fields
from zddrl.config import Config, ConfigError
from zddrl.envs import probe_spec
from zddrl.algos.core import LearnerCore
from zddrl.algos.impala import ImpalaLearner
from zddrl.algos.ppo import PPOLearner
from zddrl.transport.params import split as split_params
from zddrl.learner.progress import Progress
from zddrl.proc import rss_mb
from zddrl.algos.rollout import mismatch
from zddrl.learner.ledger import FLEET_QUERY_TIMEOUT_S, LAG_WINDOW, RunLedger
from zddrl.learner.runlog import RunLog, latest_checkpoint, load_checkpoint
from zddrl.dist.shards import ShardError, ShardGroup
from zddrl.ops.status import request_status

RECV_POLL_MS = 20
SHARDED_POLL_MS = 5
"""Shards exchange what they received after every poll: a short poll keeps a round's end prompt."""
WELCOME_TIMEOUT_S = 60.0
FIRST_ROUNDS_TIMEOUT_S = 10.0
"""Straggler timeout until three rounds give a median to scale."""
STATS_EVERY_S = 1.0
REPORTED_FIGURES = ("policy_loss", "value_loss", "entropy", "approx_kl", "clipfrac", "explained_variance",
                    "grad_norm", "lr", "staleness_mean", "staleness_max", "staleness_hist", "is_weight_mean",
                    "rho_mean", "sps")
"""The last update's figures that go to `zddrl status` with the learner's stats."""
MEDIAN_WINDOW = 50


class LearnerNode(RunLedger):
    """``LearnerNode(connect, config, run_dir).run(stop) -> summary``; one per shard."""

    def __init__(self, connect: str, config: Config, run_dir: str | Path, *, t0: float | None = None,
                 peer_id: str | None = None, context: zmq.Context | None = None, resume: bool = False,
                 group: ShardGroup | None = None) -> None:
        self.connect = connect
        self.config = config
        self.algo = config.algo
        self.group = group or ShardGroup()
        self.main = self.group.is_main
        self.t0 = t0 if t0 is not None else time.time()
        self.peer_id = peer_id or f"learner-{self.group.rank}"
        self.ctx = context or zmq.Context.instance()
        self.run_id = self.group.broadcast(f"{config.name}-{uuid.uuid4().hex[:8]}")  # one run, whatever the shards
        self.log = logger.bind(role="learner", peer=self.peer_id)
        self.spec = probe_spec(config.env.id, config.env.max_episode_steps)
        core_cls = ImpalaLearner if config.algo.mode == "impala" else PPOLearner
        self.core: LearnerCore = core_cls(config, self.spec, self.group)
        self.version = 0
        self.progress = Progress()
        self.published: list[P.Message] = []
        """The messages of the newest published version (sent again after a re-welcome)."""
        self.hashes: dict[int, str] = {}
        self.lag: dict[str, int] = {}
        """Per actor: staleness of its newest trajectory (learner version - its version)."""
        self.lag_medians: deque[float] = deque(maxlen=LAG_WINDOW)
        self.next_stats = 0.0
        self.link: BrokerLink | None = None
        self.channel: DataChannel | None = None
        self.max_chunk_bytes = 1 << 30
        self.poll_ms = SHARDED_POLL_MS if self.group.sharded else RECV_POLL_MS
        self.pending: list[tuple[P.Trajectory, bool]] = []
        """Trajectories to use first, and whether they are still to be counted: taken off a replaced
        data socket (not yet), or collected before the run was stopped mid-round (already)."""
        self.shard_trajectories = [0] * self.group.world_size
        """Trajectories each shard received (main shard's count): how the broker spread the stream."""
        self.batch: list[P.Trajectory] = []
        """This shard's part of the batch being collected."""
        self.last_row: dict[str, Any] = {}
        self.timing = {"updates": 0, "samples": 0, "wait_s": 0.0, "comm_s": 0.0}
        """Since the last stats report: updates, samples trained on, seconds waiting for data; and the
        group's collective seconds when it began."""
        self.last_checkpoint_updates = -1
        self.report_times: deque[float] = deque(maxlen=MEDIAN_WINDOW)
        """Seconds from a round's start to each actor's in-time report, over recent rounds."""
        self.stragglers: set[str] = set()
        """Actors that missed the last round: left out of the next round's quota until they keep up."""
        self.expected: set[str] = set()
        """The actors the current sync round waits for (set by the main shard, shared in the exchange)."""
        self.rollout_len = config.env.rollout_len
        self.fleet: dict[str, int] = {}
        """Connected actors and their env counts, as the broker last reported them."""
        self.fleet_version = 0
        """How many times ``fleet`` was read from the broker."""
        checkpoint = latest_checkpoint(Path(run_dir)) if resume else None
        if resume and checkpoint is None:
            raise ConfigError(f"--resume: no checkpoint in {Path(run_dir) / 'checkpoints'}")
        if checkpoint is not None:
            self._restore(load_checkpoint(checkpoint), checkpoint)
        self.runlog = RunLog(run_dir, config.to_dict(), resume_version=self.version if resume else None) \
            if self.main else None  # the main shard owns the run directory
        self.next_checkpoint_s = time.monotonic() + config.train.checkpoint_every_s

    # ---------------------------------------------------------------- main loop
    def run(self, stop: threading.Event) -> dict[str, Any]:
        hello = P.Hello(role="learner", peer_id=self.peer_id, run_id=self.run_id, run=self.config.to_dict(),
                        shard=self.group.rank, num_shards=self.group.world_size, **hello_fields())
        link = self.link = BrokerLink(self.connect, hello, context=self.ctx).start()
        crashed = False
        try:
            if link.wait_welcome(WELCOME_TIMEOUT_S) is None or link.refused:
                if link.refused:
                    raise Refused(link.refused)
                raise RuntimeError(f"no broker answered at {self.connect} within {WELCOME_TIMEOUT_S:.0f} s")
            self.channel = DataChannel(self.ctx, link, self.peer_id, link.welcome.max_message_bytes, self._window())
            # A chunk must fit the broker's message limit, with room for the small arrays beside chunk 0.
            self.max_chunk_bytes = max(1024, link.welcome.max_message_bytes // 2)
            if self.main:
                self._refresh_fleet()
            self._publish()
            if self.main:
                self.runlog.meta({"run_id": self.run_id, "mode": self.algo.mode, "resumed_from_version": self.version,
                                  "broker": self.connect, "shards": self.group.world_size})
                self.log.info(f"run {self.run_id}: {self.config.env.id}, mode {self.algo.mode}, batch "
                              f"{self.algo.batch_size} steps, {self.group.world_size} shard(s), version "
                              f"{self.version} published")
            step = self._round if self.algo.mode == "sync" else self._stream
            while not step(stop):
                self._report(link)
                if self.main:
                    self._maybe_checkpoint()
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:
            crashed = True  # the state may be half-updated: never write it over the last good checkpoint
            link.report_crash(exc)  # forensics: `zddrl status` shows why the learner died
            raise
        finally:
            summary = self._summary()
            if self.main:
                self.runlog.summary(summary)
                self._record_hosts()
                if not crashed:
                    self._checkpoint(final=True)
                self.runlog.close()
            if self.channel is not None:
                self.channel.close()
            link.close(reason="learner finished")
        return summary

    def _window(self) -> int:
        """Credit window. Async modes keep the group's near one batch: every message queued ahead of the
        learner is a version older by the time it is trained on."""
        if self.algo.mode == "sync":
            return CREDIT_WINDOW
        per_batch = math.ceil(self.algo.batch_size / (self.config.env.rollout_len * self.config.env.num_envs))
        return math.ceil(per_batch / self.group.world_size) + 1

    def _reconnect_if_needed(self) -> None:
        """After a new welcome: re-grant credit (the broker's restarted at zero) and re-publish the
        current parameters (a restarted broker has none). The data socket is kept while the learners
        port is the same, so trajectories already on their way are not lost."""
        link, channel = self.link, self.channel
        if link.generation == channel.generation:
            return
        self.log.warning("re-welcomed by the broker: granting credit and publishing parameters again")
        if link.endpoint("learners") == channel.endpoint:
            channel.regrant(link.generation)
        else:
            self.pending.extend((t, True) for t in map(self._take, channel.drain()) if t is not None)
            channel.close()
            channel = self.channel = DataChannel(self.ctx, link, self.peer_id, link.welcome.max_message_bytes,
                                                 self._window())
        for msg in self.published:
            channel.send(msg)

    # ---------------------------------------------------------------- polling, in step with the other shards
    def _poll(self, stop: threading.Event, control: dict[str, Any],
              use) -> tuple[list[dict], list[dict], dict[str, Any]]:
        """One poll of this shard's data socket, then one exchange with the other shards.

        ``use(msg) -> bool`` says whether a received trajectory goes into this shard's batch (it is
        appended to ``self.batch``). Returns every shard's records of this poll, those of trajectories the
        run cannot train on apart (counted here, by the main shard), and the main shard's ``control`` (its
        ``stop`` also set when any shard was asked to stop). Every shard calls this the same number of
        times: a round or batch ends at the same poll everywhere.
        """
        self._reconnect_if_needed()
        records = []
        msg, fresh = self._receive()
        why = self._mismatch(msg) if fresh else ""  # kept ones were checked when they came
        if why:
            records.append({"peer_id": msg.peer_id, "seq": msg.seq, "version": msg.policy_version, "invalid": why,
                            "fresh": False})
        elif msg is not None:
            taken = use(msg)
            if taken:
                self.batch.append(msg)
            records.append(_record(msg, fresh, taken))
        parts = self.group.exchange({"records": records, "stop": stop.is_set(),
                                     "control": control if self.main else None})
        control = dict(parts[0]["control"])
        control["stop"] = control.get("stop", False) or any(p["stop"] for p in parts)
        everything = sorted((r for p in parts for r in p["records"]), key=lambda r: (r["peer_id"], r["seq"]))
        if self.main:
            for i, part in enumerate(parts):
                self.shard_trajectories[i] += sum(r["fresh"] for r in part["records"])
            for r in everything:
                if "invalid" in r:
                    self._drop_invalid(r)
                elif r["fresh"]:
                    self._account(r)
        return [r for r in everything if "invalid" not in r], [r for r in everything if "invalid" in r], control

    # ---------------------------------------------------------------- one sync round
    def _round(self, stop: threading.Event) -> bool:
        """Collect version-v data until the batch is full, every expected actor reported, or the
        straggler timeout; then update and publish v+1. Returns True when the run is over."""
        started = time.monotonic()
        self.batch = []
        steps, reported, unusable = 0, set(), set()
        announced: set[str] | None = None
        timeout = self._straggler_timeout()
        fleet_seen, expected = -1, set()
        while True:
            control: dict[str, Any] = {}
            if self.main:
                if fleet_seen != self.fleet_version:  # set at the start, and again if an actor joined mid-round
                    fleet_seen, expected = self.fleet_version, self.fleet.keys() - self.stragglers
                control = {"stop": self._finished(), "late": time.monotonic() - started > timeout}
                if expected != announced:
                    control["expected"] = sorted(expected)
                    announced = expected
            records, invalid, control = self._poll(stop, control, lambda m: m.policy_version == self.version)
            # An actor whose rollout of this version the run cannot use has answered all the same: waiting
            # for it would end the round by the straggler rule at best, and never if no rollout was usable.
            unusable.update(r["peer_id"] for r in invalid if r["version"] == self.version)
            if "expected" in control:
                self.expected = set(control["expected"])
            for r in records:
                if r["used"]:
                    steps += r["env_steps"]
                    reported.add(r["peer_id"])
                    if self.main:
                        self.report_times.append(time.monotonic() - started)
                elif self.main:
                    self._drop_late(r)
            if control["stop"]:
                self.pending.extend((t, False) for t in self.batch)  # counted already
                return True
            if steps >= self.algo.batch_size:
                break
            if (steps or unusable) and self.expected and reported | unusable >= self.expected:
                break  # in sync mode each actor sends one rollout per version: nothing more will come
            if steps and control["late"]:
                if self.main:
                    self.log.info(f"round {self.version} closed by the straggler rule after {timeout * 1000:.0f} ms "
                                  f"with {steps} of {self.algo.batch_size} steps; late: "
                                  f"{sorted(self.expected - reported - unusable)}")
                break
        round_s = time.monotonic() - started
        if not steps and self.main:
            self.log.warning(f"round {self.version}: no rollout could be used ({sorted(unusable)}); version "
                             f"{self.version + 1} keeps the weights so that the actors sample again")
        figures, update_s = self._train(self.batch, round_s)  # an empty batch takes no optimizer step
        if self.main:
            self._refresh_fleet(reported | unusable)
        self._publish()
        if self.main:
            self._log_update(figures, round_s, update_s, len(reported))
        return False

    def _receive(self) -> tuple[P.Trajectory | None, bool]:
        """The next trajectory of this run (its credit returned) and whether it is new, or (None, False)
        after a quiet poll. Trajectories kept from earlier come first."""
        if self.pending:
            return self.pending.pop(0)
        msg = self.channel.recv(self.poll_ms)
        if isinstance(msg, P.Trajectory):
            self.channel.ack()  # only trajectories cost credit
        msg = self._take(msg)
        return msg, msg is not None

    def _take(self, msg: P.Message | None) -> P.Trajectory | None:
        """A trajectory of this run; anything else is ignored."""
        if not isinstance(msg, P.Trajectory):
            return None
        if msg.run_id != self.run_id:  # another run's data (a broker serving two runs): never trained on
            self.log.warning(f"ignored a trajectory of run {msg.run_id!r} from {msg.peer_id}")
            return None
        return msg

    def _mismatch(self, msg: P.Trajectory) -> str:
        """Why this run cannot train on ``msg`` (rollouts.mismatch), or "". IMPALA stacks rollouts
        time-major, so there every one must have the run's length."""
        try:
            return mismatch(msg.arrays, self.core.spec, self.rollout_len if self.algo.mode == "impala" else None)
        except Exception as exc:  # noqa: BLE001 - whatever the data, a check that fails refuses it, never the run
            return f"its check failed ({type(exc).__name__}: {exc})"

    def _train(self, batch: list[P.Trajectory], round_s: float,
               staleness: float = 0.0) -> tuple[dict[str, float], float]:
        """One update on ``batch`` (this shard's part) after ``round_s`` s of collecting; the version moves
        on. Returns the figures and the seconds the update took."""
        t0 = time.monotonic()
        batch.sort(key=lambda t: (t.peer_id, t.seq))  # arrival order must not change what is learned
        figures = self.core.update(batch, staleness=staleness)
        self.progress.updates += 1
        self.version += 1
        update_s = time.monotonic() - t0
        self.timing["updates"] += 1
        self.timing["samples"] += int(figures.get("batch_steps", 0))
        self.timing["wait_s"] += round_s
        return figures, update_s

    # ---------------------------------------------------------------- async / impala
    def _stream(self, stop: threading.Event) -> bool:
        """Take data as it arrives; drop what is more than ``max_staleness`` versions old; update once
        a batch is full; publish every ``publish_every`` updates. Actors never wait. Returns True when
        the run is over."""
        started = time.monotonic()
        self.batch = []
        used: list[tuple[str, int, int]] = []
        steps = 0
        while steps < self.algo.batch_size:
            control = {"stop": self._finished()} if self.main else {}
            records, _, control = self._poll(stop, control,
                                             lambda m: 0 <= self.version - m.policy_version <= self.algo.max_staleness)
            for r in records:
                if r["used"]:
                    steps += r["env_steps"]
                    used.append((r["peer_id"], self.version - r["version"], r["env_steps"]))
                elif self.main:
                    self._drop_stale(r, self.version - r["version"])
            if control["stop"]:
                self.pending.extend((t, False) for t in self.batch)  # counted already
                return True
        round_s = time.monotonic() - started
        staleness = np.repeat([s for _, s, _ in used], [n for _, _, n in used])
        figures, update_s = self._train(self.batch, round_s, float(staleness.mean()))
        if self.progress.updates % self.algo.publish_every == 0:
            self._publish()
        if self.main:
            hist = np.bincount(staleness)
            figures.update(staleness_mean=float(staleness.mean()), staleness_max=int(staleness.max()),
                           staleness_hist=" ".join(f"{v}:{n}" for v, n in enumerate(hist) if n))
            self._watch_lag()
            self._log_update(figures, round_s, update_s, len({peer_id for peer_id, _, _ in used}))
        return False

    def _report(self, link: BrokerLink) -> None:
        """Stats for `zddrl status`, at most once per STATS_EVERY_S."""
        now = time.monotonic()
        if now < self.next_stats:
            return
        elapsed = now - self.next_stats + STATS_EVERY_S
        self.next_stats = now + STATS_EVERY_S
        ret = self.return_mean()
        timing, self.timing = self.timing, {"updates": 0, "samples": 0, "wait_s": 0.0, "comm_s": self.group.comm_s}
        shard = {"shard": self.group.rank, "shards": self.group.world_size,
                 "updates_per_s": timing["updates"] / elapsed, "samples_per_s": timing["samples"] / elapsed, "wait_data_share": timing["wait_s"] / elapsed,
                 "collective_share": (self.group.comm_s - timing["comm_s"]) / elapsed, "rss_mb": rss_mb(),
                 "policy_version": self.version}
        if not self.main:  # the run's figures are the main shard's to report
            link.send(P.Stats(peer_id=self.peer_id, role="learner", stats=shard))
            return
        row = {k: v for k, v in self.last_row.items() if k in REPORTED_FIGURES and isinstance(v, (int, float, str))}
        link.send(P.Stats(peer_id=self.peer_id, role="learner", stats={
            **row, **shard, "updates": self.progress.updates, "env_steps": self.total_env_steps(),
            "return_mean_20": None if math.isnan(ret) else ret,
            **{f"lag/{actor}": lag for actor, lag in self.lag.items()},
            "dropped_late": sum(self.progress.dropped_late.values()),
            "dropped_stale": sum(self.progress.dropped_stale.values()),
            "dropped_invalid": sum(self.progress.dropped_invalid.values())}))

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
        self.fleet_version += 1
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

    # ---------------------------------------------------------------- publishing and reporting
    def _publish(self) -> None:
        """The main shard publishes the current parameters; every shard first checks that all hold the
        same ones (the all-reduce keeps them identical: a difference is a bug, never data to act on)."""
        flat, layout, extra = self.core.params()
        if self.group.sharded:
            hashes = self.group.exchange(P.param_hash(flat))
            if len(set(hashes)) != 1:
                raise ShardError(f"learner shards diverged at version {self.version}: parameter hashes {hashes}")
        if not self.main:
            return
        lc = self.config.learner
        self.published = split_params(run_id=self.run_id, peer_id=self.peer_id, version=self.version, flat=flat,
                                      layout=layout, extras=extra, meta={"rollout_len": self.rollout_len},
                                      chunk_bytes=min(lc.param_chunk_bytes, self.max_chunk_bytes), dtype=lc.param_dtype)
        self.hashes[self.version] = self.published[0].param_hash  # what actors acting with it report
        for msg in self.published:
            self.channel.send(msg)


def _record(msg: P.Trajectory, fresh: bool, used: bool) -> dict[str, Any]:
    """What the other shards need to know of a received trajectory: enough to count it (steps,
    episodes, staleness, the parameter-hash check), not its arrays."""
    total = msg.info.get("total_env_steps")
    return {"peer_id": msg.peer_id, "seq": msg.seq, "version": msg.policy_version, "env_steps": msg.env_steps,
            "total_env_steps": total if isinstance(total, int) else None, "param_hash": msg.param_hash,
            "incarnation": msg.info.get("incarnation") if isinstance(msg.info.get("incarnation"), str) else None,
            "ep_returns": msg.ep_returns, "fresh": fresh, "used": used}
