"""End to end: a tree of brokers. A root, two relays under it, a learner on the root, one actor on each relay.

Real `zddrl` processes on a short-heartbeat profile. Sync PPO trains CartPole through the relays (the learner's
fleet names both relayed actors, so every round waits for both); the root's status shows the subtree with the
accounting invariant per broker. Then relay A gets kill -9: its actor (started with ``--connect A,B``) moves to
relay B, the root forgets A's subtree, training goes on, and every broker still accounts for all it read.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from broker_clients import ProfiledBroker
from conftest import Procs, wait_for
from test_train import CARTPOLE, metrics
from zddrl.ops.status import request_status

pytestmark = pytest.mark.slow

HEARTBEAT = {"heartbeat_interval_s": 0.2, "heartbeat_liveness": 5}
"""Silence of 1 s and a client (or a relay) moves on (0.6 s let stalls of a loaded 2-core machine end sessions)."""
START_S = 90
"""For the first updates: on a loaded machine the learner's torch import alone has taken over 40 s."""
ACTORS = ("actor-0", "actor-1")
MORE_UPDATES = 5
"""Updates the run must make after relay A was killed."""


def node(tmp_path: Path, name: str, **settings: object) -> tuple[Procs, ProfiledBroker]:
    folder = tmp_path / name
    folder.mkdir()
    procs = Procs(folder)
    return procs, ProfiledBroker(procs, folder, **HEARTBEAT, **settings).start()


def status(connect: str) -> dict:
    body = request_status(connect, 2.0)
    assert body is not None, f"no status from {connect}"
    return body


def relays_of(body: dict) -> dict:
    return body["broker"]["relays"]


def test_actors_train_through_two_relays_and_move_when_one_is_killed(procs: Procs, tmp_path: Path) -> None:
    root_procs, root = node(tmp_path, "root")
    a_procs, a = node(tmp_path, "relay-a", upstream=root.connect)
    b_procs, b = node(tmp_path, "relay-b", upstream=root.connect)
    try:
        run_dir = tmp_path / "run"
        limits = [f"--set=train.{k}" for k in ("until_return=1e9", "max_seconds=200", "max_steps=100000000")]
        run = ("--connect", root.connect, "--run-dir", str(run_dir), *limits)
        learner = procs.start("learner", "learner", CARTPOLE, *run)
        procs.start("actor-0", "actor", "--connect", f"{a.connect},{b.connect}", "--actor-id", "0")
        procs.start("actor-1", "actor", "--connect", b.connect, "--actor-id", "1")
        wait_for(lambda: (run_dir / "metrics.csv").exists() and len(metrics(run_dir)) >= 3, START_S, "3 updates")

        wait_for(
            lambda: all(status(root.connect)["members"].get(a, {}).get("policy_version", -1) >= 0 for a in ACTORS),
            10,
            "the root to show the versions the relayed actors act with",
        )
        body = status(root.connect)
        rows = body["members"]
        relay_a = rows["actor-0"]["relay"]
        assert rows["actor-1"]["relay"] != relay_a and rows[relay_a]["role"] == "relay"
        assert body["broker"]["fleet_actors"] == 2 and body["broker"]["accounted_subtree"]
        assert all(r["accounted"] and r["forwarded"] > 0 for r in relays_of(body).values())
        versions = {int(r["policy_version"]) for r in metrics(run_dir)}
        assert len(versions) >= 3, "sync rounds went on with both relayed actors"

        assert a.proc is not None
        a.proc.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        a.proc.wait(timeout=10)
        before = len(metrics(run_dir))
        wait_for(
            lambda: status(root.connect)["members"].get("actor-0", {}).get("relay") not in (None, relay_a),
            20,
            "actor-0 to join the root again through relay B",
        )
        print(f"\nkill -9 of relay A to actor-0 at the root through relay B: {time.monotonic() - killed:.2f} s")
        wait_for(lambda: len(metrics(run_dir)) >= before + MORE_UPDATES, 40, f"{MORE_UPDATES} more updates")

        wait_for(lambda: relay_a not in relays_of(status(root.connect)), 10, "the root to expire relay A")
        body = status(root.connect)
        assert relay_a not in body["members"]
        assert body["broker"]["accounted_subtree"] and learner.poll() is None
        (view,) = relays_of(body).values()
        assert view["actors"] == 2 and view["accounted"] and view["upstream_in_flight"] <= view["counters"]["window"]
        rb = status(b.connect)["broker"]
        assert rb["accounted"] and set(status(b.connect)["members"]) == {"actor-0", "actor-1"}
        assert "silent; moving to the broker at" in procs.log("actor-0")
        versions_seen = [int(r["policy_version"]) for r in metrics(run_dir)]
        assert versions_seen == sorted(versions_seen)
    finally:
        procs.stop_all()  # the clients first: a broker stopped under them would only make them move again
        a_procs.stop_all()
        b_procs.stop_all()
        root_procs.stop_all()
