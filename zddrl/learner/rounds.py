"""How a learner collects a batch: a sync round (distributed PPO), a batch of the async stream, or the replay services'
intake.

Sync: a round collects trajectories of the current version v until the batch is full (``algo.batch_size`` env
steps summed over actors), every expected actor has reported, or the round has taken more than
``learner.straggler_factor`` times the normal round; late data for a closed version is dropped and counted, never
trained on. Each actor is judged by its own typical report time (the median of its recent in-time reports, from
the round's start): the **normal round** is the latest typical time among the actors the round waits for, leaving
out any whose typical time is more than ``straggler_factor`` times the fleet's median one (the lower median: of
two actors, the faster). So a round of many actors on few cores, where the last report normally comes well after
the median one, is not cut short by a scheduler hiccup (its data would be dropped), and an actor that is
consistently several times slower than the others never sets the normal round itself (it would be waited for
forever). A rollout the run refuses is no answer: its actor has not reported (otherwise one key sending refused
rollouts quickly could close every round before the others' data came, and freeze learning). The round waits for
it as for any actor, up to the straggler timeout, after which it is a straggler; the timeout also closes a round
in which no rollout could be used, and its next version keeps the weights so that the actors sample again. Every
accepted rollout, in time or late, tells the fleet what its actor is worth in env columns (``FleetPlan.delivered``):
rollouts are sized from what actors deliver, not from what they claim.

Async and IMPALA: take data as it arrives, drop what is more than ``bus.max_staleness`` versions old, until a
batch is full. Actors never wait.

Replay services (``replay.placement = "service"``, ``ServiceFeed``): the replays take the run's data in (``zddrl
replay``); a collect ends once they have taken in a batch's worth of env steps, and its batch is empty: the update
samples from them (``zddrl.replay.client.RemoteReplay``).

All return a ``CollectedBatch`` (this shard's part of the batch and what the update's row needs), or one with
``stopped`` set when the run is over. Counting (``Ledger``) and the fleet are the main shard's alone.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import numpy as np
from loguru import logger

from zddrl import protocol as P
from zddrl.config import AlgoConfig, Config
from zddrl.learner.fleet import FleetPlan
from zddrl.learner.ledger import Ledger
from zddrl.learner.poll import Polled, ShardPoller
from zddrl.replay.client import RemoteReplay
from zddrl.shards.group import ShardGroup

FIRST_ROUNDS_TIMEOUT_S = 10.0
"""Straggler timeout until an actor has reported in time once."""
ACTOR_WINDOW = 20
"""Recent in-time report times of an actor that its typical time is the median of."""
SERVICE_POLL_S = 0.002
"""Between figures-only requests while a service batch is being collected."""
WAITING_LINE_EVERY_S = 30.0
"""How often the main shard says it still waits for the first trajectory of any actor."""


class WaitingLine:
    """``tick(ledger)`` after each poll: while no actor has sent a trajectory, one line every
    ``WAITING_LINE_EVERY_S``, so that a standalone learner with no actors yet does not look hung."""

    def __init__(self, log: Any) -> None:
        self.log = log
        self.started = time.monotonic()
        self.next_s = self.started + WAITING_LINE_EVERY_S

    def tick(self, ledger: Ledger | None) -> None:
        if ledger is None or "wall_s_first_trajectory" in ledger.first_s:
            return
        now = time.monotonic()
        if now >= self.next_s:
            self.next_s = now + WAITING_LINE_EVERY_S
            self.log.info(f"waiting for actors: none has sent a trajectory yet ({now - self.started:.0f} s)")


class CollectedBatch(NamedTuple):
    batch: list[P.Trajectory]
    """This shard's part of the batch (arrival order; the update sorts it)."""
    round_s: float
    actors: int
    """Actors whose data is in the batch."""
    staleness: float = 0.0
    """Mean staleness of the global batch's env steps, in versions (0 in sync mode by construction)."""
    figures: dict[str, Any] | None = None
    """Staleness figures for the update's metrics row (async schedule)."""
    stopped: bool = False


