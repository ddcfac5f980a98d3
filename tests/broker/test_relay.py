"""A relay broker (a Broker with an upstream: broker/upstream.py) between actors and a root broker: in-process
nodes on threads, real sockets.

A root ``Broker`` and a relay (a ``Broker`` whose config names an upstream) run their loops on threads, bound on
random loopback ports with short heartbeats; the learner shard and the actors are the test clients of
broker_clients.py (a BrokerLink and a data socket each). Every wait is on a condition with a deadline.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import zmq

from broker_clients import (
    WAIT_S,
    Pusher,
    Shard,
    collect,
    learner_hello,
    parameters,
    relay_key_dirs,
    run_spec,
    trajectory,
)
from conftest import Bus, wait_for
from zddrl import protocol as P
from zddrl.broker.broker import Broker
from zddrl.broker.upstream import RelayRefused
from zddrl.config import BrokerConfig
from zddrl.keys import credentials, new_key, relay_credentials
from zddrl.ops.status import format_status
from zddrl.transport.signatures import signed_hello, signed_params

pytestmark = pytest.mark.slow

FAST = {"heartbeat_interval_s": 0.1, "heartbeat_liveness": 10}
"""Quick beats (reports every 0.1 s), but 1 s of silence before a session ends: two shared cores under load stall
a loop for a few tenths of a second now and then."""


@dataclass
class Node:
    """A broker (or relay) running on a thread; ``connect`` is its control endpoint."""

    broker: Broker
    thread: threading.Thread
    stop: threading.Event

    @property
    def connect(self) -> str:
        return f"tcp://127.0.0.1:{self.broker.ports['control']}"

    def status(self) -> dict:
        """The status body, read on the broker's thread's own data (a snapshot: the loop keeps running)."""
        for _ in range(50):
            try:
                return self.broker.status()
            except RuntimeError:  # a dict changed size while the loop ran: read again
                time.sleep(0.005)
        raise AssertionError("no consistent status")


@contextmanager
def nodes() -> Iterator[list[Node]]:
    started: list[Node] = []

    def start(broker: Broker) -> Node:
        broker.bind()
        stop = threading.Event()
        thread = threading.Thread(target=broker.run, args=(stop,), daemon=True)
        thread.start()
        started.append(Node(broker, thread, stop))
        return started[-1]

    try:
        yield start  # type: ignore[misc]
    finally:
        for node in reversed(started):
            node.stop.set()
            node.thread.join(timeout=5)
            node.broker.close()


def root_and_relay(start, **relay: object) -> tuple[Node, Node]:
    root = start(Broker(BrokerConfig(bind="tcp://127.0.0.1:*", **FAST)))
    cfg = BrokerConfig(bind="tcp://127.0.0.1:*", upstream=root.connect, **FAST, **relay)  # type: ignore[arg-type]
    return root, start(Broker(cfg))


def start_learner(bus: Bus, root: Node, run_id: str = "run-r") -> Shard:
    shard = Shard(bus, root, "learner-0", run_id, run_spec(mode="impala", max_staleness=4))  # type: ignore[arg-type]
    shard.publish(0)
    return shard


def test_relayed_actors_reach_the_learner_with_their_ids_runs_and_versions(bus: Bus) -> None:
    with nodes() as start:
        root, relay = root_and_relay(start)
        shard = start_learner(bus, root)
        wait_for(lambda: relay.broker.current.policy_version == 0, WAIT_S, "version 0 at the relay")
        actors = [Pusher(bus, relay, f"actor-{i}") for i in range(2)]  # type: ignore[arg-type]
        for a in actors:
            welcome = a.link.wait_welcome(WAIT_S, need_run=True)
            assert welcome is not None and welcome.run_id == "run-r", "the relay passes the run down"
            params = a.link.wait_params(-1, WAIT_S)
            assert params is not None and params.policy_version == 0, "a late joiner gets the relay's cached version"
        fleet = wait_for(lambda: (f := shard.link.fleet()) and len(f[1]) == 2 and f, WAIT_S, "both in the fleet")
        assert set(fleet[1]) == {"actor-0", "actor-1"}  # type: ignore[index]

        shard.grant(64)
        for seq in range(10):
            for a in actors:
                assert a.send(trajectory("run-r", a.peer_id, seq, version=0))
        collect([shard], 20)
        got = sorted((t.peer_id, t.seq, t.policy_version, t.run_id) for t in shard.trajectories())
        assert got == sorted((a.peer_id, s, 0, "run-r") for a in actors for s in range(10))

        shard.publish(1)  # a new version reaches the relayed actors through the relay's PUB
        for a in actors:
            assert (p := a.link.wait_params(0, WAIT_S)) is not None and p.policy_version == 1

        def settled() -> bool:
            r = relay.status()["broker"]
            return (
                r["forwarded"] == 20
                and root.status()["broker"]["relays"].get(relay_id(relay), {}).get("forwarded") == 20
            )

        wait_for(settled, WAIT_S, "the relay's report to count all 20")
        body = root.status()
        b = body["broker"]
        assert b["accounted"] and b["accounted_subtree"] and b["received"] == b["forwarded"] == 20
        view = b["relays"][relay_id(relay)]
        assert view["actors"] == 2 and view["accounted"] and view["read_here"] == 20
        assert view["upstream_acked"] + view["upstream_in_flight"] == 20 and view["upstream_lost"] == 0
        for a in actors:
            row = body["members"][a.peer_id]
            assert row["relay"] == relay_id(relay) and row["messages"] == 10
        assert body["members"][relay_id(relay)]["role"] == "relay"
        text = format_status(body)  # what `zddrl status` prints at the root
        assert f"actor via {relay_id(relay)}" in text and "whole tree accounted: ok" in text
        assert "upstream" in format_status(relay.status()) and "(welcomed)" in format_status(relay.status())


def relay_id(node: Node) -> str:
    up = node.broker.upstream
    assert up is not None
    return up.uplink.hello.peer_id


def test_a_learner_that_stops_reading_stops_the_relayed_actors(bus: Bus) -> None:
    """Credit end to end: with the learner's credit spent, the root stops reading, the relay's window fills, the
    relay stops reading and the actor's sends block; granting credit again lets everything through, none lost."""
    window = 8
    with nodes() as start:
        root, relay = root_and_relay(start, upstream_window=window, trajectory_hwm=2)
        shard = start_learner(bus, root)
        actor = Pusher(bus, relay, "actor-0", sndhwm=2)  # type: ignore[arg-type]
        assert actor.link.wait_params(-1, WAIT_S) is not None
        shard.grant(4)
        sent = 0
        # Large enough that the kernel's socket buffers hold only a few: what stops the actor is the relay.
        while actor.send(trajectory("run-r", "actor-0", sent, version=0, nbytes=256 << 10), timeout_ms=500):
            sent += 1
            assert sent < 200, "the actor was never stopped"
        r = relay.status()["broker"]
        print(f"\nsent {sent} before blocking; relay received {r['received']}, window {window}")
        # Each upstream session holds at most a window (a session lost to a stall starts a new one; what it held is
        # counted as lost, not forgotten).
        up = r["upstream"]
        assert up["in_flight"] <= window and r["received"] <= 4 + window * up["sessions"]
        assert r["forwarded"] == up["acked_total"] + up["in_flight"] + up["lost"]
        assert root.status()["broker"]["forwarded"] == 4
        collect([shard], sent, regrant=True, timeout_s=WAIT_S)  # credit again: all of it arrives, in order per actor
        assert [t.seq for t in shard.trajectories()] == list(range(sent))
        wait_for(lambda: relay.status()["broker"]["received"] == sent, WAIT_S, "the relay to count them all")
        r = relay.status()["broker"]
        assert r["accounted"] and r["forwarded"] == sent and sum(r["dropped"].values()) == 0


