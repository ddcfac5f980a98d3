"""Fleet health: warnings the broker derives from what members report.

The broker is the one process that sees the whole fleet (every member's stats, every published
parameter version), so it is where conditions that no single process can see are judged: an actor
acting with parameters nobody published, two actors stepping the same seeds, one actor falling
behind the others. This module is the pure logic, without sockets or logging: the broker feeds
``HealthMonitor`` with each member's stats map (docs/protocol.md, stats) and each published
version, calls ``evaluate(now)`` on its periodic tick, logs what ``pop_events()`` returns and lists
``rows(now)`` in the status body under ``health``.

A warning is raised when its condition starts, keeps its onset time while the condition lasts
(its message follows the latest figures) and is cleared as soon as the condition ends, or when
the member leaves. The checks (thresholds are the named constants below), with the stats keys
they read:

* ``comm_share`` (``comm_share``): an actor spends more than COMM_SHARE_MAX of its wall time waiting
  for parameters or sending, COMM_SHARE_REPORTS reports in a row.
* ``unknown_params`` (``param_hash``, ``policy_version``): an actor acts with a parameter hash never
  published in this run. Versions older than the oldest one this broker saw are not judged (a
  restarted broker never saw them).
* ``stuck_version`` (``policy_version``): an actor acts more than max(STUCK_VERSIONS, the run's
  max_staleness) versions behind the latest published one for more than STUCK_AFTER_S seconds (plus two
  report intervals: with a large fleet actors report less often). The message says what the broker can
  tell of the cause: an actor gone quiet, or one that waits most of its time, is held by flow control.
* ``rss_growth`` (``rss_mb``, any role): RSS sampled every RSS_SAMPLE_EVERY_S grew by more than
  RSS_GROWTH over the last RSS_WINDOW samples, steadily (the medians of the window's thirds rise).
* ``sps_collapse`` (``sps``): an actor under SPS_COLLAPSE_SHARE of its own peak env steps/s,
  SPS_COLLAPSE_REPORTS reports in a row.
* ``same_initial_obs`` (``first_obs_hash``): two or more actors report the same hash of their first
  observation after the first reset: their env seeds are not split.
"""

from __future__ import annotations

import heapq
from collections import Counter, OrderedDict, deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

from zddrl.values import finite_float

COMM_SHARE_MAX = 0.30
"""Fraction of an actor's wall time (over its last report interval) spent waiting for parameters or
sending trajectories; above it the learner or the network, not the envs, bounds sampling."""
COMM_SHARE_REPORTS = 3
"""Consecutive stats reports (actors report about once a second) over COMM_SHARE_MAX before the
warning: one slow learner update is not a condition."""
STUCK_VERSIONS = 3
"""Policy versions an actor may act behind the latest published one (at least the run's
max_staleness, which async runs accept by design)."""
STUCK_AFTER_S = 10.0
"""Seconds an actor must stay more than the allowed versions behind before the warning."""
STATS_SLACK_S = 5.0
"""An actor reports at most once a report interval and only after a rollout: quiet for two intervals plus this
long (a slow env's rollout) means it is held, not merely between reports."""
HELD_WAIT_SHARE = 0.8
"""An actor that says it waits this share of its time is held by its broker or learner, not starved at its end."""
RSS_SAMPLE_EVERY_S = 10.0
"""Seconds between the RSS samples kept (reports come about once a second; a window of seconds would
only catch leaks that kill a process within minutes)."""
RSS_WINDOW = 30
"""RSS samples over which growth is judged: 30 x 10 s = the last 5 minutes."""
RSS_GROWTH = 0.20
"""Fractional RSS growth over the window (first third's median to last third's) that counts as a leak."""
SPS_COLLAPSE_SHARE = 0.25
"""Fraction of an actor's own peak env steps/s under which its speed has collapsed."""
SPS_COLLAPSE_REPORTS = 5
"""Consecutive reports under SPS_COLLAPSE_SHARE x peak before the warning."""
PUBLISHED_KEPT = 4096
"""Published versions whose hashes are kept for unknown_params; older versions are not judged."""
CHECKS = ("comm_share", "unknown_params", "stuck_version", "rss_growth", "sps_collapse", "same_initial_obs")


