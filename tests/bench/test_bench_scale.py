"""`python -m benchmarks scale`: the pieces of the report, and one tiny real run (the env latency it sets:
tests/actor/test_slow_envs.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import scale as S

pytestmark = pytest.mark.serial  # its figures need the machine to itself (tests/phases.py)

ROOT = Path(__file__).resolve().parents[2]


def test_steady_sps_leaves_out_start_up(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.csv"
    metrics.write_text("wall_s,env_steps\n5.0,256\n6.0,1256\n7.0,2256\n")
    assert S.steady_sps(metrics) == pytest.approx(1000.0)
    metrics.write_text("wall_s,env_steps\n5.0,256\n")
    assert S.steady_sps(metrics) is None
    assert S.steady_sps(tmp_path / "missing.csv") is None


def test_train_command_sets_the_point() -> None:
    args = {"envs": 2, "latency_ms": 3.0, "seconds": 20.0, "seed": 4, "sets": ["algo.lr=1e-4"]}
    cmd = S.train_command(Path("c.toml"), "impala", 8, args, Path("/tmp/r"))
    text = " ".join(cmd)
    for part in (
        "train c.toml",
        "--algorithm impala --schedule async",
        "--seed 4",
        "train.actors=8",
        "env.num_envs=2",
        "train.env_latency_ms=3.0",
        f"train.max_seconds={20.0 + S.START_UP_BACKSTOP_S}",
        "algo.lr=1e-4",
    ):
        assert part in text


def test_table_shows_failed_and_missing_figures() -> None:
    ok = {
        "mode": "sync",
        "actors": 2,
        "sps": 1234.0,
        "sps_steady": None,
        "wall_s_to_target": None,
        "env_steps_to_target": None,
        "dropped": 0,
    }
    table = S.format_table([ok, {"mode": "async", "actors": 4, "error": "boom"}])
    assert "1,234" in table and "failed: boom" in table


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_bench_scale_smoke(tmp_path: Path) -> None:
    """Two real impala runs of 1 and 2 actors at 20 ms per env step: the latency bounds each actor's rate (at most
    50 env steps/s), and the second actor adds throughput."""
    png = tmp_path / "scale.png"
    cmd = [sys.executable, "-m", "benchmarks", "scale", "--json", "--modes", "impala", "--actors", "1,2"]
    # A 3 s window: ~5 updates of 32 env steps for 1 actor, ~10 for 2 (sps_steady runs from the first to the last).
    cmd += ["--env-latency-ms", "20", "--seconds", "3", "--plot", str(png), "--set", "env.rollout_len=16"]
    cmd += ["--set", "algo.batch_size=32"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=110, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["bench"] == "scale" and report["settings"]["actors"] == [1, 2]
    one, two = report["points"]
    assert "error" not in one and "error" not in two, report["points"]
    assert one["sps_steady"] is not None and two["sps_steady"] is not None
    assert one["sps_steady"] <= 55, f"1 actor at 20 ms per step made {one['sps_steady']} env steps/s"
    assert two["sps_steady"] > 1.3 * one["sps_steady"], report["points"]
    assert png.stat().st_size > 10_000
