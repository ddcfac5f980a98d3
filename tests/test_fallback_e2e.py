"""End to end: a learner and an actor given a fallback list move to the second broker when the first is killed.

Two real brokers on a short-heartbeat profile; the clients train CartPole through A, then A gets kill -9: both
clients fall silent on A, move to B, the learner announces its run there again (its hello carries the run
spec), trajectories flow through B, and learning goes on.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from broker_clients import ProfiledBroker
from conftest import Procs, wait_for
from test_train import CARTPOLE, metrics
from zddrl.transport.status import request_status

pytestmark = pytest.mark.slow

HEARTBEAT = {"heartbeat_interval_s": 0.2, "heartbeat_liveness": 3}
"""Silence of 0.6 s and a client moves on."""
IMPALA = str(Path(CARTPOLE).parent / "cartpole_impala.toml")
MORE_UPDATES = 10
"""Updates the run must make through B after A was killed."""


def broker(tmp_path: Path, name: str) -> tuple[Procs, ProfiledBroker]:
    """A profiled broker with its own folder (profile, ready file, log) and its own Procs."""
    folder = tmp_path / name
    folder.mkdir()
    procs = Procs(folder)
    return procs, ProfiledBroker(procs, folder, **HEARTBEAT).start()


def counters(connect: str) -> dict:
    body = request_status(connect, 2.0)
    assert body is not None, f"no status from {connect}"
    return body


@pytest.mark.parametrize("config", [CARTPOLE, IMPALA], ids=["sync", "impala"])
def test_both_clients_move_to_the_fallback_broker_when_the_first_is_killed(
    config: str, procs: Procs, tmp_path: Path
) -> None:
    (procs_a, a), (procs_b, b) = broker(tmp_path, "a"), broker(tmp_path, "b")
    try:
        run_dir = tmp_path / "run"
        both = f"{a.connect},{b.connect}"
        limits = [f"--set=train.{k}" for k in ("until_return=1e9", "max_seconds=50", "max_steps=100000000")]
        learner = procs.start("learner", "learner", config, "--connect", both, "--run-dir", str(run_dir), *limits)
        procs.start("actor", "actor", "--connect", both, "--actor-id", "0")
        wait_for(lambda: (run_dir / "metrics.csv").exists() and len(metrics(run_dir)) >= 3, 30, "3 updates through A")
        run_id = counters(a.connect)["broker"]["run_id"]
        assert run_id and counters(b.connect)["members"] == {}, "the clients talk to the first broker only"

        assert a.proc is not None
        a.proc.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        a.proc.wait(timeout=10)
        before = len(metrics(run_dir))
        wait_for(lambda: counters(b.connect)["broker"]["forwarded"] > 0, 20, "a trajectory through B", interval_s=0.05)
        print(f"\nkill -9 of broker A to the first trajectory forwarded by B: {time.monotonic() - killed:.2f} s")
        wait_for(lambda: len(metrics(run_dir)) >= before + MORE_UPDATES, 30, f"{MORE_UPDATES} updates through B")

        body = counters(b.connect)
        assert body["broker"]["run_id"] == run_id, "the learner announced its run to B"
        assert body["broker"]["accounted"] and body["broker"]["forwarded"] > 0
        assert {"learner-0", "actor-0"} <= set(body["members"])
        assert learner.poll() is None
        versions = [int(r["policy_version"]) for r in metrics(run_dir)]
        assert versions == sorted(versions) and len(set(versions)) == len(versions)
        for name in ("learner", "actor"):
            assert f"broker at {a.connect} silent; moving to the broker at {b.connect}" in procs.log(name), name
    finally:
        procs.stop_all()  # the clients first: a broker stopped under them would only make them move again
        procs_a.stop_all()
        procs_b.stop_all()
