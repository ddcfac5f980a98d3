"""The suite's two phases (tests/phases.py): the serial tests run after every other, with no other test running
beside them; the others are spread over the workers; without xdist everything still runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent

SUITE = """
import json, os, time
import pytest

def record(name):
    start = time.monotonic()
    time.sleep(0.3)
    with open(os.environ["PHASES_LOG"], "a") as f:
        f.write(json.dumps([name, os.environ.get("PYTEST_XDIST_WORKER", ""), start, time.monotonic()]) + "\\n")

@pytest.mark.parametrize("i", range(6))
def test_parallel(i):
    record(f"parallel-{i}")

@pytest.mark.slow
@pytest.mark.parametrize("i", range(2))
def test_slow(i):
    record(f"slow-{i}")

@pytest.mark.serial
@pytest.mark.parametrize("i", range(3))
def test_serial(i):
    record(f"serial-{i}")
"""


def run_suite(tmp_path: Path, *args: str) -> list[tuple[str, str, float, float]]:
    (tmp_path / "test_suite.py").write_text(SUITE)
    (tmp_path / "conftest.py").write_text('pytest_plugins = ("phases",)\n')
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow: slow\n    serial: alone\n")
    log = tmp_path / "log.jsonl"
    env = {**os.environ, "PHASES_LOG": str(log), "PYTHONPATH": str(HERE)}
    env.pop("PYTEST_XDIST_WORKER", None)  # the outer suite's worker, if any, is not the inner one's
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [tuple(json.loads(line)) for line in log.read_text().splitlines()]  # type: ignore[misc]


@pytest.mark.slow
def test_serial_tests_run_last_and_alone_while_the_others_spread(tmp_path: Path) -> None:
    rows = run_suite(tmp_path, "-n", "2")
    assert sorted(r[0] for r in rows) == sorted(
        [f"parallel-{i}" for i in range(6)] + ["slow-0", "slow-1"] + [f"serial-{i}" for i in range(3)]
    )
    serial = [r for r in rows if r[0].startswith("serial")]
    others = [r for r in rows if not r[0].startswith("serial")]
    assert len({r[1] for r in others}) == 2, others  # both workers ran tests of the parallel phase
    first_serial = min(r[2] for r in serial)
    assert all(r[3] <= first_serial for r in others), rows  # every other test had ended
    for a in serial:
        for b in serial:
            assert a is b or a[3] <= b[2] or b[3] <= a[2], rows  # one at a time
    assert [r[0] for r in sorted(serial, key=lambda r: r[2])] == ["serial-0", "serial-1", "serial-2"]
    by_start = [r[0] for r in sorted(others, key=lambda r: r[2])]
    assert {"slow-0", "slow-1"} <= set(by_start[:4]), by_start  # handed out first, two queued per worker


@pytest.mark.slow
def test_without_xdist_every_test_runs_in_one_process(tmp_path: Path) -> None:
    rows = run_suite(tmp_path, "-p", "no:xdist")
    assert len(rows) == 11 and {r[1] for r in rows} == {""}


def test_each_worker_draws_free_ports_from_a_range_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    import conftest
    from zddrl import proc

    ranges = []
    for worker in range(4):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", f"gw{worker}")
        monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "4")
        monkeypatch.delenv(proc.PORT_RANGE_ENV, raising=False)
        conftest.pytest_configure(None)  # type: ignore[arg-type]
        low, high = (int(p) for p in os.environ[proc.PORT_RANGE_ENV].split("-"))
        assert all(low <= port < high for port in proc.free_ports(8))
        ranges.append((low, high))
    assert all(a[1] <= b[0] for a, b in zip(ranges, ranges[1:])), ranges
    assert ranges[0][0] >= proc.LOWEST_PORT and ranges[-1][1] <= proc._ephemeral_start()
    monkeypatch.setenv(proc.PORT_RANGE_ENV, "not a range")
    assert proc.free_ports(1)[0] > 0


def test_the_longest_tests_handed_out_first_exist() -> None:
    import phases

    for prefix in phases.LONGEST:
        path, name = prefix.split("::")
        assert f"def {name}(" in (HERE.parent / path).read_text(), prefix
