"""Checkpoints and resume: atomic writes, pruning, exact state round trip, SIGKILL mid-run then resume."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import wait_for
from samples import cartpole_trajectory
from test_train import CARTPOLE, ROOT, metrics, processes_mentioning, zddrl
from zddrl.algos.ppo.learner import PPOLearner
from zddrl.config import Config
from zddrl.envs import EnvSpec
from zddrl.learner.runlog import RunLog, latest_checkpoint, load_checkpoint


def test_learner_state_round_trip_continues_identically() -> None:
    config = Config().replace({"algo.normalize_obs": True, "algo.normalize_reward": True})
    a = PPOLearner(config, EnvSpec((4,), True, 2))
    a.update([cartpole_trajectory(8, 4)])
    state = a.state()
    b = PPOLearner(config.replace({"env.seed": 99}), EnvSpec((4,), True, 2))  # different init and RNG
    b.load_state(state)
    b.update([cartpole_trajectory(8, 4, seq=1)])
    torch.set_rng_state(state["torch_rng"])  # both cores share this process's global RNG
    a.update([cartpole_trajectory(8, 4, seq=1)])
    np.testing.assert_array_equal(a.params()[0], b.params()[0])  # weights, Adam moments, RNG, statistics


def test_checkpoints_are_atomic_pruned_and_loaded_safely(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = RunLog(tmp_path, Config().to_dict())
    for version in range(5):
        log.checkpoint({"policy_version": version, "w": torch.ones(3) * version}, f"ckpt-{version:08d}.pt", keep=2)
    assert [p.name for p in sorted((tmp_path / "checkpoints").glob("ckpt-*.pt"))] == [
        "ckpt-00000003.pt",
        "ckpt-00000004.pt",
    ]
    (tmp_path / "checkpoints" / "ckpt-00000009.pt.tmp").write_bytes(b"half a checkpoint")  # a write cut short

    def crash_mid_write(obj, f, *args, **kwargs):
        f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash_mid_write)
    with pytest.raises(OSError):
        log.checkpoint({"policy_version": 5}, "ckpt-00000005.pt", keep=2)
    latest = latest_checkpoint(tmp_path)
    assert latest.name == "ckpt-00000004.pt" and load_checkpoint(latest)["policy_version"] == 4
    log.close()


@pytest.mark.slow
def test_sigkill_mid_run_then_resume_reaches_the_target_with_monotonic_counters(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "zddrl",
            "train",
            CARTPOLE,
            "--run-dir",
            str(run_dir),
            "--set",
            "train.checkpoint_every=10",
            "--set",
            "train.until_return=1e9",
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        wait_for(
            lambda: latest_checkpoint(run_dir) is not None and len(metrics(run_dir)) >= 25,
            90,
            "checkpoints and 25 updates",
        )
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the orchestrator and everything in its session, no warning
        proc.wait(timeout=10)
    wait_for(lambda: processes_mentioning(str(run_dir)) == [], 15, "every process of the killed run to be gone")
    before = metrics(run_dir)
    ckpt_version = load_checkpoint(latest_checkpoint(run_dir))["policy_version"]
    done = zddrl("train", CARTPOLE, "--resume", str(run_dir), "--until-return", "195", "--max-seconds", "90")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = metrics(run_dir)
    versions = [int(r["policy_version"]) for r in rows]
    steps = [int(r["env_steps"]) for r in rows]
    assert versions == list(range(1, len(rows) + 1))  # continues from the checkpoint, no gap, no repeat
    assert all(b >= a for a, b in zip(steps, steps[1:]))
    assert rows[:ckpt_version] == before[:ckpt_version]
    assert len(rows) > ckpt_version and float(rows[-1]["return_mean_20"]) >= 195  # updates of the resumed run


def test_the_first_checkpoint_follows_the_first_update_then_the_schedule(tmp_path: Path) -> None:
    from zddrl.config import Config
    from zddrl.learner.checkpoints import Checkpoints

    train = Config().replace({"train.checkpoint_every": 5, "train.checkpoint_every_s": 3600}).train
    log = RunLog(tmp_path, {})
    try:
        ckpt = Checkpoints(log, train)
        assert not ckpt.due(0) and ckpt.due(1)  # a crash in the first minute must not lose everything
        ckpt.write({"policy_version": 1}, 1, 1)
        assert (tmp_path / "checkpoints" / "ckpt-00000001.pt").exists()
        assert [u for u in range(1, 11) if ckpt.due(u)] == [5, 10]  # then every checkpoint_every updates
    finally:
        log.close()
