"""Learner node: the transport shell around an algorithm core; one process per learner shard.

It announces the run (hello with the run spec), publishes version-0 parameters, then loops: collect a
batch (``rounds.SyncRounds`` under the sync schedule, ``rounds.AsyncStream`` under the async one), one update of
the core, publish (every round when sync, every ``learner.publish_every`` updates otherwise), report, and
checkpoint. When sync, a round with no usable rollout publishes v+1 with the weights unchanged, so
that actors (which wait for a newer version) sample again.

Shards (``zddrl learner --gpus``): every shard takes its own share of the stream from the broker and polls
in step with the others (``poll.ShardPoller``); each trains on its own trajectories with gradients
averaged over the group (``zddrl.shards.group``); the main shard (rank 0) alone counts (``ledger.Ledger``),
sizes rounds from the fleet (``fleet.FleetPlan``), publishes, logs and checkpoints.
"""

from __future__ import annotations

import math
import threading
import time
import uuid
from pathlib import Path
from typing import Any, NamedTuple

import zmq
from loguru import logger

from zddrl import keys
from zddrl import protocol as P
from zddrl.algos.core import CORE_FIGURES, LearnerCore
from zddrl.algos.replay_learner import REPLAY_FIGURES
from zddrl.algos.rollout import mismatch
from zddrl.algos.spec import AlgorithmSpec, algorithm_of, declared, feed, sent_arrays
from zddrl.config import Config, ConfigError
from zddrl.envs import EnvSpec, probe_spec
from zddrl.intake.admit import AskedLengths, envs_bound, envs_of, refusal
from zddrl.intake.window import stream_window
from zddrl.learner.checkpoints import Checkpoints, check_run_dir
from zddrl.learner.evaluation import Evaluator
from zddrl.learner.fleet import FleetPlan
from zddrl.learner.ledger import Ledger
from zddrl.learner.poll import ShardPoller
from zddrl.learner.progress import PROGRESS_LINE_EVERY_S, Progress, progress_line
from zddrl.learner.rounds import AsyncStream, CollectedBatch, ServiceFeed, SyncRounds
from zddrl.learner.runlog import RunLog, load_checkpoint
from zddrl.learner.welcome import NotJoined as NotJoined  # re-exported: the CLI catches it with the node
from zddrl.learner.welcome import await_welcome
from zddrl.proc import rss_mb
from zddrl.replay.client import RemoteReplay
from zddrl.shards.group import ShardError, ShardGroup
from zddrl.transport import signatures as signing
from zddrl.transport.channel import CREDIT_WINDOW, DataChannel
from zddrl.transport.link import BrokerLink, hello_fields
from zddrl.transport.params import split as split_params

FIRST_FLEET_TIMEOUT_S = 2.0
"""How long a learner waits for the fleet message that follows its welcome before it publishes version 0 (the
rollout length it publishes depends on the fleet); without one it publishes with ``env.rollout_len``."""
STATS_EVERY_S = 1.0
RUN_FIGURES = ("staleness_mean", "staleness_max", "staleness_hist", "sps", "eval_return", *REPLAY_FIGURES)
"""Figures of the run, whatever its algorithm, that go to `zddrl status` with the learner's stats (the algorithm's
own follow: its spec's ``figures``)."""


def run_bus_of(config: Config, spec: AlgorithmSpec, env: EnvSpec) -> dict[str, Any]:
    """The ``bus`` of the run's learner hello: how it learns (``config.hello_bus``) and the algorithm's declared
    arrays (docs/protocol.md 5.1 and 7.1); ConfigError (one line) for a declaration the brokers would refuse."""
    bus = config.hello_bus()
    arrays = [a.to_wire() for a in sent_arrays(spec, config, env)]
    if arrays:
        bus[P.BUS_ARRAYS] = arrays
    why = P.bus_refusal(bus)
    if why:
        raise ConfigError(f"algo.name {config.algo.name!r}: {why}")
    return bus


class MainShard(NamedTuple):
    ledger: Ledger
    runlog: RunLog
    checkpoints: Checkpoints
    fleet: FleetPlan
    evaluator: Evaluator