def _account(ledger: Ledger | None, polled: Polled, version: int) -> None:
    """Main shard: every received trajectory counts (steps, episodes), used or not; unusable ones are dropped."""
    if ledger is None:
        return
    ledger.received(polled.received)
    for r in polled.invalid:
        ledger.drop_invalid(r)
    for r in polled.records:
        if r.fresh:
            ledger.account(r, version)


class SyncRounds:
    """``collect(stop, version)`` runs one round. ``fleet`` and ``ledger`` are the main shard's (None on the
    others); ``refresh_fleet()`` reads the broker's newest fleet message into ``fleet``."""

    def __init__(
        self,
        poller: ShardPoller,
        config: Config,
        log: Any,
        fleet: FleetPlan | None = None,
        ledger: Ledger | None = None,
        refresh_fleet: Callable[[], bool] = lambda: False,
    ) -> None:
        self.poller, self.algo, self.learner, self.log = poller, config.algo, config.learner, log
        self.fleet, self.ledger, self.refresh_fleet = fleet, ledger, refresh_fleet
        self.waiting = WaitingLine(log)
        self.report_times: defaultdict[str, deque[float]] = defaultdict(lambda: deque(maxlen=ACTOR_WINDOW))
        """Per actor: seconds from a round's start to its in-time reports, over recent rounds (main shard)."""

    def timeout_s(self, expected: set[str]) -> float:
        """``straggler_factor`` x the normal round of the actors in ``expected`` (floored); generous until known."""
        typical = {peer: statistics.median(times) for peer, times in self.report_times.items() if times}
        if not typical:
            return FIRST_ROUNDS_TIMEOUT_S
        factor = self.learner.straggler_factor
        bar = factor * statistics.median_low(typical.values())
        normal = max((t for peer, t in typical.items() if peer in expected and t <= bar), default=bar / factor)
        return max(self.learner.min_round_timeout_s, factor * normal)

    def collect(self, stop: threading.Event, version: int) -> CollectedBatch:
        started = time.monotonic()
        batch: list[P.Trajectory] = []
        steps = 0
        reported: set[str] = set()
        unusable: set[str] = set()
        expected: set[str] = set()
        announced: set[str] | None = None
        timeout = FIRST_ROUNDS_TIMEOUT_S
        fleet = self.fleet
        by_timeout = False
        while True:
            control: dict[str, Any] = {}
            if fleet is not None and self.ledger is not None:
                if self.refresh_fleet() or announced is None:  # the round's start, or an actor joined or left
                    expected = fleet.expected()
                    self._forget(fleet.actors.keys())
                    timeout = self.timeout_s(expected)
                control = {"stop": self.ledger.finished(), "late": time.monotonic() - started > timeout}
                if expected != announced:
                    control["expected"] = sorted(expected)
                    announced = expected
            polled = self.poller.poll(stop, control, lambda m: m.policy_version == version, batch)
            _account(self.ledger, polled, version)
            self.waiting.tick(self.ledger)
            control = polled.control
            unusable.update(r.peer_id for r in polled.invalid if r.policy_version == version)
            if "expected" in control:
                expected = set(control["expected"])
            for r in polled.records:
                if fleet is not None and r.fresh:
                    fleet.delivered(r.peer_id, r.policy_version, r.env_steps)
                if r.used:
                    steps += r.env_steps
                    reported.add(r.peer_id)
                    if fleet is not None:
                        self.report_times[r.peer_id].append(time.monotonic() - started)
                elif self.ledger is not None:
                    if fleet is not None and version - r.policy_version <= 1:
                        fleet.back_in_quota(r.peer_id)  # missed the round by less than one update: wait for it again
                    self.ledger.drop_late(r, version)
            if control["stop"]:
                self.poller.keep(batch)
                return CollectedBatch(batch, time.monotonic() - started, len(reported), stopped=True)
            if steps >= self.algo.batch_size:
                break
            if steps and expected and reported >= expected:
                break  # in sync mode each actor sends one rollout per version: nothing more will come
            if (steps or unusable) and control["late"]:
                by_timeout = True  # an actor whose rollout was refused has not reported: it becomes a straggler
                break
        round_s = time.monotonic() - started
        if fleet is not None:
            if not steps:
                self.log.warning(
                    f"round {version}: no rollout could be used ({sorted(unusable)}); version "
                    f"{version + 1} keeps the weights so that the actors sample again"
                )
            fleet.round_closed(expected, reported, by_timeout)
        return CollectedBatch(batch, round_s, len(reported))

    def _forget(self, actors: Iterable[str]) -> None:
        """Drop the report times of actors that left."""
        for peer in self.report_times.keys() - set(actors):
            del self.report_times[peer]


