"""`zddrl bench bus`'s report: the targets it checks and the tables it prints."""

from __future__ import annotations

from typing import Any

from zddrl.bench.codec import CODEC_PAYLOAD, CODEC_TARGET, codec_ratio, format_rows

RATIO_TARGET, RATIO_FROM_BYTES = 0.9, 65536
"""The broker's goal: at least RATIO_TARGET x zmq.proxy's messages/s from payloads of RATIO_FROM_BYTES up."""
SECURE_TARGET, SECURE_AT_BYTES = 0.8, 1 << 20
"""The closed bus's goal: at least SECURE_TARGET x the open broker's messages/s at SECURE_AT_BYTES."""


def size_label(n: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n / 1e6:g} MB" if n >= 100_000 else f"{n} B"


def targets(ratios: list[dict], codec: list[dict]) -> dict[str, Any]:
    judged = [r for r in ratios if r["met"] is not None]
    pickle_x = codec_ratio(codec, "fresh")
    secure = [
        r["secure_over_broker"] for r in ratios if r["payload_bytes"] == SECURE_AT_BYTES and "secure_over_broker" in r
    ]
    return {
        "secure_vs_broker": {
            "threshold": SECURE_TARGET,
            "payload_bytes": SECURE_AT_BYTES,
            "ratio": secure[0] if secure else None,
            "met": secure[0] >= SECURE_TARGET if secure else None,
        },
        "broker_vs_proxy": {
            "threshold": RATIO_TARGET,
            "from_payload_bytes": RATIO_FROM_BYTES,
            "worst": min((r["broker_over_proxy"] for r in judged), default=None),
            "met": all(r["met"] for r in judged) if judged else None,
        },
        "codec_vs_pickle": {
            "threshold": CODEC_TARGET,
            "payload_bytes": CODEC_PAYLOAD,
            "data": "fresh",
            "ratio": pickle_x,
            "met": pickle_x >= CODEC_TARGET,
            "hot_ratio": codec_ratio(codec, "hot"),
        },
    }


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in [header, *rows])


def _met(flag: bool | None) -> str:
    return "-" if flag is None else ("met" if flag else "NOT met")


def format_report(report: dict[str, Any]) -> str:
    s = report["settings"]
    out = [
        f"Trajectory throughput, actor -> forwarder -> learner (median of {s['rounds']} rounds, "
        f"{s['seconds']:g} s windows; MB/s = 10^6 array bytes/s at the learner)"
    ]
    cpu = [r["forwarder_cpu_us_per_msg"] for r in report["results"]]
    out.append(
        _table(
            ["payload", "path", "msgs/s", "MB/s", "forwarder CPU us/msg", "per round msgs/s"],
            [
                [
                    size_label(r["payload_bytes"]),
                    r["path"],
                    f"{r['msgs_per_s']:.0f}",
                    f"{r['mb_per_s']:.1f}",
                    "-" if c is None else f"{c:.1f}",
                    " ".join(f"{x:.0f}" for x in r["rounds_msgs_per_s"]),
                ]
                for r, c in zip(report["results"], cpu)
            ],
        )
    )
    out += ["", "Ratios (median of per-round ratios)"]
    secure = any("secure_over_broker" in r for r in report["ratios"])
    local = any("local_over_broker" in r for r in report["ratios"])
    out.append(
        _table(
            ["payload", "broker/proxy", "broker/direct", "proxy/direct", f"target >= {RATIO_TARGET}"]
            + (["secure/broker", "direct-curve/direct"] if secure else [])
            + (["local(ipc)/broker(tcp)"] if local else []),
            [
                [
                    size_label(r["payload_bytes"]),
                    f"{r['broker_over_proxy']:.2f}x",
                    f"{r['broker_over_direct']:.2f}x",
                    f"{r['proxy_over_direct']:.2f}x",
                    _met(r["met"]),
                ]
                + ([f"{r['secure_over_broker']:.2f}x", f"{r['curve_over_direct']:.2f}x"] if secure else [])
                + ([f"{r['local_over_broker']:.2f}x"] if local else [])
                for r in report["ratios"]
            ],
        )
    )
    return "\n".join(out + [""] + _broadcast_and_codec(report) + [""] + _targets(report))


def _broadcast_and_codec(report: dict[str, Any]) -> list[str]:
    out = ["Parameter broadcast: send -> last subscriber holds the verified version"]
    out.append(
        _table(
            ["bus", "size", "subscribers", "median ms", "min ms", "max ms", "reps"],
            [
                [
                    r.get("bus", "open"),
                    size_label(r["payload_bytes"]),
                    str(r["subscribers"]),
                    f"{r['latency_ms']:.2f}",
                    f"{r['min_ms']:.2f}",
                    f"{r['max_ms']:.2f}",
                    str(r["reps"]),
                ]
                for r in report["broadcast"]
            ],
        )
    )
    out += [
        "",
        "Encode + decode per trajectory, 9 arrays (zddrl decodes received frames to zero-copy views); "
        "fresh: a stream of distinct trajectories, hot: one trajectory again and again",
        format_rows(report["codec"]),
    ]
    if report.get("signing"):
        out += ["", "A version's signature alone (Ed25519 over its head; the weights are hashed either way)"]
        out.append(
            _table(
                ["params", "sign us", "verify us"],
                [
                    [size_label(r["payload_bytes"]), f"{r['sign_us']:.1f}", f"{r['verify_us']:.1f}"]
                    for r in report["signing"]
                ],
            )
        )
    return out


def _targets(report: dict[str, Any]) -> list[str]:
    t = report["targets"]
    worst = t["broker_vs_proxy"]["worst"]
    return [
        f"Targets: broker >= {RATIO_TARGET}x proxy from {size_label(RATIO_FROM_BYTES)}: "
        f"{_met(t['broker_vs_proxy']['met'])} (worst {worst if worst is None else f'{worst:.2f}x'}); "
        f"codec >= {CODEC_TARGET:g}x faster than pickle at {size_label(CODEC_PAYLOAD)}: "
        f"{_met(t['codec_vs_pickle']['met'])} "
        f"({t['codec_vs_pickle']['ratio']:.1f}x fresh, {t['codec_vs_pickle']['hot_ratio']:.1f}x hot)"
        + (
            f"; closed bus >= {SECURE_TARGET}x open at {size_label(SECURE_AT_BYTES)}: "
            f"{_met(t['secure_vs_broker']['met'])} ({t['secure_vs_broker']['ratio']:.2f}x)"
            if t["secure_vs_broker"]["ratio"] is not None
            else ""
        ),
        f"Broker counters: {report['broker_counters']}   wall {report['wall_s']:.1f} s",
    ]