@dataclass
class HealthWarning:
    member: str
    check: str
    message: str
    since: float
    """Onset, on the caller's clock (the broker's time.monotonic())."""

    def row(self, now: float) -> dict[str, Any]:
        return {
            "member": self.member,
            "check": self.check,
            "message": self.message,
            "since_s": round(max(now - self.since, 0.0), 1),
        }


def _onset_order(w: HealthWarning) -> tuple[float, str, str]:
    return (w.since, w.member, w.check)


@dataclass
class _Track:
    """What the monitor remembers about one member between reports."""

    role: str
    version: int | None = None
    param_hash: str | None = None
    behind_since: float | None = None
    comm_high: int = 0
    sps_peak: float = 0.0
    sps_low: int = 0
    first_obs_hash: str | None = None
    reported_at: float | None = None
    wait_share: float | None = None
    rss: deque = field(default_factory=lambda: deque(maxlen=RSS_WINDOW))
    rss_at: float = float("-inf")


class HealthMonitor:
    """``observe(member, role, stats, now)`` per stats message, ``published(version, hash)`` per
    accepted parameter version, ``evaluate(now)`` periodically; ``active()`` / ``rows(now)``."""

    def __init__(self) -> None:
        self._tracks: dict[str, _Track] = {}
        self._active: dict[tuple[str, str], HealthWarning] = {}
        self._events: list[tuple[bool, HealthWarning]] = []
        self._hashes: OrderedDict[int, str] = OrderedDict()
        self._known: dict[str, int] = {}
        """Published hash -> how many kept versions carry it (a learner may republish a hash)."""
        self._obs_groups: dict[str, dict[str, None]] = {}
        """first_obs_hash -> the actors that reported it, in the order they did (a dict as an ordered set)."""
        self.latest = -1
        self.stuck_versions = STUCK_VERSIONS
        self.report_interval_s = 1.0
        """How often members report (the broker's heartbeat interval, which grows with the fleet): a version reported
        that long ago may be stale by then, so ``stuck_version`` waits that much longer than STUCK_AFTER_S."""
        self.run_id = ""
        """Stats that name another run (``run_id``) are not judged against this run's versions."""

    # ---------------------------------------------------------------- inputs
    def start_run(self, max_staleness: int = 0, run_id: str = "") -> None:
        """A new run: versions restart, and what actors reported belongs to the old one."""
        self.run_id = run_id
        self._hashes.clear()
        self._known.clear()
        self.latest = -1
        self.stuck_versions = max(STUCK_VERSIONS, max_staleness)
        for member, track in self._tracks.items():
            self._tracks[member] = _Track(role=track.role, rss=track.rss)  # RSS is the process's, not the run's
        self._obs_groups.clear()
        for member, check in list(self._active):
            if check != "rss_growth":
                self._clear(member, check)

    def published(self, version: int, param_hash: str) -> None:
        self._hashes[version] = param_hash
        self._known[param_hash] = self._known.get(param_hash, 0) + 1
        self.latest = max(self.latest, version)
        while len(self._hashes) > PUBLISHED_KEPT:
            _, old = self._hashes.popitem(last=False)
            self._known[old] -= 1
            if not self._known[old]:
                del self._known[old]

    def observe(self, member: str, role: str, stats: Mapping[str, Any], now: float) -> list[HealthWarning]:
        """Judge one stats report of ``member``; returns that member's active warnings.

        Only the member's own: this runs for every stats message, and sorting the whole fleet's
        warnings each time would cost the broker O(fleet) per report (``active()`` has them all)."""
        track = self._tracks.get(member)
        if track is None or track.role != role:
            track = self._tracks[member] = _Track(role=role)
        self._check_rss(member, track, finite_float(stats.get("rss_mb")), now)
        if role == "actor":
            self._check_comm(member, track, finite_float(stats.get("comm_share")), now)
            self._check_sps(member, track, finite_float(stats.get("sps")), now)
            run_id = stats.get("run_id")
            if isinstance(run_id, str) and run_id != self.run_id:
                # The report of a rollout of the previous run, sent as the new one started (or
                # before this broker knows the run): its version and envs mean nothing here.
                return self.active_of(member)
            version = stats.get("policy_version")
            if isinstance(version, int) and not isinstance(version, bool) and version >= 0:
                track.version, track.reported_at = version, now
                track.wait_share = finite_float(stats.get("wait_share"))
                track.param_hash = stats.get("param_hash") if isinstance(stats.get("param_hash"), str) else None
                self._check_params(member, track, now)
                self._check_stuck(member, track, now)
            first = stats.get("first_obs_hash")
            if isinstance(first, str) and first and first != track.first_obs_hash:
                self._regroup(member, track, first, now)
        return self.active_of(member)

    def evaluate(self, now: float) -> list[HealthWarning]:
        """Time-based checks (an actor that stopped reporting does not stop being behind)."""
        for member, track in self._tracks.items():
            if track.role == "actor":
                self._check_stuck(member, track, now)
        return self.active()

    def forget(self, member: str) -> None:
        """The member left: its warnings end, and so does its part in others' (same_initial_obs)."""
        track = self._tracks.pop(member, None)
        if track is not None and track.first_obs_hash is not None:
            self._leave_group(member, track.first_obs_hash)
        for m, check in list(self._active):
            if m == member:
                self._clear(m, check)

    # ---------------------------------------------------------------- outputs
    def active(self) -> list[HealthWarning]:
        return sorted(self._active.values(), key=_onset_order)

    def active_of(self, member: str) -> list[HealthWarning]:
        return [self._active[(member, c)] for c in CHECKS if (member, c) in self._active]

    def rows(self, now: float, limit: int | None = None) -> list[dict[str, Any]]:
        """The active warnings' rows, oldest onset first; only the ``limit`` oldest if given (without sorting
        them all: a fleet of thousands can hold tens of thousands of warnings)."""
        if limit is None:
            return [w.row(now) for w in self.active()]
        return [w.row(now) for w in heapq.nsmallest(limit, self._active.values(), key=_onset_order)]

    def counts(self) -> dict[str, int]:
        """Active warnings per check (every check, 0 included)."""
        by_check = Counter(check for _, check in self._active)
        return {check: by_check[check] for check in CHECKS}

    def count_of(self, member: str) -> int:
        """Active warnings of ``member``."""
        return sum((member, c) in self._active for c in CHECKS)

    def pop_events(self) -> list[tuple[bool, HealthWarning]]:
        """(raised, warning) for every onset (True) and end (False) since the last call, in order."""
        events, self._events = self._events, []
        return events

    # ---------------------------------------------------------------- checks
    def _set(self, member: str, check: str, message: str | None, now: float) -> None:
        """Raise (or refresh the message of) the warning, or clear it when ``message`` is None."""
        key = (member, check)
        if message is None:
            self._clear(member, check)
        elif key in self._active:
            self._active[key].message = message
        else:
            self._active[key] = warning = HealthWarning(member, check, message, now)
            self._events.append((True, warning))

    def _clear(self, member: str, check: str) -> None:
        warning = self._active.pop((member, check), None)
        if warning is not None:
            self._events.append((False, warning))

    def _check_comm(self, member: str, track: _Track, share: float | None, now: float) -> None:
        if share is None:
            return
        track.comm_high = track.comm_high + 1 if share > COMM_SHARE_MAX else 0
        self._set(
            member,
            "comm_share",
            None
            if track.comm_high < COMM_SHARE_REPORTS
            else f"spends {share:.0%} of its time waiting for parameters or sending (limit "
            f"{COMM_SHARE_MAX:.0%}): the learner or the network bounds sampling",
            now,
        )

    def _check_sps(self, member: str, track: _Track, sps: float | None, now: float) -> None:
        if sps is None:
            return
        track.sps_peak = max(track.sps_peak, sps)
        low = track.sps_peak > 0 and sps < SPS_COLLAPSE_SHARE * track.sps_peak
        track.sps_low = track.sps_low + 1 if low else 0
        self._set(
            member,
            "sps_collapse",
            None
            if track.sps_low < SPS_COLLAPSE_REPORTS
            else f"steps {sps:.0f} env steps/s, under {SPS_COLLAPSE_SHARE:.0%} of its own peak "
            f"{track.sps_peak:.0f} for {track.sps_low} reports",
            now,
        )

    def _check_rss(self, member: str, track: _Track, rss: float | None, now: float) -> None:
        if rss is None or rss <= 0 or now - track.rss_at < RSS_SAMPLE_EVERY_S:
            return
        track.rss.append(rss)
        track.rss_at = now
        growing = False
        if len(track.rss) == RSS_WINDOW:
            # Medians of thirds, not first vs last sample: one large allocation is a step, not a
            # leak (two thirds' medians stay equal), and a single noisy sample moves no median.
            k = RSS_WINDOW // 3
            s = list(track.rss)
            a, b, c = (sorted(part)[len(part) // 2] for part in (s[:k], s[k:-k], s[-k:]))
            growing = a < b < c and c > a * (1 + RSS_GROWTH)
        self._set(
            member,
            "rss_growth",
            None
            if not growing
            else f"RSS grew steadily from {a:.0f} to {c:.0f} MB (+{c / a - 1:.0%}) over the last "
            f"{RSS_WINDOW * RSS_SAMPLE_EVERY_S / 60:.0f} min: a leak?",
            now,
        )

    def _check_params(self, member: str, track: _Track, now: float) -> None:
        h, v = track.param_hash, track.version
        oldest = next(iter(self._hashes), None)
        if h is None or v is None or oldest is None or v < oldest:
            return  # nothing published yet, or older than what this broker saw: cannot judge
        self._set(
            member,
            "unknown_params",
            None
            if h in self._known
            else f"acts with parameters {h} (version {v}) that were never published in this run "
            f"(version {v} was {self._hashes.get(v, 'never published')})",
            now,
        )

    def _check_stuck(self, member: str, track: _Track, now: float) -> None:
        v = track.version
        behind = self.latest - v if v is not None and self.latest >= 0 else 0
        if behind <= self.stuck_versions:
            track.behind_since = None
            self._clear(member, "stuck_version")
            return
        if track.behind_since is None:
            track.behind_since = now
        stuck_s = now - track.behind_since
        if stuck_s > STUCK_AFTER_S + 2 * self.report_interval_s:
            self._set(
                member,
                "stuck_version",
                f"acts with version {v}, {behind} behind the latest {self.latest}, for {stuck_s:.0f} s: "
                + self._stuck_cause(track, now),
                now,
            )

    def _stuck_cause(self, track: _Track, now: float) -> str:
        """What the broker can tell of why: an actor reports after each rollout it sent, so one that went quiet (or
        that says it waits most of its time) is held by flow control, not starved of parameters."""
        quiet_s = now - track.reported_at if track.reported_at is not None else 0.0
        if quiet_s > 2 * self.report_interval_s + STATS_SLACK_S:
            return (
                f"no report for {quiet_s:.0f} s (it reports after each rollout it sends): held sending, by flow "
                "control? is the learner, or this relay's upstream, taking trajectories?"
            )
        if track.wait_share is not None and track.wait_share >= HELD_WAIT_SHARE:
            return (
                f"it waits {track.wait_share:.0%} of its time for parameters or for the broker to take its "
                "trajectories: is the learner publishing and taking data?"
            )
        return "are parameters reaching it?"

    def _regroup(self, member: str, track: _Track, first: str, now: float) -> None:
        """``member`` reports ``first``. O(1) whatever the group's size: a fleet of a thousand actors sharing one seed
        (or pretending to) must not stall the broker. Each member of a group of two or more is warned once,
        naming up to three members that reported the hash before it (the first one is warned when the second
        arrives); the messages are not rewritten as the group grows."""
        if track.first_obs_hash is not None:
            self._leave_group(member, track.first_obs_hash)
        track.first_obs_hash = first
        group = self._obs_groups.setdefault(first, {})
        earlier = list(islice(group, 3))
        group[member] = None
        if len(group) == 2:
            self._set(earlier[0], "same_initial_obs", self._same_obs_message(first, [member]), now)
        if earlier:
            self._set(member, "same_initial_obs", self._same_obs_message(first, earlier, len(group) - 1), now)

    @staticmethod
    def _same_obs_message(first: str, named: list[str], others: int = 1) -> str:
        more = f" and {others - len(named)} more" if others > len(named) else ""
        return (
            f"same first observations as {', '.join(named)}{more} (first_obs_hash {first}): env seeds are not "
            "split (a distinct --actor-id per actor?)"
        )

    def _leave_group(self, member: str, first: str) -> None:
        group = self._obs_groups.get(first, {})
        group.pop(member, None)
        self._clear(member, "same_initial_obs")
        if len(group) == 1:  # left alone: not the same as anyone any more
            self._clear(next(iter(group)), "same_initial_obs")
        if not group:
            self._obs_groups.pop(first, None)
