"""`zddrl actor --procs N`: N actor processes from one command, ids --actor-id .. --actor-id + N - 1, all gone on
one SIGTERM."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from conftest import BrokerHandle, Procs, wait_for
from zddrl.ops.actor_procs import child_args, process_count

pytestmark = pytest.mark.slow  # real broker, learner and actor processes

ROOT = Path(__file__).resolve().parents[2]


def children_of(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def test_procs_starts_one_actor_per_id_and_one_signal_stops_them_all(
    procs: Procs, broker: BrokerHandle, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    procs.start(
        "learner", "learner", str(ROOT / "examples" / "cartpole_ppo.toml"), "--connect", broker.connect,
        "--run-dir", str(run_dir), "--set", "train.until_return=1e9", "--set", "train.max_seconds=60",
    )  # fmt: skip
    fleet = procs.start("actors", "actor", "--connect", broker.connect, "--actor-id", "5", "--procs", "3")
    wait_for(lambda: len(children_of(fleet.pid)) == 3, 30, "three actor processes")
    children = children_of(fleet.pid)
    wait_for(lambda: (run_dir / "metrics.csv").exists(), 60, "the first update")
    fleet.send_signal(signal.SIGTERM)
    assert fleet.wait(timeout=30) == 0
    assert not [pid for pid in children if Path(f"/proc/{pid}").exists() and "zombie" not in _state(pid)]
    log = procs.log("actors")
    assert "3 actor processes started, ids 5..7" in log
    for i in (5, 6, 7):  # each its own id: env j of actor i is seeded 1 + i * 1000 + j
        assert f"seeds {1 + i * 1000}..{4 + i * 1000}" in log, log[-2000:]


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split("\n")[0].lower()
    except (OSError, IndexError):
        return "zombie"


def test_the_children_get_this_commands_options() -> None:
    args = child_args("tcp://a:1,tcp://b:2", 8, 1.0, 0.0, None, ("m:f",), "/keys", "fleet")
    assert args[:2] == ["--connect", "tcp://a:1,tcp://b:2"] and ["--envs", "8"] == args[6:8]
    assert ["--allow-code", "m:f", "--keys", "/keys", "--key", "fleet"] == args[-6:]
    assert process_count("3") == 3 and process_count("auto") >= 1
    with pytest.raises(ValueError):
        process_count("0")
    assert json.dumps(args)  # plain strings: a command line
