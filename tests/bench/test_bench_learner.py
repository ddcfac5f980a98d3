"""`zddrl bench learner` end to end with tiny settings: real shard processes, a real broker, JSON out."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

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


@pytest.mark.timeout(150)
def test_bench_learner_smoke() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "zddrl", "bench", "learner", *TINY],
        capture_output=True,
        text=True,
        timeout=140,
        stdin=subprocess.DEVNULL,
    )
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