def test_a_relay_refuses_learners_and_the_root_refuses_a_relayed_id_held_by_a_direct_actor(bus: Bus) -> None:
    with nodes() as start:
        root, relay = root_and_relay(start)
        start_learner(bus, root)
        link = bus.link(relay.connect, learner_hello("learner-x", "other", run_spec()))
        wait_for(lambda: link.refused, WAIT_S, "the relay to refuse a learner")
        assert "relay takes no learners" in str(link.refused)
        direct = Pusher(bus, root, "actor-0")  # type: ignore[arg-type]
        assert direct.link.wait_welcome(WAIT_S) is not None
        relayed = bus.link(relay.connect, P.Hello(role="actor", peer_id="actor-0", host="elsewhere", pid=1))
        assert relayed.wait_welcome(WAIT_S) is not None  # the relay has no way to know; the root refuses it
        wait_for(lambda: root.status()["broker"]["relayed_refused"] >= 1, WAIT_S, "the root to refuse the claim")
        assert root.status()["members"]["actor-0"].get("relay") is None, "the direct actor keeps its id"


def test_a_closed_tree_relay_key_speaks_only_for_the_actors_its_relay_reported(bus: Bus, tmp_path: Path) -> None:
    """Keys everywhere, laid out as docs/security.md says: the relay serves its actors with a broker pair of its
    own and joins the root with its relay key and the root's public key (never its secret); it checks the run's
    and each version's signature, and its actors train through it; the relay's key cannot push for an actor joined
    directly to the root (forged_sender) nor for one nobody reported (unknown_sender)."""
    keys = tmp_path / "keys"
    for role, name in [("broker", "b"), ("learner", "l"), ("actor", "d")]:
        new_key(keys, role, name)
    relay_keys, actor_keys_dir = relay_key_dirs(keys, tmp_path)
    assert not (relay_keys / "broker" / "b.key_secret").exists()
    with nodes() as start:
        root = start(Broker(BrokerConfig(bind="tcp://127.0.0.1:*", keys=str(keys), **FAST)))  # type: ignore[arg-type]
        relay_cfg = BrokerConfig(
            bind="tcp://127.0.0.1:*",
            upstream=root.connect,
            keys=str(relay_keys),
            **FAST,  # type: ignore[arg-type]
        )
        relay = start(Broker(relay_cfg, credentials=relay_credentials(relay_keys)))
        learner = credentials(keys, "learner", "l")
        assert learner.signer is not None
        hello = signed_hello(learner_hello("learner-0", "run-k", run_spec()), learner.signer)
        link = bus.link(root.connect, hello, credentials=learner)
        assert link.wait_welcome(WAIT_S) is not None
        data = bus.socket(zmq.DEALER, identity=link.data_identity, rcvhwm=0)
        learner.apply(data)
        data.connect(link.endpoint("learners"))
        data.send_multipart(P.encode(signed_params(parameters("run-k", 0), learner.signer)))
        data.send_multipart(P.encode(P.Credit(peer_id="learner-0", credit=16)))

        actor_keys = credentials(actor_keys_dir, "actor", "a")
        actor = bus.link(relay.connect, P.Hello(role="actor", peer_id="actor-0", num_envs=1), credentials=actor_keys)
        params = actor.wait_params(-1, WAIT_S)
        assert params is not None and params.signer == "l", "a signed version, verified by the actor, via the relay"
        push = bus.socket(zmq.PUSH)
        actor_keys.apply(push)
        push.connect(actor.endpoint("trajectories"))
        push.send_multipart(P.encode(trajectory("run-k", "actor-0", 0)))
        assert data.poll(int(WAIT_S * 1000)), "the relayed trajectory reached the learner"
        got = P.decode(data.recv_multipart())
        assert isinstance(got, P.Trajectory) and got.peer_id == "actor-0"

        direct = bus.link(
            root.connect, P.Hello(role="actor", peer_id="actor-d"), credentials=credentials(keys, "actor", "d")
        )
        assert direct.wait_welcome(WAIT_S) is not None
        forger = bus.socket(zmq.PUSH)  # the relay's key, straight to the root, naming others
        relay_credentials(relay_keys).apply(forger)
        forger.connect(f"tcp://127.0.0.1:{root.broker.ports['trajectories']}")
        forger.send_multipart(P.encode(trajectory("run-k", "actor-d", 0)))
        forger.send_multipart(P.encode(trajectory("run-k", "actor-nobody", 0)))
        wait_for(lambda: root.status()["broker"]["received"] == 3, WAIT_S, "the root to read all three")
        b = root.status()["broker"]
        assert b["dropped"]["forged_sender"] == 1 and b["dropped"]["unknown_sender"] == 1 and b["forwarded"] == 1


