"""Malformed input is dropped, counted by reason, logged rate-limited; the broker keeps serving.

The broker runs as a real `zddrl broker` process, driven over raw pyzmq sockets by the test-side clients of
tests/broker_clients.py; malformed input is crafted frame by frame. Every wait is on a condition with a deadline;
the fixtures clean up every socket, link and process.
"""

from __future__ import annotations

import json
from typing import Any

import msgpack
import pytest
import zmq

from broker_clients import (
    WAIT_S,
    Pusher,
    cli,
    collect,
    counters,
    parameters,
    recv_control,
    start_run,
    status,
    trajectory,
)
from conftest import BrokerHandle, Bus, Procs, wait_for
from zddrl import protocol as P

pytestmark = pytest.mark.slow  # every test here starts real zddrl processes

# ------------------------------------------------------------------------------------------------
# 5. Malformed input is dropped, counted by reason, logged rate-limited; the broker keeps serving
# ------------------------------------------------------------------------------------------------


def bad_trajectories(run_id: str) -> dict[str, list[list[bytes]]]:
    """Bad messages by the drop reason the broker must count them under."""
    good = [bytes(f) for f in P.encode(trajectory(run_id, "actor-0", 999))]
    header = msgpack.unpackb(good[1])

    def with_header(**changes: Any) -> list[bytes]:
        return [good[0], msgpack.packb({**header, **changes}), *good[2:]]

    return {
        "malformed": [
            [b"\x00garbage"],  # one frame of junk
            [b"garbage", b"more garbage"],  # two frames of junk
            [b"XXXX\x01", good[1], good[2]],  # wrong signature
            [P.SIGNATURE + b"\x09", good[1], good[2]],  # unknown protocol version
            [good[0], b"\xc1not msgpack", good[2]],  # header not msgpack
            with_header(arrays=[["rewards", "complex64", [8]]]),  # dtype not allowed
            [good[0], good[1], good[2][:-3]],  # frame size != shape x dtype
            [good[0], good[1]],  # array frame missing
            with_header(seq="seven"),  # field of the wrong type
            [bytes(f) for f in P.encode(P.Heartbeat(peer_id="x"))],  # not a trajectory
        ],
        "unknown_sender": [[bytes(f) for f in P.encode(trajectory(run_id, "never-said-hello", 999))]],
        "unknown_run": [[bytes(f) for f in P.encode(trajectory("no-such-run", "actor-0", 998))]],
        "unknown_version": [
            [bytes(f) for f in P.encode(trajectory(run_id, "actor-0", 997, version=7))],
            [bytes(f) for f in P.encode(trajectory(run_id, "actor-0", 996, version=-1))],
        ],
    }


def test_malformed_trajectories_are_dropped_by_reason_and_valid_ones_arrive(
    broker: BrokerHandle, procs: Procs, bus: Bus
) -> None:
    shard = start_run(bus, broker)
    shard.grant(1000)
    actor = Pusher(bus, broker, "actor-0")
    bad = bad_trajectories("run-a")
    seq = 0
    for messages in bad.values():
        for frames in messages:
            assert actor.send(trajectory("run-a", "actor-0", seq))
            assert actor.send(frames)
            seq += 1
    flood = 200
    for i in range(flood):  # a flood of junk must not flood the log
        assert actor.send([b"junk-%d" % i])
    assert actor.send(trajectory("run-a", "actor-0", seq))
    seq += 1
    collect([shard], seq, regrant=False)
    assert [t.seq for t in shard.trajectories()] == list(range(seq))

    expected = {"malformed": len(bad["malformed"]) + flood, "unknown_sender": 1, "unknown_run": 1, "unknown_version": 2}
    total = seq + sum(expected.values())
    wait_for(lambda: counters(broker, bus)["received"] == total, WAIT_S, "every message to be read")
    body = status(broker, bus)
    b = body["broker"]
    assert b["dropped"] == {
        "malformed": expected["malformed"],
        "unknown_sender": 1,
        "forged_sender": 0,
        "unknown_run": 1,
        "stale": 0,
        "unknown_version": 2,
        "no_route": 0,
    }
    assert b["forwarded"] == seq and b["accounted"] is True
    assert b["received"] == b["forwarded"] + sum(b["dropped"].values()) + b["in_flight"]
    actor_row = body["members"]["actor-0"]  # drops with a readable peer_id are charged to it
    assert actor_row["dropped_unknown_run"] == 1 and actor_row["dropped_unknown_version"] == 2
    # malformed ones too when their header names it: bad dtype, frame size, missing frame, bad seq
    assert actor_row["dropped_malformed"] == 5  # the unknown-version one is attributable too (protocol.md 8)

    log = procs.log("broker")
    lines = [ln for ln in log.splitlines() if "dropped a malformed trajectory" in ln]
    assert 1 <= len(lines) <= 3, f"{len(lines)} log lines for {expected['malformed']} malformed messages"
    assert "dropped a trajectory of unknown run 'no-such-run'" in log
    assert "never published" in log
    assert "dropped a trajectory from 'never-said-hello', which is not an actor that joined with hello" in log
    assert broker.proc.poll() is None


