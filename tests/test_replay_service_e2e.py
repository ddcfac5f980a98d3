"""End to end on real processes (docs/protocol.md section 5.9): a broker, a `zddrl replay` with a state directory,
an Ape-X learner sampling from it and an actor. The replay is killed (-9) and started again: it loads its saved
buffer and the learner goes on training. Then the learner is killed and a new one starts: the replay keeps the
buffer for the new run, which trains at its first update instead of waiting for learning_starts again. And two
replays behind one broker: each takes part of the data by credit and serves part of the learner's batches."""

from __future__ import annotations

import csv
import signal
from pathlib import Path

import pytest

from broker_clients import counters, status
from conftest import BrokerHandle, Bus, Procs, wait_for
from zddrl.proc import free_ports

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
CONFIG = """
name = "svc"
[env]
id = "CartPole-v1"
num_envs = 4
rollout_len = 16
[model]
hidden = [32, 32]
activation = "relu"
[algo]
name = "apex"
batch_size = 128
lr = 1e-3
[replay]
placement = "service"
capacity = 20000
batch_size = 32
learning_starts = 1000
replay_ratio = 0.25
[train]
max_seconds = 120.0
max_steps = 10000000
"""
WAIT_S = 60.0


def rows(run_dir: Path) -> list[dict[str, str]]:
    try:
        with open(run_dir / "metrics.csv") as f:
            return list(csv.DictReader(f))
    except FileNotFoundError:
        return []


def grad_steps(run_dir: Path) -> int:
    return sum(int(r["grad_steps"]) for r in rows(run_dir))


def test_the_buffer_survives_a_replay_kill_and_a_learner_restart(
    procs: Procs, broker: BrokerHandle, bus: Bus, tmp_path: Path
) -> None:
    config = tmp_path / "svc.toml"
    config.write_text(CONFIG)
    (port,) = free_ports(1)
    endpoint, state = f"tcp://127.0.0.1:{port}", tmp_path / "replay-state"
    replay_args = ["replay", "--connect", broker.connect, "--bind", endpoint, "--state-dir", str(state)]
    replay_args += ["--save-every-s", "1"]
    replay = procs.start("replay", *replay_args)

    def learner(name: str) -> tuple:
        run_dir = tmp_path / name
        args = ["learner", str(config), "--connect", broker.connect, "--run-dir", str(run_dir), "--replay", endpoint]
        return procs.start(name, *args), run_dir

    first, run1 = learner("learner-1")
    procs.start("actor", "actor", "--connect", broker.connect, "--actor-id", "0")

    wait_for(lambda: grad_steps(run1) >= 200, WAIT_S, "the learner to train on the replay's batches")
    wait_for(lambda: (state / "replay_state.json").exists(), WAIT_S, "the replay to save its state")
    replay.send_signal(signal.SIGKILL)
    replay.wait(10)
    before = grad_steps(run1)
    replay = procs.start("replay-again", *replay_args)
    wait_for(lambda: "loaded" in procs.log("replay-again"), WAIT_S, "the new replay to load the saved buffer")
    wait_for(lambda: grad_steps(run1) >= before + 200, WAIT_S, "the learner to train again after the replay's restart")

    first.send_signal(signal.SIGKILL)
    first.wait(10)
    second, run2 = learner("learner-2")
    wait_for(lambda: "kept" in procs.log("replay-again"), WAIT_S, "the replay to keep its buffer for the new run")
    wait_for(lambda: rows(run2), WAIT_S, "the new learner's first update")
    head = rows(run2)[0]
    assert int(head["replay_size"]) >= 1000, head  # the old run's data, there from the start
    assert int(head["grad_steps"]) > 0, head  # no wait for learning_starts: it trains at its first update
    c = counters(broker, bus)
    assert c["received"] == c["forwarded"] + sum(c["dropped"].values()) + c["in_flight"]
    assert procs.stop(second) == 0 and replay.poll() is None


def test_two_replays_behind_one_broker_share_the_data_and_serve_one_learner(
    procs: Procs, broker: BrokerHandle, bus: Bus, tmp_path: Path
) -> None:
    config = tmp_path / "svc.toml"
    config.write_text(CONFIG)
    endpoints = [f"tcp://127.0.0.1:{port}" for port in free_ports(2)]
    for i, endpoint in enumerate(endpoints):
        name = f"replay-{i}"
        procs.start(name, "replay", "--connect", broker.connect, "--bind", endpoint, "--replay-id", name)
    run = tmp_path / "learner"
    args = ["learner", str(config), "--connect", broker.connect, "--run-dir", str(run), "--replay", ",".join(endpoints)]
    learner = procs.start("learner", *args)
    for i in range(2):
        procs.start(f"actor-{i}", "actor", "--connect", broker.connect, "--actor-id", str(i))

    def stat(name: str) -> list[int]:
        members = status(broker, bus)["members"]
        return [int(members.get(f"replay-{i}", {}).get("stats", {}).get(name, 0)) for i in range(2)]

    wait_for(lambda: grad_steps(run) >= 200, WAIT_S, "the learner to train on batches from two replays")
    wait_for(lambda: min(stat("inserted")) > 0, WAIT_S, "both replays to take in data by credit")
    wait_for(lambda: min(stat("served")) > 0, WAIT_S, "both replays to serve parts of the learner's batches")
    c = counters(broker, bus)
    assert c["received"] == c["forwarded"] + sum(c["dropped"].values()) + c["in_flight"]
    assert procs.stop(learner) == 0  # before the replays it samples from (the fixture stops them in start order)
