"""End to end: a tree of brokers. A root, two relays under it, a learner on the root, one actor on each relay.

Real `zddrl` processes on a short-heartbeat profile. Sync PPO trains CartPole through the relays (the learner's
fleet names both relayed actors, so every round waits for both); the root's status shows the subtree with the
accounting invariant per broker. Then relay A gets kill -9: its actor (started with ``--connect A,B``) moves to
relay B, the root forgets A's subtree, training goes on, and every broker still accounts for all it read.

On a closed tree, `zddrl broker --upstream ROOT --keys DIR --key NAME` starts with DIR laid out as docs/security.md
says (its own broker pair, the root's public key, its relay key), never the root's secret.
"""

from __future__ import annotations

import shutil
import signal
import time
from pathlib import Path

import pytest
import zmq

from broker_clients import ProfiledBroker, cli, learner_hello, parameters, relay_key_dirs, run_spec, trajectory
from conftest import Bus, Procs, wait_for
from test_train import CARTPOLE, metrics
from zddrl import protocol as P
from zddrl.keys import credentials, new_key
from zddrl.transport.signatures import signed_hello, signed_params
from zddrl.transport.status import request_status

pytestmark = pytest.mark.slow

HEARTBEAT = {"heartbeat_interval_s": 0.2, "heartbeat_liveness": 5}
"""Silence of 1 s and a client (or a relay) moves on (0.6 s let stalls of a loaded 2-core machine end sessions)."""
START_S = 90
"""For the first updates: on a loaded machine the learner's torch import alone has taken over 40 s."""
ACTORS = ("actor-0", "actor-1")
MORE_UPDATES = 5
"""Updates the run must make after relay A was killed."""


def node(tmp_path: Path, name: str, *options: str, **settings: object) -> tuple[Procs, ProfiledBroker]:
    folder = tmp_path / name
    folder.mkdir()
    procs = Procs(folder)
    return procs, ProfiledBroker(procs, folder, **HEARTBEAT, **settings).start(*options)


def status(connect: str, creds: object = None) -> dict:
    body = request_status(connect, 2.0, credentials=creds)  # type: ignore[arg-type]
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


def test_a_closed_relay_serves_with_its_own_key_and_holds_only_the_roots_public_key(tmp_path: Path, bus: Bus) -> None:
    """The relay's --keys holds its own broker pair, the root's public key and its relay key (docs/security.md,
    "Relays"): it starts with --key choosing its pair, joins the root, and a signed version and a trajectory go
    through it. A relay directory with no upstream key (the old layout: the root's own pair) is refused in one line."""
    keys = tmp_path / "keys"
    for role, name in [("broker", "root"), ("learner", "l"), ("monitor", "m")]:
        new_key(keys, role, name)
    relay_keys, actor_keys = relay_key_dirs(keys, tmp_path, broker="edge")
    assert sorted(p.name for p in (relay_keys / "broker").iterdir()) == ["edge.key", "edge.key_secret", "root.key"]
    root_procs, root = node(tmp_path, "root", "--keys", str(keys))
    relay_procs, relay = node(
        tmp_path, "relay", "--keys", str(relay_keys), "--key", "edge", upstream=root.connect
    )  # fmt: skip
    try:
        learner = credentials(keys, "learner", "l")
        assert learner.signer is not None
        shard = bus.link(
            root.connect,
            signed_hello(learner_hello("learner-0", "run-k", run_spec()), learner.signer),
            credentials=learner,
        )
        assert shard.wait_welcome(10) is not None
        data = bus.socket(zmq.DEALER, identity=shard.data_identity, rcvhwm=0)
        learner.apply(data)
        data.connect(shard.endpoint("learners"))
        data.send_multipart(P.encode(signed_params(parameters("run-k", 0), learner.signer)))
        data.send_multipart(P.encode(P.Credit(peer_id="learner-0", credit=4)))
        actor_creds = credentials(actor_keys, "actor", "a")
        actor = bus.link(relay.connect, P.Hello(role="actor", peer_id="actor-0", num_envs=1), credentials=actor_creds)
        params = actor.wait_params(-1, 20)
        assert params is not None and params.signer == "l", "a signed version from the root, through the relay"
        push = bus.socket(zmq.PUSH)
        actor_creds.apply(push)
        push.connect(actor.endpoint("trajectories"))
        push.send_multipart(P.encode(trajectory("run-k", "actor-0", 0)))
        assert data.poll(10_000), "the relayed trajectory reached the learner"
        got = P.decode(data.recv_multipart())
        assert isinstance(got, P.Trajectory) and got.peer_id == "actor-0"
        row = status(root.connect, credentials(keys, "monitor", "m"))["members"]["actor-0"]
        assert row["relay"].startswith("relay-")
    finally:
        relay_procs.stop_all()
        root_procs.stop_all()
    old_layout = tmp_path / "old-layout"  # the root's pair copied to the relay host, as once needed
    shutil.copytree(keys / "broker", old_layout / "broker")
    shutil.copytree(relay_keys / "relays", old_layout / "relays")
    refused = cli("broker", "--upstream", root.connect, "--keys", str(old_layout), "--bind", "tcp://127.0.0.1:*")
    assert refused.returncode == 2, refused.stderr
    assert "upstream's public key" in refused.stderr and "never its secret" in refused.stderr, refused.stderr
