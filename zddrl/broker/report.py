"""The broker's status body (docs/protocol.md section 9), its counters and message rates."""

from __future__ import annotations

import socket
import time
from typing import Any

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
    "params_duplicate",
    "params_orphan_chunk",
    "params_bad_chunk",
    "params_chunk_hash",
    "params_whole_hash",
    "params_incomplete",
    "fleet_sent",
)
"""Every counter of the broker; all are in the status body from the start (docs/protocol.md section 9)."""
RATES = ("in_msgs_per_s", "out_msgs_per_s", "in_bytes_per_s", "out_bytes_per_s")
"""Trajectory messages and bytes per second in and out, over the last heartbeat interval."""


def throughput(mark: tuple | None, counters: dict[str, int], now: float) -> tuple[tuple, dict[str, float]]:
    """(new mark, rates since ``mark``): messages and bytes per second in and out of the broker."""
    new = (now, counters["received"], counters["forwarded"], counters["bytes_in"], counters["bytes_out"])
    if mark is None:
        return new, {}
    dt = max(now - mark[0], 1e-9)
    return new, {k: round((a - b) / dt, 1) for k, a, b in zip(RATES, new[1:], mark[1:])}


def broker_status(b: Any) -> dict[str, Any]:
    """The status body (docs/protocol.md section 9) of Broker ``b``: counters, members, health, departures."""
    now = time.monotonic()
    c = b.counters
    dropped = sum(b.dropped.values())
    return {
        "broker": {
            "uptime_s": round(now - b.started, 3),
            "host": socket.gethostname(),
            "run_id": b.run_id,
            "policy_version": b.policy_version,
            "ports": b.ports,
            "received": c["received"],
            "forwarded": c["forwarded"],
            "dropped": dict(b.dropped),
            "in_flight": b.in_flight,
            "bytes_in": c["bytes_in"],
            "bytes_out": c["bytes_out"],
            "accounted": c["received"] == c["forwarded"] + dropped + b.in_flight,
            "credit": b.credit,
            "fleet_seq": b.fleet.seq,
            "fleet_actors": len(b.fleet.actors),
            **b.rates,
            **{k: v for k, v in c.items() if k not in ("received", "forwarded", "bytes_in", "bytes_out")},
        },
        "members": {pid: m.row(now) for pid, m in b.members.items()},
        "health": b.health.rows(now),
        "departures": b.departures.rows(now),
    }
