"""A learner that no broker welcomes: one line that says so, a non-zero exit, no run directory; a stop signal
while it waits ends it at once."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import pytest

from conftest import Procs, wait_for
from zddrl.config import Config
from zddrl.learner import welcome
from zddrl.learner.node import LearnerNode, NotJoined
from zddrl.proc import free_ports

CARTPOLE = Path(__file__).resolve().parents[2] / "examples" / "cartpole_ppo.toml"


def test_no_broker_answering_is_one_line_and_leaves_no_run_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(welcome, "WELCOME_TIMEOUT_S", 1.0)
    (dead,) = free_ports(1)
    node = LearnerNode(f"tcp://127.0.0.1:{dead}", Config(), tmp_path / "run")
    with pytest.raises(NotJoined, match=rf"^no broker answered at tcp://127.0.0.1:{dead} within 1 s: start"):
        node.run(threading.Event())
    assert not (tmp_path / "run").exists()


def test_a_stop_signal_ends_a_learner_still_waiting_for_a_broker(procs: Procs, tmp_path: Path) -> None:
    (dead,) = free_ports(1)
    connect, run_dir = f"tcp://127.0.0.1:{dead}", tmp_path / "run"
    learner = procs.start("learner", "learner", str(CARTPOLE), "--connect", connect, "--run-dir", str(run_dir))
    # Its link reports the silence once it is trying: the signal handlers are in place by then.
    wait_for(lambda: "silent; reconnecting" in procs.log("learner"), 60, "the learner to try the dead broker")

    t0 = time.monotonic()
    learner.send_signal(signal.SIGTERM)
    wait_for(lambda: learner.poll() is not None, 10, "the learner to stop")  # ~1 s here; margin for a loaded CI
    elapsed = time.monotonic() - t0

    log = procs.log("learner")
    assert learner.returncode == 1 and elapsed < 10, log[-2000:]
    assert f"Error: stopped before a broker answered at {connect}: no run was started" in log
    assert "Traceback" not in log
    assert not run_dir.exists()