class LearnerNode:
    """``LearnerNode(connect, config, run_dir).run(stop) -> summary``; one per shard."""

    link: BrokerLink
    """The control link (set by ``run``)."""
    poller: ShardPoller
    """This shard's data socket, polled in step with the others (set by ``run``, once welcomed)."""

    def __init__(
        self,
        connect: str,
        config: Config,
        run_dir: str | Path,
        *,
        t0: float | None = None,
        peer_id: str | None = None,
        context: zmq.Context | None = None,
        resume: bool = False,
        group: ShardGroup | None = None,
        credentials: keys.Credentials | None = None,
        replays: tuple[str, ...] = (),
        replay_public: bytes = b"",
    ) -> None:
        self.connect = connect
        self.replays, self.replay_public = replays, replay_public
        """``replay.placement = "service"``: the replay services' endpoints, and their CURVE public key (closed bus)."""
        self.credentials = credentials
        """With keys: ``credentials.signer`` signs the run spec and every version this learner publishes."""
        self.config = config
        self.algo = config.algo
        self.group = group or ShardGroup()
        self.main = self.group.is_main
        self.peer_id = peer_id or f"learner-{self.group.rank}"
        self.ctx = context or zmq.Context.instance()
        self.run_id = self.group.broadcast(f"{config.name}-{uuid.uuid4().hex[:8]}")  # one run, whatever the shards
        self.log = logger.bind(role="learner", peer=self.peer_id)
        self.spec = probe_spec(config.env)
        self.algorithm = algorithm_of(config)
        self.bus = run_bus_of(config, self.algorithm, self.spec)
        """What the brokers need of the run (the hello's ``bus``): the run spec is opaque to them."""
        self.declared = P.run_bus(self.bus).arrays
        """The algorithm's declared trajectory arrays, which this shard checks too (docs/protocol.md section 7.1)."""
        self.feed = feed(self.algorithm, config)
        """Where the core's data comes from (``spec.FEEDS``): rollouts, a replay buffer in the core, replay services."""
        self.figures = declared(self.algorithm, CORE_FIGURES)
        """Everything an update of this algorithm may report, by name."""
        self.core: LearnerCore = self.algorithm.learner(config, self.spec, self.group)
        self.policy_version = 0
        self.rollout_len = config.env.rollout_len
        """Per-env rollout length the actors are told to sample (sync mode sizes it from the fleet)."""
        progress = None
        checkpoint = check_run_dir(config, Path(run_dir), resume)
        if checkpoint is not None:
            progress = self._restore(load_checkpoint(checkpoint), checkpoint)
        self.lengths = AskedLengths(self.rollout_len)
        """Per-env rollout lengths the latest versions asked for: what bounds a rollout's size (``intake/admit.py``)."""
        self.run_dir, self.resume, self.restored = Path(run_dir), resume, progress
        """Where ``open_run`` writes the run; whether it continues it; the checkpoint's counting (None: a new run)."""
        self.t0 = t0 if t0 is not None else time.time()
        self.own: MainShard | None = None
        """What the main shard alone keeps: the run's counting, its directory, its checkpoints, its fleet. Made
        (``open_run``) once a broker welcomed the learner: a learner that never joins writes no run directory."""
        self.remote: RemoteReplay | None = None
        """The replay services' link (``replay.placement = "service"``), once joined."""
        self.updates = progress.updates if progress is not None else 0
        self.max_chunk_bytes = 1 << 30
        self.next_stats = 0.0
        self.next_progress_line = 0.0
        """Monotonic time of the next progress line (the main shard's, at most every PROGRESS_LINE_EVERY_S)."""
        self.timing = {"updates": 0, "samples": 0, "wait_s": 0.0, "comm_s": 0.0}
        """Since the last stats report: updates, samples trained on, seconds waiting for data; and the
        group's collective seconds when it began."""

    def open_run(self) -> MainShard:
        """The main shard's record of the run, from here on in its run directory (written now)."""
        config, resume_version = self.config, self.policy_version if self.resume else None
        runlog = RunLog(self.run_dir, config.to_dict(), resume_version, tuple(self.figures.values()))
        return MainShard(
            Ledger(config, self.log, self.t0, self.group.world_size, self.restored, confirm=self._confirm_target),
            runlog,
            Checkpoints(runlog, config.train),
            FleetPlan(
                config.env.num_envs,
                self.algo.batch_size,
                self.rollout_len,
                self.log,
                sizes_rollouts=self.algo.schedule == "sync",
            ),
            Evaluator(config),
        )

    # ---------------------------------------------------------------- main loop
    def run(self, stop: threading.Event) -> dict[str, Any]:
        hello = P.Hello(
            role="learner",
            peer_id=self.peer_id,
            run_id=self.run_id,
            run=self.config.to_dict(),
            shard=self.group.rank,
            num_shards=self.group.world_size,
            bus=self.bus,
            **hello_fields(),
        )
        if self._signer is not None:
            hello = signing.signed_hello(hello, self._signer)
        if self.main:
            self.log.info(f"connecting to the broker at {self.connect}")
        link = self.link = BrokerLink(self.connect, hello, context=self.ctx, credentials=self.credentials).start()
        crashed = False
        try:
            collector = self._join(link, stop)
            own = self.own
            while self._step(collector.collect(stop, self.policy_version)):
                self._report()
                if own is not None and own.checkpoints.due(self.updates):
                    self._checkpoint(own)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:
            crashed = True  # the state may be half-updated: never write it over the last good checkpoint
            link.report_crash(exc)  # forensics: `zddrl status` shows why the learner died
            raise
        finally:
            summary = self._finish(crashed)
            link.close(reason="learner finished")
        return summary

    def _join(self, link: BrokerLink, stop: threading.Event) -> SyncRounds | AsyncStream | ServiceFeed:
        """Once welcomed: open the run directory and the data channel, publish the current version, record the
        run; the collector."""
        welcome = await_welcome(link, stop, self.connect)
        if self.main:
            self.own = self.open_run()
        service = self.feed == "replay_service"
        window, limit = (0 if service else self._window()), welcome.max_message_bytes  # service: the replays' data
        self.poller = ShardPoller(
            link,
            lambda: DataChannel(link, self.peer_id, limit, window),
            self.run_id,
            self.group,
            self._mismatch,
            self.log,
            self._asked_len if self.own is not None else None,
            self.rollout_len,
            admit=self._admit,
        )
        # A chunk must fit the broker's message limit, with room for the small arrays beside chunk 0.
        self.max_chunk_bytes = max(1024, limit // 2)
        if self.own is not None:  # size the first rollouts from the fleet the broker announces after the welcome
            self.own.fleet.refresh(link.wait_fleet(FIRST_FLEET_TIMEOUT_S))
        self._publish()
        own = self.own
        if own is not None:
            meta = {
                "run_id": self.run_id,
                "algorithm": self.algo.name,
                "schedule": self.algo.schedule,
                "resumed_from_version": self.policy_version,
                "broker": self.connect,
                "shards": self.group.world_size,
                "autocast": self.core.autocast._asdict(),
            }
            own.runlog.meta(meta)
            cast = self.core.autocast
            self.log.info(f"learner.autocast {self.config.learner.autocast}: {cast.mode} ({cast.reason})")
            self.log.info(
                f"run {self.run_id}: {self.config.env.id}, {self.algo.name} ({self.algo.schedule}), "
                f"batch {self.algo.batch_size} steps, {self.group.world_size} shard(s), "
                f"version {self.policy_version} published"
            )
        ledger = own.ledger if own is not None else None
        if service:
            return self._service_feed(ledger)
        if self.algo.schedule != "sync":
            return AsyncStream(self.poller, self.config, ledger, self.log)
        fleet = own.fleet if own is not None else None
        return SyncRounds(self.poller, self.config, self.log, fleet, ledger, self._refresh_fleet)

    def _service_feed(self, ledger: Ledger | None) -> ServiceFeed:
        """The service placement: sample from the replays (``zddrl/replay/client.py``) instead of a buffer here."""
        remote = RemoteReplay(
            list(self.replays),
            self.config,
            self.spec,
            self.run_id,
            self.peer_id,
            context=self.ctx,
            credentials=self.credentials,
            replay_public=self.replay_public,
            report=self.main,
        )
        remote.rollout_len = self.rollout_len
        self.remote = remote
        attach = getattr(self.core, "attach", None)  # a replay core (zddrl.algos.replay_learner.ReplayLearner)
        if attach is None:
            raise ConfigError(f"algo.name {self.algo.name!r}: its core has no attach(source) for the replay services")
        attach(remote)
        self.log.info(f"replay placement 'service': sampling from {', '.join(self.replays)}")
        return ServiceFeed(self.poller, remote, self.algo, ledger, self.group)

    def _step(self, got: CollectedBatch) -> bool:
        """One update on a collected batch, then publish and log; False when the run is over."""
        if got.stopped:
            return False
        t0 = time.monotonic()
        got.batch.sort(key=lambda t: (t.peer_id, t.seq))  # arrival order must not change what is learned
        figures = self.core.update(got.batch, staleness=got.staleness)  # an empty batch takes no optimizer step
        self.updates += 1
        self.policy_version += 1
        update_s = time.monotonic() - t0
        self.timing["updates"] += 1
        self.timing["samples"] += int(figures.get("batch_steps", 0))
        self.timing["wait_s"] += got.round_s
        if publish_due(self.algo.schedule, self.updates, self.config.learner.publish_every):
            self._publish()
        self.lengths.asked(self.rollout_len)
        if self.own is not None:
            ledger = self.own.ledger
            ledger.progress.updates = self.updates
            figures.update(got.figures or {})
            evaluator = self.own.evaluator
            if evaluator.due(ledger.env_steps()):
                ledger.progress.eval_return = evaluator.run(self.core.greedy, ledger.env_steps())
                figures["eval_s"] = evaluator.last_s
            if self.algo.schedule != "sync":
                ledger.watch_lag()
            row = ledger.row(
                figures,
                policy_version=self.policy_version,
                skipped_steps=self.core.skipped_steps,
                actors=got.actors,
                rollout_len=self.rollout_len,
                round_s=got.round_s,
                update_s=update_s,
            )
            self.own.runlog.write(row)
            self._progress_line(row)
        return True

    def _progress_line(self, row: dict[str, Any]) -> None:
        """The line `zddrl train` shows, logged: a standalone learner is otherwise silent until its summary."""
        now = time.monotonic()
        if now < self.next_progress_line:
            return
        self.next_progress_line = now + PROGRESS_LINE_EVERY_S
        line = progress_line(row["wall_s"], row["env_steps"], row["sps"], row["return_mean_20"], self.policy_version)
        self.log.info(line)

    def _finish(self, crashed: bool) -> dict[str, Any]:
        summary = self._summary()
        own = self.own
        if own is not None:
            own.runlog.summary(summary)
            own.fleet.flush_log()
            own.runlog.meta({"hosts": sorted(own.fleet.hosts), "actors": sorted(own.fleet.actors)})
            if not crashed:
                self._checkpoint(own, final=True)
            own.runlog.close()
        if hasattr(self, "poller"):
            self.poller.close()
        if self.remote is not None:
            self.remote.close()
        return summary

    def _window(self) -> int:
        """Credit window: sync rounds keep a deep one; async schedule keeps the group's near one batch."""
        return CREDIT_WINDOW if self.algo.schedule == "sync" else stream_window(self.config, self.group.world_size)

    def _refresh_fleet(self) -> bool:
        """Main shard: take the broker's newest fleet message; True when it changed."""
        return self.own is not None and self.own.fleet.refresh(self.link.fleet())

    def _asked_len(self) -> int:
        """Main shard: the longest per-env rollout length asked lately, or about to be (the fleet may have changed)."""
        fleet_len = self.own.fleet.rollout_len if self.own is not None else 0
        return max(self.lengths.most(), self.rollout_len, fleet_len)

    def _admit(self, msg: P.Trajectory) -> str:
        """Why ``msg`` is refused on its shapes and header numbers (``admit.refusal``), before any array is read."""
        envs = envs_of(msg.peer_id, self.link.fleet(), self.config.env.num_envs, envs_bound(self.config))
        return refusal(
            msg.arrays["rewards"].shape, msg.policy_version, self.policy_version, self.poller.asked_len, envs
        )

    def _confirm_target(self) -> float:
        """Main shard: the learner's own evaluation of the current network, confirming a training return's target."""
        assert self.own is not None
        return self.own.evaluator.confirm(self.core.greedy)

    def _mismatch(self, msg: P.Trajectory) -> str:
        """Why this run cannot train on ``msg`` (algos.rollout.mismatch), or "". An algorithm that stacks rollouts
        time-major (IMPALA) takes only the run's length."""
        try:
            T = self.rollout_len if self.algorithm.fixed_rollout_len else None
            bounded = self.algorithm.bounded_actions
            return (
                self.declared.refusal_of(msg.arrays)
                or mismatch(msg.arrays, self.core.spec, T, bounded)
                or self.core.refusal(msg.arrays)
            )
        except Exception as exc:  # noqa: BLE001 - whatever the data, a check that fails refuses it, never the run
            return f"its check failed ({type(exc).__name__}: {exc})"

    # ---------------------------------------------------------------- publishing and reporting
    @property
    def _signer(self) -> signing.Signer | None:
        return self.credentials.signer if self.credentials is not None else None

    def _publish(self) -> None:
        """The main shard publishes the current parameters; every shard first checks that all hold the
        same ones (the all-reduce keeps them identical: a difference is a bug, never data to act on)."""
        flat, layout, extra = self.core.params()
        if self.group.sharded:
            hashes = self.group.exchange(P.param_hash(flat))
            if len(set(hashes)) != 1:
                raise ShardError(f"learner shards diverged at version {self.policy_version}: parameter hashes {hashes}")
        own = self.own
        if own is None:
            return
        self.rollout_len = own.fleet.publish(self.policy_version)
        lc = self.config.learner
        messages = split_params(
            run_id=self.run_id,
            peer_id=self.peer_id,
            version=self.policy_version,
            flat=flat,
            layout=layout,
            extras=extra,
            meta={"rollout_len": self.rollout_len},
            chunk_bytes=min(lc.param_chunk_bytes, self.max_chunk_bytes),
            dtype=lc.param_dtype,
            signer=self._signer,
        )
        head = messages[0]
        if not isinstance(head, P.Parameters):
            raise TypeError(f"split() must put the version's params message first, not {type(head).__name__}")
        own.ledger.published(self.policy_version, head.param_hash)  # what actors acting with it report
        self.poller.send_params(messages)

    def _report(self) -> None:
        """Stats for `zddrl status`, at most once per STATS_EVERY_S."""
        now = time.monotonic()
        if now < self.next_stats:
            return
        self._refresh_fleet()  # sync rounds read it every poll; the async schedule only keeps its hosts
        elapsed = now - self.next_stats + STATS_EVERY_S
        self.next_stats = now + STATS_EVERY_S
        timing, self.timing = self.timing, {"updates": 0, "samples": 0, "wait_s": 0.0, "comm_s": self.group.comm_s}
        stats: dict[str, Any] = {
            "shard": self.group.rank,
            "shards": self.group.world_size,
            "updates_per_s": timing["updates"] / elapsed,
            "samples_per_s": timing["samples"] / elapsed,
            "wait_data_share": timing["wait_s"] / elapsed,
            "collective_share": (self.group.comm_s - timing["comm_s"]) / elapsed,
            "rss_mb": rss_mb(),
            "policy_version": self.policy_version,
        }
        if self.own is not None:  # the run's figures are the main shard's to report
            ledger = self.own.ledger
            ret = ledger.return_mean()
            stats = {
                **{
                    k: v
                    for k, v in ledger.last_row.items()
                    if (k in RUN_FIGURES or k in self.figures) and isinstance(v, (int, float, str))
                },
                **stats,
                "updates": self.updates,
                "env_steps": ledger.env_steps(),
                "return_mean_20": None if math.isnan(ret) else ret,
                **{f"lag/{actor}": lag for actor, lag in ledger.lag.items()},
                **ledger.drops(),
            }
        self.link.send(P.Stats(peer_id=self.peer_id, role="learner", stats=stats))

    def _summary(self) -> dict[str, Any]:
        run = {
            "policy_version": self.policy_version,
            "algorithm": self.algo.name,
            "schedule": self.algo.schedule,
            "seed": self.config.env.seed,
            "run_id": self.run_id,
            "shards": self.group.world_size,
        }
        if self.remote is not None:  # the service placement: how this shard's conversation with the replays went
            run["replay_service"] = dict(self.remote.counters)
        return self.own.ledger.summary(**run) if self.own is not None else {"updates": self.updates, **run}

    # ---------------------------------------------------------------- checkpoints
    def _checkpoint(self, own: MainShard, final: bool = False) -> None:
        ledger = own.ledger
        state = {
            **self.core.state(),
            "policy_version": self.policy_version,
            "config": self.config.to_dict(),
            "progress": ledger.progress.state(ledger.wall_s()),
            "rollout_len": self.rollout_len,
            "env_steps": ledger.env_steps(),
        }
        path = own.checkpoints.write(state, self.policy_version, self.updates, final)
        self.log.debug(f"checkpoint {path.name} written")

    def _restore(self, state: dict[str, Any], path: Path) -> Progress:
        """Continue where the checkpoint stopped: weights, optimizer, schedules, statistics, RNG, counters.
        The checkpoint's own [env] and [model] must be this config's (the run directory's config.toml was
        checked already; this holds even where that file is gone)."""
        saved = state.get("config", {})
        for section in ("env", "model"):
            if saved.get(section) != self.config.to_dict()[section]:
                raise ConfigError(
                    f"--resume: the [{section}] of {path.name} differs from this config; resume "
                    f"with the run's own config.toml"
                )
        self.core.load_state(state)
        self.policy_version = int(state["policy_version"])
        self.rollout_len = int(state.get("rollout_len", self.rollout_len))
        progress = Progress.from_state(state["progress"])
        self.log.info(
            f"resumed from {path}: version {self.policy_version}, {progress.env_steps()} env steps, "
            f"{progress.updates} updates"
        )
        return progress


def publish_due(schedule: str, updates: int, publish_every: int) -> bool:
    """The sync schedule publishes every round (actors wait for it); the async one every ``publish_every`` updates."""
    return schedule == "sync" or updates % publish_every == 0
