"""`python -m benchmarks fleet`'s summary and report: the goals it checks, the zmq.proxy comparison, one table per
window."""

from __future__ import annotations

from typing import Any

import numpy as np

PER_ACTOR_FROM = 64
"""Fleets this large or larger judge whether the per-actor cost stays flat (below it the idle loop dominates)."""
PER_ACTOR_GROWTH_MAX = 1.25
"""The per-actor cost of the largest fleet may exceed the cheapest one's by this factor and still count as flat."""


def marginal_costs(points: list[dict[str, Any]]) -> dict[int, float]:
    """Broker CPU per actor per second (us) on top of the smallest fleet's (the idle loop's fixed cost), per N."""
    base = min(points, key=lambda p: p["actors"])
    n0, share0 = base["actors"], base["control_only"]["broker_cpu_share"]
    return {
        p["actors"]: round((p["control_only"]["broker_cpu_share"] - share0) / (p["actors"] - n0) * 1e6, 1)
        for p in points
        if p["actors"] > n0
    }


def scaling(points: list[dict[str, Any]]) -> dict[str, Any]:
    """The goals: the control plane of 1,024 actors under 10 % of a core, and its per-actor cost flat in N: the
    marginal cost (``marginal_costs``) of the largest fleet at most PER_ACTOR_GROWTH_MAX x the cheapest of those
    from PER_ACTOR_FROM actors. Also a least-squares line through the control-only shares: fixed + per actor."""
    largest = max(points, key=lambda p: p["actors"])
    share = largest["control_only"]["broker_cpu_share"]
    marginal = marginal_costs(points)
    judged = {n: c for n, c in marginal.items() if n >= PER_ACTOR_FROM}
    growth = None
    if len(judged) >= 2 and min(judged.values()) > 0:
        growth = round(judged[largest["actors"]] / min(judged.values()), 2)
    fit = None
    if len(points) >= 2:
        slope, intercept = np.polyfit(
            [p["actors"] for p in points], [p["control_only"]["broker_cpu_share"] for p in points], 1
        )
        fit = {"fixed_share": round(float(intercept), 4), "us_per_actor_s": round(float(slope) * 1e6, 1)}
    return {
        "control_plane": {
            "actors": largest["actors"],
            "broker_cpu_share": share,
            "threshold": 0.10,
            "met": share < 0.10 if largest["actors"] >= 1024 else None,
        },
        "per_actor_cost": {
            "marginal_us_per_actor_s": {str(n): c for n, c in marginal.items()},
            "from_actors": PER_ACTOR_FROM,
            "largest_over_cheapest": growth,
            "threshold": PER_ACTOR_GROWTH_MAX,
            "met": None if growth is None else growth <= PER_ACTOR_GROWTH_MAX,
        },
        "fit": fit,
    }


def proxy_comparison(broker: dict[str, Any], proxy: dict[str, Any]) -> dict[str, Any]:
    """The broker's data path against zmq.proxy's, the same actors offering the same load to each."""
    d = broker["data"]
    row = {
        "actors": broker["actors"],
        "broker": {
            "trajectories_per_s": d["trajectories_per_s"],
            "latency_ms": d["latency_ms"],
            "forwarder_cpu_share": d["broker_cpu_share"],
            "forwarder_cpu_us_per_traj": d["broker_cpu_us_per_traj"],
            "sims_cpu_share": d["sims_cpu_share"],
            "learner_cpu_share": d["learner_cpu_share"],
            "forwarder_rss_mb": broker["broker_rss_mb"]["data"],
            "all_delivered": broker["accounting"]["all_delivered"],
        },
        "proxy": proxy,
        "broker_over_proxy": round(d["trajectories_per_s"] / proxy["trajectories_per_s"], 3),
    }
    cpu_b, cpu_p = d["broker_cpu_us_per_traj"], proxy["forwarder_cpu_us_per_traj"]
    row["cpu_per_traj_broker_over_proxy"] = round(cpu_b / cpu_p, 2) if cpu_b and cpu_p else None
    above = d.get("broker_cpu_us_per_traj_above_control")  # the broker's heartbeats left out
    row["cpu_per_traj_above_control_broker_over_proxy"] = round(above / cpu_p, 2) if above and cpu_p else None
    return row


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in [header, *rows])


def _pct(x: float) -> str:
    return f"{x * 100:.1f}%"


def _met(flag: bool | None) -> str:
    return "-" if flag is None else ("met" if flag else "NOT met")