def test_a_relay_survives_a_hostile_upstream(bus: Bus) -> None:
    """Garbage and a welcome naming no data ports, from a fake upstream: counted, and the relay serves on; a refusal
    stops it with the reason (the CLI's one-line error)."""
    upstream = bus.socket(zmq.ROUTER)
    port = upstream.bind_to_random_port("tcp://127.0.0.1")
    relay = Broker(BrokerConfig(bind="tcp://127.0.0.1:*", upstream=f"tcp://127.0.0.1:{port}", **FAST))  # type: ignore
    relay.bind()
    upstream_side = relay.upstream
    assert upstream_side is not None
    try:
        upstream_side.serve({}, time.monotonic())  # opens the session: a hello goes up
        assert upstream.poll(int(WAIT_S * 1000))
        identity, *frames = upstream.recv_multipart()
        assert isinstance(P.decode(frames), P.Hello) and P.decode(frames).role == "relay"  # type: ignore[attr-defined]
        bad_welcome = P.Welcome(
            peer_id="x", run_id="", run=None, ports={}, heartbeat_interval_s=0.1, heartbeat_liveness=3,
            max_message_bytes=1 << 20,
        )  # fmt: skip
        for frames in ([b"garbage", b"more"], P.encode(bad_welcome)):
            upstream.send_multipart([identity, *frames])
        control = upstream_side.uplink.control
        assert control is not None
        wait_for(lambda: control.poll(0), WAIT_S, "the messages to arrive")
        time.sleep(0.05)  # both of them
        upstream_side.serve({control: zmq.POLLIN}, time.monotonic())
        assert relay.counters["upstream_malformed"] == 1 and relay.counters["upstream_errors"] == 1
        upstream.send_multipart([identity, *P.encode(P.Reject(reason=f"{P.REFUSED_PREFIX}no relays here"))])
        wait_for(lambda: control.poll(0), WAIT_S, "the refusal")
        with pytest.raises(RelayRefused, match="no relays here"):
            upstream_side.serve({control: zmq.POLLIN}, time.monotonic())
    finally:
        relay.close()
