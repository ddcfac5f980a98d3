"""`python -m benchmarks handshakes` end to end with tiny settings: a real closed-bus CartPole run (broker, learner,
actor), a flood process of strangers' handshakes, the broker's counters and CPU read per window."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.serial  # its figures need the machine to itself (tests/phases.py)

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_bench_handshakes_smoke() -> None:
    args = ["--json", "--kind", "mixed", "--rate", "40", "--windows", "1", "--seconds", "2"]
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "handshakes", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=230,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    quiet, flood = report["quiet"], report["flood"]
    assert quiet["failed_per_s"] == 0 and quiet["made_per_s"] == 0
    assert flood["made_per_s"] > 20 and flood["failed_per_s"] > 20, flood  # half refused at ZAP, half before it
    assert 0 < flood["zap_denied_per_s"] < flood["failed_per_s"], flood
    assert quiet["versions_per_s"] > 0 and flood["broker_cpu"] > 0 and report["accounted"] is True
    assert report["broker_handshake_log_lines"] <= 2, "refusals are logged once per interval, not per handshake"