def _us(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"


def control_table(points: list[dict[str, Any]]) -> str:
    header = (
        "actors|join s|broker CPU|of it libzmq|us/actor/s|control msgs/s|heartbeats/s|stats/s|beat every s|"
        "broker RSS MiB|sims CPU"
    )
    return _table(
        header.split("|"),
        [
            [
                str(p["actors"]),
                f"{p['join_s']:.2f}",
                _pct(c["broker_cpu_share"]),
                _pct(c["broker_zmq_cpu_share"]),
                f"{c['broker_cpu_us_per_actor_s']:.1f}",
                f"{c['control_msgs_per_s']:.0f}",
                f"{c['heartbeats_per_s']:.0f}",
                f"{c['stats_per_s']:.0f}",
                f"{p['broker_counters'].get('heartbeat_interval_s', 0):g}",
                f"{p['broker_rss_mb']['control']}",
                _pct(c["sims_cpu_share"]),
            ]
            for p in points
            for c in [p["control_only"]]
        ],
    )


def data_table(points: list[dict[str, Any]]) -> str:
    header = (
        "actors|traj/s|p50 ms|p99 ms|broker CPU|of it libzmq|broker us/traj|above control|control msgs/s|"
        "broker RSS MiB|sims CPU|learner CPU|accounted|all delivered"
    )
    return _table(
        header.split("|"),
        [
            [
                str(p["actors"]),
                f"{d['trajectories_per_s']:.0f}",
                f"{d['latency_ms']['p50']:.2f}",
                f"{d['latency_ms']['p99']:.2f}",
                _pct(d["broker_cpu_share"]),
                _pct(d["broker_zmq_cpu_share"]),
                _us(d["broker_cpu_us_per_traj"]),
                _us(d.get("broker_cpu_us_per_traj_above_control")),
                f"{d['control_msgs_per_s']:.0f}",
                f"{p['broker_rss_mb']['data']}",
                _pct(d["sims_cpu_share"]),
                _pct(d["learner_cpu_share"]),
                str(a["accounted"]),
                str(a["all_delivered"]),
            ]
            for p in points
            for d, a in [(p["data"], p["accounting"])]
        ],
    )


def comparison_lines(comparison: dict[str, Any], rate: str) -> list[str]:
    header = "path|traj/s|p50 ms|p99 ms|forwarder CPU|forwarder us/traj|forwarder RSS MiB|sims CPU|learner CPU"
    table = _table(
        header.split("|"),
        [
            [
                path,
                f"{r['trajectories_per_s']:.0f}",
                f"{r['latency_ms']['p50']:.2f}",
                f"{r['latency_ms']['p99']:.2f}",
                _pct(r["forwarder_cpu_share"]),
                _us(r["forwarder_cpu_us_per_traj"]),
                str(r["forwarder_rss_mb"]),
                _pct(r["sims_cpu_share"]),
                _pct(r["learner_cpu_share"]),
            ]
            for path in ("broker", "proxy")
            for r in [comparison[path]]
        ],
    )
    return [
        "",
        f"Data path at {comparison['actors']} actors, {rate}, through the broker and through zmq.proxy (no control "
        "plane, no credit: without --rate its queues are bounded only by ZeroMQ's HWMs and the kernel's buffers)",
        table,
        f"broker / proxy: {comparison['broker_over_proxy']:.2f}x trajectories/s, "
        f"{comparison['cpu_per_traj_broker_over_proxy']}x forwarder CPU per trajectory "
        f"({comparison['cpu_per_traj_above_control_broker_over_proxy']}x without the broker's control plane)",
    ]


def format_report(report: dict[str, Any]) -> str:
    s, points = report["settings"], report["points"]
    rate = "as fast as credit allows" if not s["rate"] else f"{s['rate']:g} trajectories/s offered by the fleet"
    out = [
        f"Control plane only: every actor joined and heartbeating{', with stats' if s['stats'] else ''}, no data "
        f"({s['seconds']:g} s windows; CPU shares are of one core)",
        control_table(points),
        "",
        f"Data: {s['rollout']} rollouts, {rate}; max_in_flight {s['max_in_flight']}",
        data_table(points),
    ]
    if report.get("proxy_comparison"):
        out += comparison_lines(report["proxy_comparison"], rate)
    sc = report["scaling"]
    cp, per_actor, fit = sc["control_plane"], sc["per_actor_cost"], sc["fit"]
    marginal = ", ".join(f"{n}: {c:.0f}" for n, c in per_actor["marginal_us_per_actor_s"].items())
    out += [
        "",
        f"Goal: control plane of {cp['actors']} actors under {cp['threshold']:.0%} of a core: {_met(cp['met'])} "
        f"({_pct(cp['broker_cpu_share'])})",
        f"Goal: per-actor cost flat in N (largest fleet <= {per_actor['threshold']}x the cheapest from "
        f"{per_actor['from_actors']} actors): {_met(per_actor['met'])} ({per_actor['largest_over_cheapest']}x); "
        f"broker CPU us per actor per second above the smallest fleet's: {marginal}",
    ]
    if fit:
        out.append(
            f"Control-only broker CPU, least squares: {_pct(fit['fixed_share'])} + {fit['us_per_actor_s']:.0f} us per "
            "actor per second"
        )
    out += [f"Load average at start {s['load_avg_at_start']}; wall {report['wall_s']:.1f} s"]
    return "\n".join(out)