class AsyncStream:
    """``collect(stop, version)`` takes one batch of the stream (async PPO, IMPALA)."""

    def __init__(self, poller: ShardPoller, config: Config, ledger: Ledger | None = None, log: Any = logger) -> None:
        self.poller, self.algo, self.bus, self.ledger = poller, config.algo, config.bus, ledger
        self.waiting = WaitingLine(log)

    def collect(self, stop: threading.Event, version: int) -> CollectedBatch:
        started = time.monotonic()
        batch: list[P.Trajectory] = []
        used: list[tuple[str, int, int]] = []
        steps = 0
        max_staleness = self.bus.max_staleness
        while steps < self.algo.batch_size:
            control = {"stop": self.ledger.finished()} if self.ledger is not None else {}
            polled = self.poller.poll(stop, control, lambda m: 0 <= version - m.policy_version <= max_staleness, batch)
            _account(self.ledger, polled, version)
            self.waiting.tick(self.ledger)
            for r in polled.records:
                if r.used:
                    steps += r.env_steps
                    used.append((r.peer_id, version - r.policy_version, r.env_steps))
                elif self.ledger is not None:
                    self.ledger.drop_stale(r, version)
            if polled.control["stop"]:
                self.poller.keep(batch)
                return CollectedBatch(batch, time.monotonic() - started, 0, stopped=True)
        staleness = np.repeat([s for _, s, _ in used], [n for _, _, n in used])
        hist = np.bincount(staleness)
        mean = float(staleness.mean())
        figures = {
            "staleness_mean": mean,
            "staleness_max": int(staleness.max()),
            "staleness_hist": " ".join(f"{v}:{n}" for v, n in enumerate(hist) if n),
        }
        return CollectedBatch(batch, time.monotonic() - started, len({peer for peer, _, _ in used}), mean, figures)


class ServiceFeed:
    """The service placement's collector: ``collect(stop, version)`` returns once the replays took in
    ``algo.batch_size`` more env steps (an update's worth, as the local placement reads them), counting their
    reports in the main shard's ledger. The batch it returns is empty: the update samples from the replays. Shards
    end a collect together (the main shard decides, in the group's exchange)."""

    def __init__(
        self, poller: ShardPoller, remote: RemoteReplay, algo: AlgoConfig, ledger: Ledger | None, group: ShardGroup
    ) -> None:
        self.poller, self.remote, self.algo, self.ledger, self.group = poller, remote, algo, ledger, group

    def collect(self, stop: threading.Event, version: int) -> CollectedBatch:
        started, start = time.monotonic(), self.remote.taken
        remote = self.remote
        remote.policy_version = version
        while True:
            self.poller.keep_link()
            remote.room = max(0, self.algo.batch_size - (remote.taken - start))
            remote.refresh()
            ledger = self.ledger
            if ledger is not None:
                report = remote.take_reports()
                ledger.intake(report.env_steps, report.returns, report.invalid)
            control = {
                "stop": stop.is_set() or (ledger is not None and ledger.finished()),
                "done": remote.taken - start >= self.algo.batch_size,
            }
            if self.group.sharded:
                parts = self.group.exchange(control if self.group.is_main else None)
                control = {**parts[0], "stop": parts[0]["stop"] or stop.is_set()}
            if control["stop"]:
                return CollectedBatch([], time.monotonic() - started, 0, stopped=True)
            if control["done"]:
                remote.room = 0  # no intake while the update takes its gradient steps
                fleet = self.poller.link.fleet()
                return CollectedBatch([], time.monotonic() - started, len(fleet[1]) if fleet else 0)
            stop.wait(SERVICE_POLL_S)
