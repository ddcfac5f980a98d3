"""The broker's status body (docs/protocol.md section 9) and its message rates."""
from __future__ import annotations

import socket
import time
from typing import Any


def throughput(mark: tuple | None, counters: dict[str, int], now: float) -> tuple[tuple, dict[str, float]]:
    """(new mark, rates since ``mark``): messages and bytes per second in and out of the broker."""
    new = (now, counters["received"], counters["forwarded"], counters["bytes_in"], counters["bytes_out"])
    if mark is None:
        return new, {}
    dt = max(now - mark[0], 1e-9)
    names = ("in_msgs_per_s", "out_msgs_per_s", "in_bytes_per_s", "out_bytes_per_s")
    return new, {k: round((a - b) / dt, 1) for k, a, b in zip(names, new[1:], mark[1:])}


def broker_status(b: Any) -> dict[str, Any]:
    """The status body (docs/protocol.md section 9) of Broker ``b``: counters, members, health, departures."""
    now = time.monotonic()
    c = b.counters
    dropped = sum(b.dropped.values())
    return {
        "broker": {"uptime_s": round(now - b.started, 3), "host": socket.gethostname(), "run_id": b.run_id,
                   "policy_version": b.policy_version, "ports": b.ports,
                   "received": c["received"], "forwarded": c["forwarded"], "dropped": dict(b.dropped),
                   "in_flight": b.in_flight, "bytes_in": c["bytes_in"], "bytes_out": c["bytes_out"],
                   "accounted": c["received"] == c["forwarded"] + dropped + b.in_flight,
                   "credit": b.credit, **b.rates,
                   **{k: v for k, v in c.items() if k not in ("received", "forwarded", "bytes_in", "bytes_out")}},
        "members": {pid: m.row(now) for pid, m in b.members.items()},
        "health": b.health.rows(now),
        "departures": b.departures.rows(now),
    }
