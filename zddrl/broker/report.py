"""The broker's status body (docs/protocol.md section 9), its counters and message rates.

The body is bounded whatever the fleet: a summary (counters, counts by role and host, totals, health counts,
the oldest HEALTH_ROWS_LISTED warnings, the last departures) and one page of member rows. Pages hold the
members in (role: learners, monitors, actors; peer id) order, at most PAGE_MEMBERS rows and PAGE_ROW_BYTES of
them; a fleet that fits one page is all on page 1, the page a request without ``page`` gets.
"""

from __future__ import annotations

import heapq
import socket
import time
from collections import Counter
from collections.abc import Iterable
from typing import Any

from zddrl import protocol as P
from zddrl.broker.auth import BrokerAuth
from zddrl.broker.cadence import Cadence
from zddrl.broker.health import HealthMonitor
from zddrl.broker.limits import UnreadReplies
from zddrl.broker.membership import Member, Membership
from zddrl.broker.memory import MemoryBudget
from zddrl.broker.routing import Router
from zddrl.broker.run import CurrentRun
from zddrl.broker.standby import Standby
from zddrl.broker.subtree import Subtrees
from zddrl.broker.upstream import Upstream

BROKER_COUNTERS = (
    "received",
    "forwarded",
    "bytes_in",
    "bytes_out",
    "control_malformed",
    "control_errors",
    "control_unroutable",
    "learner_malformed",
    "learner_errors",
    "credit_other_run",
    "expired_or_left",
    "params_published",
    "params_bytes",
    "params_snapshots",
    "params_requests",
    "params_request_limited",
    "params_unknown_run",
    "params_stale",
    "params_repeat",
    "params_duplicate",
    "params_orphan_chunk",
    "params_bad_chunk",
    "params_chunk_hash",
    "params_whole_hash",
    "params_incomplete",
    "params_signature",
    "runs_refused",
    "fleet_sent",
    "status_refused",
    "hello_limited",
    "hello_over_cap",
    "hello_id_in_use",
    "hello_passive",
    "stats_truncated",
    "relayed_refused",
    "control_too_many_frames",
    "learner_too_many_frames",
    "replies_unread",
    "snapshots_unread",
    "memory_resets",
    "memory_rebind_failed",
)
"""Every counter of the broker; all are in the status body from the start (docs/protocol.md section 9)."""
PAGE_MEMBERS = 500
"""Member rows in one page of the status body at most."""
PAGE_ROW_BYTES = 512 << 10
"""Packed bytes of one page's member rows at most (row_bytes bounds each; one row always fits: a member's stats
take at most membership.MAX_STATS_BYTES)."""
ROW_BASE_BYTES = 512
"""Bound of a member row's packed size without its peer id, host and stats: the fixed keys, numbers and every
``dropped_<reason>`` key."""
HEALTH_ROWS_LISTED = 64
"""Health warnings listed in the body (the oldest onsets); ``health_by_check`` counts them all."""
HOSTS_LISTED = 32
"""Hosts in ``members_by_host`` (those with the most members); ``hosts_total`` counts them all."""
MAX_STATUS_BYTES = 768 << 10
"""Bound of a status body's packed size (tests/broker/test_status_bounds.py): the broker map with its summary
(under 16 KiB with HOSTS_LISTED hosts of 255 bytes), HEALTH_ROWS_LISTED warnings (under 1 KiB each: their
messages name at most three peer ids and a stats string), 20 departures (membership.DEPARTURES_KEPT, reasons
of at most membership.DEPARTURE_REASON_CHARS: under 136 KiB) and one page (PAGE_ROW_BYTES): under 730 KiB, which
leaves room under the protocol's MAX_HEADER_BYTES (1 MiB)."""
ROLE_ORDER = {"learner": 0, "replay": 1, "relay": 1, "monitor": 1, "actor": 2}
"""Page order: learners first, so that page 1 carries the run's figures (the main learner's stats)."""
RATES = ("in_msgs_per_s", "out_msgs_per_s", "in_bytes_per_s", "out_bytes_per_s")
"""Trajectory messages and bytes per second in and out, over the last heartbeat interval."""


def throughput(mark: tuple | None, counters: dict[str, int], now: float) -> tuple[tuple, dict[str, float]]:
    """(new mark, rates since ``mark``): messages and bytes per second in and out of the broker."""
    new = (now, counters["received"], counters["forwarded"], counters["bytes_in"], counters["bytes_out"])
    if mark is None:
        return new, {}
    dt = max(now - mark[0], 1e-9)
    return new, {k: round((a - b) / dt, 1) for k, a, b in zip(RATES, new[1:], mark[1:])}


def row_bytes(m: Member) -> int:
    """A bound of the packed size of ``m``'s row and its key in the members map."""
    return ROW_BASE_BYTES + len(m.peer_id.encode("utf-8", "surrogatepass")) + len(m.host.encode()) + m.stats_bytes


def _page_order(m: Member) -> tuple[int, str]:
    return ROLE_ORDER.get(m.role, len(ROLE_ORDER)), m.peer_id