def test_malformed_control_and_learner_messages_do_not_stop_the_broker(broker: BrokerHandle, bus: Bus) -> None:
    shard = start_run(bus, broker)
    hello = P.encode(P.Hello(role="actor", peer_id="a"))
    mixed_keys = msgpack.packb({"kind": "hello", "role": "actor", "peer_id": "a", b"x": 1, "y": 2}, use_bin_type=True)

    control = bus.socket(zmq.DEALER)
    control.connect(broker.connect)
    control.send_multipart(P.encode(P.Hello(role="actor", peer_id="raw-actor")))
    assert isinstance(recv_control(control), P.Welcome)  # a member: its misplaced data is malformed
    bad_control = [
        [b"junk"],
        [b"XXXX\x01", hello[1]],
        [P.PREAMBLE, b"\xc1"],
        [P.PREAMBLE, msgpack.packb({"kind": "no-such-kind"})],
        [P.PREAMBLE, mixed_keys],  # bytes and str keys together
        [*hello, b"an extra frame"],
        [bytes(f) for f in P.encode(trajectory("run-a", "a", 0))],  # data on the control socket
        P.encode(P.Hello(role="overlord", peer_id="x")),  # unknown role
        P.encode(P.Hello(role="learner", peer_id="y", run_id="other-run")),  # new run without spec
        # the run spec is opaque to the broker; what it reads of the run is the hello's bus, which must be usable
        P.encode(P.Hello(role="learner", peer_id="z", run_id="bad-bus", run={}, bus={"sync": True})),
        P.encode(
            P.Hello(
                role="learner",
                peer_id="z",
                run_id="bad-bus",
                run={"algo": [1, 2]},
                bus={"sync": False, "max_staleness": 0, "max_in_flight": 0},
            )
        ),
    ]
    for frames in bad_control:
        control.send_multipart(frames)
    # The refused hellos are answered with a reject that says why.
    rejects = []
    while len(rejects) < 4:  # the params snapshot and heartbeats may come in between
        msg = recv_control(control)
        if not isinstance(msg, (P.Parameters, P.Heartbeat)):
            rejects.append(msg)
    assert all(isinstance(r, P.Reject) and "hello refused" in r.reason and not r.rehello for r in rejects), rejects
    # A member's stats must be a flat map of figures; nested maps or bytes would break `zddrl status`.
    link = bus.link(broker.connect, P.Hello(role="actor", peer_id="actor-0"))
    assert link.wait_welcome(WAIT_S)
    link.send(P.Stats(peer_id="actor-0", role="actor", stats={"sps": {"nested": 1}}))
    link.send(P.Stats(peer_id="actor-0", role="actor", stats={"blob": b"\x00\x01"}))
    link.send(P.Stats(peer_id="actor-0", role="actor", stats={"sps": 12.5, "param_hash": "abc"}))

    unknown = bus.socket(zmq.DEALER, identity=b"nobody")
    unknown.connect(shard.link.endpoint("learners"))
    unknown.send_multipart(P.encode(P.Credit(peer_id="nobody", credit=5)))
    reject = recv_control(unknown)
    assert isinstance(reject, P.Reject) and reject.rehello

    bad_learner = [
        [b"junk"],
        P.encode(P.Credit(peer_id="learner-0", credit=0)),
        P.encode(P.Credit(peer_id="learner-0", credit=-5)),
        P.encode(P.Credit(peer_id="learner-0", credit=1 << 30)),
        P.encode(P.Hello(role="learner", peer_id="learner-0")),  # control message on the data socket
        [bytes(f) for f in P.encode(parameters("run-a", 1))][:-1],  # params without its array frame
    ]
    for frames in bad_learner:
        shard.sock.send_multipart(frames)

    expect_control = len(bad_control) + 2
    wait_for(
        lambda: (
            counters(broker, bus).get("control_malformed") == expect_control
            and counters(broker, bus).get("learner_malformed") == len(bad_learner)
        ),
        WAIT_S,
        "every bad control and learner message to be counted",
    )
    body = status(broker, bus)
    assert body["broker"]["run_id"] == "run-a", "a refused hello must not change the run"
    assert body["broker"]["policy_version"] == 0
    assert body["members"]["actor-0"]["stats"] == {"sps": 12.5, "param_hash": "abc"}
    assert {"learner-0", "actor-0"} <= set(body["members"]) and not {"x", "y", "z", "a"} & set(body["members"])
    assert broker.proc.poll() is None
    # ... and it still routes.
    shard.grant(1)
    actor = Pusher(bus, broker, "actor-1")
    assert actor.send(trajectory("run-a", "actor-1", 0))
    collect([shard], 1, regrant=False)
    out = cli("status", "--connect", broker.connect, "--json")
    assert out.returncode == 0, out.stderr
    json.loads(out.stdout)
