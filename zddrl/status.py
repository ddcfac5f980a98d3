"""`zddrl status`: ask a broker for its counters and show them as a table."""
from __future__ import annotations

from typing import Any

import zmq

from . import protocol as P


def request_status(connect: str, timeout_s: float, context: zmq.Context | None = None) -> dict[str, Any] | None:
    """One status request on a fresh DEALER; None if no broker answers within the timeout."""
    ctx = context or zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(connect)
        sock.send_multipart(P.encode(P.StatusRequest(peer_id="status")))
        if not sock.poll(int(timeout_s * 1000)):
            return None
        while True:  # anything else the broker might send first is skipped
            msg = P.decode(sock.recv_multipart())
            if isinstance(msg, P.Status):
                return msg.body
            if not sock.poll(int(timeout_s * 1000)):
                return None
    finally:
        sock.close(linger=0)


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def format_status(body: dict[str, Any]) -> str:
    b = body["broker"]
    dropped = ", ".join(f"{k} {v}" for k, v in b["dropped"].items())
    lines = [f"broker {b['host']}  run {b['run_id'] or '-'}  version {b['policy_version']}  up {b['uptime_s']:.0f} s",
             f"trajectories: received {b['received']} = forwarded {b['forwarded']} + dropped "
             f"{sum(b['dropped'].values())} ({dropped}) + in flight {b['in_flight']}"
             f"  [{'ok' if b['accounted'] else 'MISMATCH'}]",
             f"bytes in {b['bytes_in']}  out {b['bytes_out']}  params published {b.get('params_published', 0)}", ""]
    # The learner reports each actor's lag (its version minus the actor's newest trajectory's).
    lags = {k[4:]: v for m in body["members"].values() if m["role"] == "learner"
            for k, v in m.get("stats", {}).items() if k.startswith("lag/")}
    rows = [["member", "role", "host", "envs", "version", "lag", "msgs", "env_steps", "drops", "sps", "comm", "seen_s"]]
    for peer, m in sorted(body["members"].items()):
        s = m.get("stats", {})
        drops = sum(v for k, v in m.items() if k.startswith("dropped_"))
        envs = m["num_envs"] or s.get("num_envs", 0)  # actors started without --envs use the run's
        rows.append([peer, m["role"], f"{m['host']}:{m['pid']}", str(envs), str(m["policy_version"]),
                     str(lags.get(peer, "-")), str(m.get("messages", 0)), str(m.get("env_steps", 0)), str(drops),
                     f"{s.get('sps', 0):.0f}", f"{100 * s.get('comm_share', 0):.0f}%", f"{m['last_seen_s']:.1f}"])
    learner = next((m["stats"] for m in body["members"].values() if m["role"] == "learner" and m.get("stats")), None)
    if learner:
        lines.insert(3, f"learner: version {learner.get('policy_version')}  updates {learner.get('updates')}  "
                        f"return {learner.get('return_mean_20')}  dropped late {learner.get('dropped_late')} "
                        f"stale {learner.get('dropped_stale')}")
    return "\n".join(lines) + _table(rows)


def watch_status(connect: str, interval_s: float, timeout_s: float) -> None:  # pragma: no cover - replaced
    raise NotImplementedError("zddrl status --watch is being written")
