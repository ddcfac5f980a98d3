"""`zddrl bench bus` end to end with tiny settings: real worker processes, real broker, JSON out."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

TINY = ["--json", "--seconds", "0.3", "--rounds", "1", "--payloads", "4096",
        "--broadcast-sizes", "100000", "--subscribers", "1"]


@pytest.mark.timeout(90)
def test_bench_bus_smoke() -> None:
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "zddrl", "bench", "bus", *TINY], capture_output=True, text=True,
                          timeout=80, stdin=subprocess.DEVNULL)
    wall = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert wall < 30, f"the tiny bench took {wall:.1f} s"

    rows = report["results"]
    assert sorted(r["path"] for r in rows) == ["broker", "direct", "proxy"]
    for row in rows:
        assert row["payload_bytes"] == 4096
        assert row["msgs_per_s"] > 0 and row["mb_per_s"] > 0

    (ratio,) = report["ratios"]
    assert ratio["payload_bytes"] == 4096 and ratio["broker_over_proxy"] > 0
    assert ratio["met"] is None  # the target applies from 64 KiB on

    (bcast,) = report["broadcast"]
    assert bcast["payload_bytes"] == 100000 and bcast["subscribers"] == 1 and bcast["latency_ms"] > 0

    codecs = {(r["codec"], r["payload_bytes"], r["data"]) for r in report["codec"]}
    assert {(c, 1 << 20, d) for c in ("zddrl", "pickle", "msgpack-numpy") for d in ("fresh", "hot")} <= codecs
    assert all(r["encode_us"] > 0 and r["decode_us"] > 0 for r in report["codec"])
    assert all(r["encode_decode_us"] == pytest.approx(r["encode_us"] + r["decode_us"], abs=0.02)
               for r in report["codec"])

    target = report["targets"]["codec_vs_pickle"]
    assert isinstance(target["met"], bool) and target["data"] == "fresh" and target["hot_ratio"] > 0
    from zddrl.channel import CREDIT_WINDOW, WINDOW_BYTES  # the bench learner is a shard's DataChannel
    assert report["settings"]["credit_window"] == CREDIT_WINDOW and report["settings"]["window_bytes"] == WINDOW_BYTES
    counters = report["broker_counters"]
    assert counters["received"] > 0 and counters["accounted"] is True
    assert sum(counters["dropped"].values()) == 0


def test_bench_bus_rejects_bad_payloads() -> None:
    proc = subprocess.run([sys.executable, "-m", "zddrl", "bench", "bus", "--payloads", "12"], capture_output=True,
                          text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert proc.returncode == 2
    assert "--payloads" in proc.stderr


def test_bench_codec_json() -> None:
    proc = subprocess.run([sys.executable, "-m", "zddrl", "bench", "codec", "--json", "--passes", "1"],
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["bench"] == "codec" and report["target"]["ratio"] > 1 and report["target"]["hot_ratio"] > 1
    assert {r["payload_bytes"] for r in report["codec"]} == {1 << 20, 8 << 20}
