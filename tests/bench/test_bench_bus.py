"""`zddrl bench bus` (and `python -m benchmarks relay`) end to end with tiny settings: real worker processes, real
broker, JSON out."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.serial  # its figures need the machine to itself (tests/phases.py)

ROOT = Path(__file__).resolve().parents[2]

TINY = [
    "--json",
    "--seconds",
    "0.3",
    "--rounds",
    "1",
    "--payloads",
    "4096,65536",
    "--broadcast-sizes",
    "100000",
    "--subscribers",
    "1",
]


def bench_bus(flag: str) -> dict:
    """`zddrl bench bus FLAG` with the tiny settings, run to completion: its JSON report."""
    proc = subprocess.run(
        [sys.executable, "-m", "zddrl", "bench", "bus", flag, *TINY],
        capture_output=True,
        text=True,
        timeout=110,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_bench_bus_smoke_with_the_closed_bus_side_by_side() -> None:
    """One ``--secure`` run: it measures the open paths (broker, direct, proxy) and, in the same rounds, the closed
    bus's (direct-curve, secure); the broadcast on both buses; signing; the codec."""
    report = bench_bus("--secure")

    rows = report["results"]
    paths = ("broker", "direct", "proxy", "direct-curve", "secure")
    assert sorted((r["payload_bytes"], r["path"]) for r in rows) == sorted(
        (size, path) for size in (4096, 65536) for path in paths
    )
    assert all(row["msgs_per_s"] > 0 and row["mb_per_s"] > 0 for row in rows)

    small, large = report["ratios"]
    assert small["payload_bytes"] == 4096 and small["broker_over_proxy"] > 0
    assert small["met"] is None  # the target applies from 64 KiB on
    assert large["payload_bytes"] == 65536 and isinstance(large["met"], bool)
    assert all(r["secure_over_broker"] > 0 and r["curve_over_direct"] > 0 for r in (small, large))
    assert report["targets"]["secure_vs_broker"]["ratio"] is None  # judged at 1 MiB only

    assert {(b["bus"], b["payload_bytes"]) for b in report["broadcast"]} == {("open", 100000), ("closed", 100000)}
    assert all(b["subscribers"] == 1 and b["latency_ms"] > 0 for b in report["broadcast"])
    assert [r["payload_bytes"] for r in report["signing"]] == [4 * 9_155, 100000]
    assert all(r["sign_us"] > 0 and r["verify_us"] > 0 for r in report["signing"])

    codecs = {(r["codec"], r["payload_bytes"], r["data"]) for r in report["codec"]}
    assert {(c, 1 << 20, d) for c in ("zddrl", "pickle", "msgpack-numpy") for d in ("fresh", "hot")} <= codecs
    assert all(r["encode_us"] > 0 and r["decode_us"] > 0 for r in report["codec"])
    assert all(
        r["encode_decode_us"] == pytest.approx(r["encode_us"] + r["decode_us"], abs=0.02) for r in report["codec"]
    )

    target = report["targets"]["codec_vs_pickle"]
    assert isinstance(target["met"], bool) and target["data"] == "fresh" and target["hot_ratio"] > 0
    from zddrl.transport.channel import CREDIT_WINDOW, WINDOW_BYTES  # the bench learner is a shard's DataChannel

    assert report["settings"]["credit_window"] == CREDIT_WINDOW and report["settings"]["window_bytes"] == WINDOW_BYTES
    assert report["settings"]["secure"] is True
    counters = report["broker_counters"]
    # each round of each payload (one each here) ran on its own processes, with an open and a closed broker, each
    # one accounted for
    assert counters["brokers"] == 4 and counters["received"] > 0 and counters["accounted"] is True
    assert sum(counters["dropped"].values()) == 0


def test_summed_broker_counters() -> None:
    """One broker per round of each payload: the report adds their counters and is accounted only if each
    one was."""
    from zddrl.bench.bus import _summed

    a = {"received": 10, "forwarded": 9, "dropped": {"malformed": 1, "stale": 0}, "accounted": True}
    b = {"received": 5, "forwarded": 5, "dropped": {"malformed": 0, "stale": 0}, "accounted": True}
    assert _summed([a, b]) == {
        "brokers": 2,
        "received": 15,
        "forwarded": 14,
        "dropped": {"malformed": 1, "stale": 0},
        "accounted": True,
    }
    assert _summed([a, {**b, "accounted": False}])["accounted"] is False
    assert _summed([a, {"received": None, "forwarded": None, "dropped": None, "accounted": None}])["accounted"] is False
    assert _summed([])["accounted"] is False


@pytest.mark.slow
def test_bench_bus_rejects_bad_payloads() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "zddrl", "bench", "bus", "--payloads", "12"],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 2
    assert "--payloads" in proc.stderr


@pytest.mark.slow
def test_bench_codec_json() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "zddrl", "bench", "codec", "--json", "--passes", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["bench"] == "codec" and report["target"]["ratio"] > 1 and report["target"]["hot_ratio"] > 1
    assert {r["payload_bytes"] for r in report["codec"]} == {1 << 20, 8 << 20}


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_bench_relay_smoke() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "relay", "--json", "--windows", "2", "--seconds", "0.2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=80,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert len(report["ratios"]) == 2 and report["relay_over_direct_median"] > 0
    assert report["accounting"] and all(a["accounted"] for a in report["accounting"].values())


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_bench_bus_measures_the_local_bus_beside_loopback_tcp() -> None:
    """``--ipc``: the broker on the local bus (ipc sockets, `zddrl train`'s default) in the same rounds as the broker
    on loopback TCP, and their ratio per payload; its directory goes at the end."""
    report = bench_bus("--ipc")
    local = [r for r in report["results"] if r["path"] == "local"]
    assert [r["payload_bytes"] for r in local] == [4096, 65536] and all(r["msgs_per_s"] > 0 for r in local)
    assert all(r["local_over_broker"] > 0 for r in report["ratios"])
    assert report["settings"]["ipc"] is True
    counters = report["broker_counters"]
    assert counters["brokers"] == 4 and counters["accounted"] is True and sum(counters["dropped"].values()) == 0