def paged(members: Iterable[Member], page: int) -> tuple[list[Member], int]:
    """(the members on ``page``, counted from 1, and how many pages there are): pages cut at PAGE_MEMBERS rows or
    before PAGE_ROW_BYTES. A page past the last is empty; with no members there is one, empty, page."""
    pages, count, nbytes, chosen = 1, 0, 0, []
    for m in sorted(members, key=_page_order):
        size = row_bytes(m)
        if count and (count >= PAGE_MEMBERS or nbytes + size > PAGE_ROW_BYTES):
            pages, count, nbytes = pages + 1, 0, 0
        count, nbytes = count + 1, nbytes + size
        if pages == page:
            chosen.append(m)
    return chosen, pages


def fleet_summary(members: Iterable[Member]) -> dict[str, Any]:
    """Counts and totals over every member (the rows are paged, these are not)."""
    by_role: Counter[str] = Counter()
    by_host: Counter[str] = Counter()
    env_steps = envs = 0
    for m in members:
        by_role[m.role] += 1
        by_host[m.host] += 1
        env_steps += m.counters["env_steps"]
        envs += m.num_envs
    return {
        "members_total": sum(by_role.values()),
        "members_by_role": {role: by_role[role] for role in P.ROLES},
        "members_by_host": dict(heapq.nlargest(HOSTS_LISTED, by_host.items(), key=lambda kv: (kv[1], kv[0]))),
        "hosts_total": len(by_host),
        "envs_total": envs,
        "env_steps_total": env_steps,
    }


class StatusReport:
    """The status body (docs/protocol.md section 9) from the broker's parts it reads (``body``), and the throughput
    over the last heartbeat interval (``sample``, each interval)."""

    def __init__(
        self,
        *,
        counters: dict[str, int],
        current: CurrentRun,
        membership: Membership,
        router: Router,
        subtrees: Subtrees,
        health: HealthMonitor,
        cadence: Cadence,
        memory: MemoryBudget,
        unread: UnreadReplies,
        ports: dict[str, int],
        auth: BrokerAuth | None,
        upstream: Upstream | None,
        standby: Standby | None,
    ) -> None:
        self.counters, self.current, self.membership, self.router = counters, current, membership, router
        self.subtrees, self.health, self.cadence, self.memory, self.unread = subtrees, health, cadence, memory, unread
        self.ports, self.auth, self.upstream, self.standby = ports, auth, upstream, standby
        self.started = time.monotonic()
        self.rates: dict[str, float] = dict.fromkeys(RATES, 0.0)
        self._mark: tuple | None = None

    def sample(self, now: float) -> None:
        """Throughput over the interval since the last sample, for `zddrl status`."""
        self._mark, rates = throughput(self._mark, self.counters, now)
        self.rates = rates or self.rates

    def body(self, page: int = 1) -> dict[str, Any]:
        """Counters, the fleet's summary, health, departures and ``page`` of the member rows (ProtocolError if
        ``page`` < 1)."""
        if page < 1:
            raise P.ProtocolError(f"status_request: page must be >= 1, got {page}")
        now = time.monotonic()
        c, router, membership, memory = self.counters, self.router, self.membership, self.memory
        rows, pages = paged(membership.members.values(), page)
        health = self.health.counts()
        accounted = router.accounted()
        return {
            "broker": {
                "uptime_s": round(now - self.started, 3),
                "host": socket.gethostname(),
                "run_id": self.current.run_id,
                "policy_version": self.current.policy_version,
                "ports": self.ports,
                "received": c["received"],
                "forwarded": c["forwarded"],
                "dropped": dict(router.dropped),
                "in_flight": router.in_flight,
                "bytes_in": c["bytes_in"],
                "bytes_out": c["bytes_out"],
                "accounted": accounted,
                "accounted_subtree": accounted and self.subtrees.accounted(),
                "credit": router.outlet.credit,
                "fleet_seq": membership.roster.seq,
                "fleet_actors": len(membership.roster.actors),
                "heartbeat_interval_s": self.cadence.interval_s,
                **self.rates,
                **{k: v for k, v in c.items() if k not in ("received", "forwarded", "bytes_in", "bytes_out")},
                **fleet_summary(membership.members.values()),
                "health_total": sum(health.values()),
                "health_by_check": health,
                "page": page,
                "pages": pages,
                "zap_alive": self.auth.alive() if self.auth is not None else True,
                "memory": {
                    "rss_bytes": memory.rss,
                    "peak_bytes": memory.peak,
                    "limit_bytes": memory.limit,
                    "unread_bytes": self.unread.total,
                    "unread_connections": len(self.unread),
                },
                "relays": self.subtrees.status(),
                "upstream": self.upstream.status() if self.upstream is not None else None,
                "standby": self.standby.status() if self.standby is not None else None,
            },
            "members": {m.peer_id: {**m.row(now), "warnings": self.health.count_of(m.peer_id)} for m in rows},
            "health": self.health.rows(now, HEALTH_ROWS_LISTED),
            "departures": membership.departures.rows(now),
        }
