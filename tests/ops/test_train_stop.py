"""`zddrl train` at its edges: a misspelt env id is one line before anything is written; a Ctrl-C says what
was saved and how to resume, instead of click's bare "Aborted!"."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from conftest import Procs, wait_for
from zddrl.learner.runlog import latest_checkpoint

CARTPOLE = str(Path(__file__).resolve().parents[2] / "examples" / "cartpole_ppo.toml")


def test_a_misspelt_env_id_is_one_line_and_writes_nothing(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "zddrl", "train", CARTPOLE, "--set", "env.id=CartPol-v1"],
        cwd=tmp_path,  # the default run directory (train.run_dir = "runs") would be made here
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "unknown gymnasium env id 'CartPol-v1'" in errors[0], done.stderr
    assert "Traceback" not in done.stderr
    assert list(tmp_path.iterdir()) == []


def test_ctrl_c_says_what_was_saved_and_how_to_resume(procs: Procs, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    train = procs.start("train", "train", CARTPOLE, "--actors", "1", "--run-dir", str(run_dir), "--max-seconds", "120")
    wait_for(lambda: latest_checkpoint(run_dir) or train.poll() is not None, 90, "the first checkpoint")
    assert train.poll() is None, procs.log("train")[-2000:]

    train.send_signal(signal.SIGINT)  # what a terminal's Ctrl-C sends it
    wait_for(lambda: train.poll() is not None, 30, "zddrl train to stop")

    log = procs.log("train")
    newest = latest_checkpoint(run_dir)
    assert train.returncode == 130 and newest is not None, log[-2000:]
    assert f"interrupted: the run is saved in {run_dir}, newest checkpoint {newest.name}; " in log, log[-2000:]
    assert f"resume with: zddrl train {run_dir / 'config.toml'} --resume {run_dir}" in log
    assert "Aborted!" not in log and "Traceback" not in log
