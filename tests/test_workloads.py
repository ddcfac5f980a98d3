"""Real workloads end to end (issue #15): Atari from pixels with a CNN and uint8 on the wire, and MuJoCo, each
through the real processes. Short smoke runs: a few updates, not learning."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import BrokerHandle, Procs
from zddrl import protocol as P
from zddrl.bench.sample import CountingLearner
from zddrl.config import load_config

pytestmark = pytest.mark.slow  # every test here starts real zddrl processes

ROOT = Path(__file__).resolve().parent.parent


def smoke(example: str, run_dir: Path, *overrides: str) -> dict:
    """``zddrl train examples/EXAMPLE`` with small sizes; its summary."""
    sets = [arg for o in overrides for arg in ("--set", o)]
    done = subprocess.run(
        [sys.executable, "-m", "zddrl", "train", f"examples/{example}", "--run-dir", str(run_dir), *sets],
        capture_output=True,
        text=True,
        timeout=90,
        cwd=run_dir.parent,  # mujoco writes MUJOCO_LOG.TXT into the working directory
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_breakout_with_the_impala_cnn_trains_through_zddrl_train(tmp_path: Path) -> None:
    pytest.importorskip("ale_py")
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    summary = smoke(
        "breakout_impala.toml",
        tmp_path / "run",
        "env.num_envs=2",
        "env.rollout_len=8",
        "algo.batch_size=16",
        "train.actors=1",
        "train.max_steps=48",
        "train.max_seconds=60",
    )
    assert summary["updates"] >= 2 and summary["total_env_steps"] >= 48
    assert summary["dropped_invalid"] == {} and summary["learner_restarts"] == 0


def test_halfcheetah_trains_through_zddrl_train(tmp_path: Path) -> None:
    pytest.importorskip("mujoco")
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    summary = smoke(
        "halfcheetah_ppo.toml",
        tmp_path / "run",
        "env.rollout_len=32",
        "algo.batch_size=128",
        "algo.minibatches=4",
        "train.max_steps=384",
        "train.max_seconds=60",
    )
    assert summary["updates"] >= 3 and summary["dropped_invalid"] == {}


def test_a_real_actor_sends_atari_frames_as_uint8(procs: Procs, broker: BrokerHandle) -> None:
    """A `zddrl actor` process on Breakout: its trajectories carry [T, N, 4, 84, 84] uint8 observations."""
    pytest.importorskip("ale_py")
    from zddrl.algos.model import ActorCritic, flatten_params
    from zddrl.envs import probe_spec

    config = load_config(
        ROOT / "examples" / "pong_ppo.toml",
        {
            "env.rollout_len": 4,
            "env.num_envs": 2,
            "algo.name": "ppo",
            "algo.schedule": "async",
            "bus.max_staleness": 1000,
        },
    )
    flat, layout = flatten_params(ActorCritic(probe_spec(config.env), config.model))
    learner = CountingLearner(broker.connect, config, flat, layout)
    try:
        procs.start("actor", "actor", "--connect", broker.connect, "--actor-id", "0")
        deadline, msg = time.monotonic() + 60, None
        while not isinstance(msg, P.Trajectory):
            assert time.monotonic() < deadline, procs.log("actor")[-3000:]
            msg = learner.channel.recv(100)
        learner.channel.ack()
    finally:
        learner.close()
    for name in ("obs", "next_obs"):
        assert msg.arrays[name].dtype == np.uint8, name
    assert msg.arrays["obs"].shape == (4, 2, 4, 84, 84) and msg.arrays["obs"].max() > 0
