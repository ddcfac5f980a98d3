"""`python -m benchmarks fleet` end to end with tiny settings (real broker, learner stub, simulated actors), and
its checks."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import click
import pytest

from benchmarks import fleet as F
from benchmarks.fleet_report import scaling
from benchmarks.fleet_sim import raise_nofile

pytestmark = pytest.mark.serial  # its figures need the machine to itself (tests/phases.py)

ROOT = Path(__file__).resolve().parents[2]

TINY = ["--json", "--actors", "1,8", "--seconds", "1"]
"""A window of one heartbeat interval: in one of 0.5 s, 8 actors beating at random phases sent no stats once."""


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_bench_fleet_smoke() -> None:
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "fleet", *TINY],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=80,
        stdin=subprocess.DEVNULL,
    )
    wall = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert wall < 30, f"the tiny bench took {wall:.1f} s"
    assert report["bench"] == "fleet" and report["settings"]["actors"] == [1, 8]

    points = report["points"]
    assert [p["actors"] for p in points] == [1, 8]
    for p in points:
        n, acc, control, data = p["actors"], p["accounting"], p["control_only"], p["data"]
        # every trajectory sent was read by the broker, forwarded (none dropped), and reached the stub
        assert acc["accounted"] is True and acc["drained"] is True and acc["all_delivered"] is True
        assert acc["sent"] == acc["received"] == acc["forwarded"] == acc["stub_received"] > 0
        assert acc["dropped"] == {} and acc["in_flight"] == 0
        assert acc["stub_actors"] == n  # every simulated actor's data got through
        assert p["broker_counters"]["actors_joined"] == n
        assert p["broker_counters"]["hello_limited"] == p["broker_counters"]["hello_over_cap"] == 0
        assert control["reconnects"] == control["rejects"] == data["reconnects"] == 0
        assert 0 <= control["broker_cpu_share"] < 2
        assert control["heartbeats_per_s"] > 0 or n == 1  # one beat a second each way: one window's edges may miss both
        assert control["hellos_per_s"] == 0  # joined before the window: no hello in steady state
        assert control["stats_per_s"] > 0 or n == 1  # one a second each, as zddrl actor sends them
        assert data["trajectories_per_s"] > 0 and data["broker_cpu_us_per_traj"] > 0
        assert 0 < data["latency_ms"]["p50"] <= data["latency_ms"]["p99"] <= data["latency_ms"]["max"]
        assert data["credits_per_s"] > 0  # the broker returned the actors' credit
        assert p["broker_rss_mb"]["data"] > 0

    comparison = report["proxy_comparison"]
    assert comparison["actors"] == 8 and comparison["broker_over_proxy"] > 0
    assert comparison["proxy"]["trajectories_per_s"] > 0 and comparison["proxy"]["forwarder_cpu_us_per_traj"] > 0
    assert comparison["proxy"]["all_delivered"] is True and comparison["broker"]["all_delivered"] is True
    assert report["scaling"]["control_plane"]["met"] is None  # judged only with 1,024 actors
    assert report["scaling"]["per_actor_cost"]["met"] is None  # judged from 64 actors


def _point(actors: int, share: float) -> dict:
    return {"actors": actors, "control_only": {"broker_cpu_share": share}}


def test_scaling_goals() -> None:
    # an idle loop of 0.2 % plus 80 us per actor per second: flat
    points = [_point(n, 0.002 + 80e-6 * n) for n in (1, 64, 256, 1024)]
    report = scaling(points)
    assert report["control_plane"] == {
        "actors": 1024,
        "broker_cpu_share": points[-1]["control_only"]["broker_cpu_share"],
        "threshold": 0.1,
        "met": True,
    }
    per_actor = report["per_actor_cost"]
    assert per_actor["marginal_us_per_actor_s"] == {"64": 80.0, "256": 80.0, "1024": 80.0}
    assert per_actor["largest_over_cheapest"] == 1.0 and per_actor["met"] is True
    assert report["fit"] == {"fixed_share": 0.002, "us_per_actor_s": 80.0}
    # a cost that grows with N (a quadratic term) is not flat, and 1,024 actors over 10 % miss the first goal
    grown = scaling([_point(n, 0.002 + 80e-6 * n + 1e-7 * n * n) for n in (1, 64, 256, 1024)])
    assert grown["per_actor_cost"]["met"] is False and grown["control_plane"]["met"] is False


def test_too_few_file_descriptors_fail_early(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(resource, "getrlimit", lambda _: (1024, 2048))
    with pytest.raises(click.ClickException, match="1024 actors.*RLIMIT_NOFILE"):
        F.check_nofile(1024, 256)
    F.check_nofile(256, 64)  # 3 x 256 + margin fits
    with pytest.raises(RuntimeError, match="needs about 4096 file descriptors but RLIMIT_NOFILE allows 2048"):
        raise_nofile(4096, "a worker")
