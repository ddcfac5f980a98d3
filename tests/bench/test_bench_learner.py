"""`zddrl bench learner` end to end with tiny settings: real shard processes, a real broker, JSON out."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from zddrl.learner.runlog import CPU_UNITS, hardware

pytestmark = pytest.mark.slow  # every test here starts real zddrl processes

TINY = [
    "--json",
    "--shards",
    "1,2",
    "--hidden",
    "16,16",
    "--batch",
    "1024",
    "--updates",
    "1",
    "--epochs",
    "1",
    "--minibatches",
    "2",
    "--subscribers",
    "1,2",
    "--dtypes",
    "float32,bfloat16",
    "--broadcast-hidden",
    "256,256",
    "--chunk-bytes",
    "65536",
]


def bench_learner(*options: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "zddrl", "bench", "learner", *options],
        capture_output=True,
        text=True,
        timeout=140,
        stdin=subprocess.DEVNULL,
    )


@pytest.mark.timeout(150)
def test_bench_learner_smoke() -> None:
    proc = bench_learner(*TINY)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    rows = {(r["shards"], r["threads_per_shard"]): r for r in report["throughput"]}
    assert set(rows) == {(1, 1), (2, 1), (1, 2)}
    assert all(r["samples_per_s"] > 0 and r["batch"] == 1024 for r in rows.values())
    assert rows[(1, 1)]["collective_share"] == 0 and rows[(2, 1)]["collective_share"] > 0
    cells = {(r["param_dtype"], r["subscribers"]): r for r in report["broadcast"]}
    assert set(cells) == {("float32", 1), ("float32", 2), ("bfloat16", 1), ("bfloat16", 2)}
    assert cells[("float32", 1)]["wire_bytes"] == 2 * cells[("bfloat16", 1)]["wire_bytes"]
    assert cells[("float32", 1)]["chunks"] > 1 and all(r["latency_ms"] > 0 for r in cells.values())
    assert report["pickle"]["ms"] > 0
    hardware = report["hardware"]  # a figure says what it was measured on: the same VM type varies 2x by host
    assert hardware["cpu"] and hardware["logical_cores"] == os.cpu_count()
    assert set(hardware["cpu_units"]) <= set(CPU_UNITS)


@pytest.mark.serial  # a bound on a benchmark's wall time (tests/phases.py)
@pytest.mark.timeout(200)
def test_bench_learner_measures_and_profiles_a_run_config_with_and_without_autocast() -> None:
    """``--profile`` applies to every row: each autocast's update is accounted for by region; auto's row says what
    it chose on this host and why."""
    options = ["--json", "--shards", "1", "--updates", "1", "--no-broadcast", "--autocast", "off,bf16,auto"]
    proc = bench_learner(*options, "--profile", "--config", "examples/breakout_impala.toml")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout)["throughput"]
    assert [(r["autocast"], r["autocast_mode"]) for r in rows[:2]] == [("off", "off"), ("bf16", "bf16")]
    auto = rows[2]
    assert auto["autocast"] == "auto" and auto["autocast_mode"] in ("off", "bf16") and auto["autocast_reason"]
    if not set(hardware()["cpu_units"]) & {"avx512_bf16", "amx_bf16"}:  # no bf16 units: float32, by rule
        assert auto["autocast_mode"] == "off" and "none of avx512_bf16, amx_bf16" in auto["autocast_reason"]
    assert all(r["model"] == "nature_cnn" and r["mode"] == "impala" and r["batch"] == 640 for r in rows)
    assert all(r["samples_per_s"] > 0 for r in rows)
    for row in rows:
        shares = row["profile"]["shares"]
        assert set(shares) == {"forward", "value", "backward", "gradients", "optimizer", "other"}
        region_ms = row["profile"]["region_ms"]  # ms, not shares: emulated bf16 makes Adam's share round to 0.000
        assert region_ms["forward"] > 0 and region_ms["backward"] > 0 and region_ms["optimizer"] > 0, row["autocast"]
        assert region_ms["value"] > 0, "V-trace bootstraps and targets run no-grad value passes"
        assert sum(shares.values()) == pytest.approx(1.0, abs=0.01)
        assert row["profile"]["top_ops"] and all(ms >= 0 for _, ms in row["profile"]["top_ops"])


def test_bench_learner_refuses_a_bad_autocast_and_a_replay_config() -> None:
    for options, error in (
        (["--autocast", "fp8"], "--autocast takes values of"),
        (["--config", "examples/cartpole_apex.toml"], "no on-policy learner"),
    ):
        proc = bench_learner(*options)
        assert proc.returncode == 2 and error in proc.stderr, proc.stderr[-2000:]
