"""`python -m benchmarks replay` end to end with a tiny capacity: both workloads, JSON out, the bytes accounted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.replay import fitting_capacity

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_bench_replay_smoke() -> None:
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "benchmarks", "replay", "--json"),
            *("--capacity", "5000", "--seconds", "0.05", "--learner-threads", "1"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=50,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["batch"] == 256 and report["rollout"] == {"T": 32, "N": 8}
    rows = {r["workload"]: r for r in report["results"]}
    assert set(rows) == {"cartpole", "atari"}
    for r in rows.values():
        assert r["capacity"] == 5000 and r["capacity_note"] == ""
        assert min(r["fill_per_s"], r["insert_per_s"], r["sample_per_s"], r["sample_update_per_s"]) > 0
        assert r["bare_min_bytes"] < r["bytes_per_slot"] < r["bytes_per_transition"]
    atari = rows["atari"]
    assert atari["obs_dtype"] == "uint8" and atari["bare_min_bytes"] == 4 * 84 * 84 + 8 + 5
    assert atari["bytes_per_transition"] < 1.1 * atari["bare_min_bytes"] < atari["naive_bytes"]
    learners = {r["mode"]: r for r in report["learners"]}
    assert set(learners) == {"apex", "sac"} and all(r["threads"] == 1 for r in learners.values())
    assert all(r["grad_steps_per_s"] > 0 and r["env_steps_per_s_bound"] > 0 for r in learners.values())


def test_capacity_shrinks_to_what_fits_and_says_so() -> None:
    assert fitting_capacity(10**6, (4,), "float32", 1e9) == (10**6, "")
    capacity, note = fitting_capacity(10**6, (4, 84, 84), "uint8", 7 * 2**30)
    assert 200_000 <= capacity < 7 * 2**30 / 28_224 and capacity % 10_000 == 0
    assert "capacity 1,000,000 would need 26.3 GiB" in note and f"{capacity:,}" in note


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_bench_replay_service_smoke() -> None:
    """The service rows: a real broker and `zddrl replay`, rollouts pushed through them and batches sampled back."""
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "benchmarks", "replay", "--json", "--workloads", "cartpole"),
            *("--capacity", "5000", "--seconds", "0.05", "--learner-threads", ""),
            *("--service", "--service-capacity", "5000"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=110,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = json.loads(proc.stdout)["service"]
    assert row["workload"] == "cartpole" and row["placement"] == "service" and row["timeouts"] == 0
    assert row["rollouts_timed"] == 5000 // 256
    assert min(row["insert_per_s"], row["sample_per_s"], row["sample_update_per_s"]) > 0
    assert row["insert_per_s_vs_local"] > 0
