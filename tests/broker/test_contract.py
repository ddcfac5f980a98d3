"""The broker does what docs/protocol.md says (issue 18 items 1, 2, 5, 8), on a real `zddrl broker` process.

* params_request is answered by its own policy_version, not by what the actor's heartbeats reported;
* a malformed trajectory that can be attributed (section 8) is charged to its actor, whose credit comes back;
* parameters are published and kept only once every hash checked out; the last good version survives;
* a port that is taken stops the broker with one line that names it, its role and how to choose others.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
import time

import msgpack
import numpy as np
import pytest
import zmq

from broker_clients import WAIT_S, ProfiledBroker, counters, run_spec, status
from conftest import BrokerHandle, Bus, Procs, wait_for
from contract_clients import Control, Learner, trajectory, wire
from zddrl import protocol as P
from zddrl.broker.publisher import PARAMS_REQUEST_MIN_INTERVAL_S
from zddrl.proc import free_ports
from zddrl.transport.params import Assembler, FrameCache, split


def version(v: int, n: int = 64, chunk_bytes: int = 1 << 20, run: str = "run-a") -> list[P.Message]:
    """The messages of version ``v`` (``n`` float32 weights; chunks of ``chunk_bytes``)."""
    flat = np.random.default_rng(v).normal(size=n).astype(np.float32)
    return split(
        run_id=run,
        peer_id="learner-0",
        version=v,
        flat=flat,
        layout=[["w", "float32", [n], 0]],
        chunk_bytes=chunk_bytes,
    )


def publish(learner: Learner, msgs: list) -> None:
    for m in msgs:
        learner.send(m if isinstance(m, list) else P.encode(m))


def until_status(control: Control, peer_id: str) -> list[P.Message]:
    """Everything the broker sent ``control`` before it answered a status request sent now (same pipe, in order)."""
    mark = len(control.received)
    control.send(P.StatusRequest(peer_id=peer_id))
    control.next(P.Status)
    return control.received[mark:-1]


# ------------------------------------------------------------------------------------------------
# 1. params_request goes by its own policy_version
# ------------------------------------------------------------------------------------------------


def test_params_request_is_answered_by_its_policy_version_not_the_heartbeats(broker: BrokerHandle, bus: Bus) -> None:
    learner = Learner(bus, broker)
    publish(learner, version(0))
    wait_for(lambda: counters(broker, bus)["policy_version"] == 0, WAIT_S, "version 0")
    actor = Control(bus, broker, P.Hello(role="actor", peer_id="actor-0"))
    snapshot = actor.next(P.Parameters)  # right after the welcome
    sent_at = time.monotonic()
    assert snapshot.policy_version == 0
    actor.heartbeat("actor-0", 0)  # the broker now knows the actor holds the latest version...

    actor.send(P.ParamsRequest(peer_id="actor-0", policy_version=-1))  # ...and the same version is on its way
    assert not [m for m in until_status(actor, "actor-0") if isinstance(m, P.Parameters)]
    assert counters(broker, bus)["params_request_limited"] == 1

    wait_for(lambda: time.monotonic() - sent_at > PARAMS_REQUEST_MIN_INTERVAL_S, 1.0, "the limit's interval to pass")
    actor.send(P.ParamsRequest(peer_id="actor-0", policy_version=-1))  # e.g. it lost the version: it gets it
    assert actor.next(P.Parameters).policy_version == 0

    actor.send(P.ParamsRequest(peer_id="actor-0", policy_version=0))  # holds the latest: nothing to send
    assert not [m for m in until_status(actor, "actor-0") if isinstance(m, P.Parameters)]
    b = counters(broker, bus)
    assert b["params_requests"] == 3 and b["params_request_limited"] == 1 and b["params_snapshots"] == 2


def test_a_learners_row_shows_the_version_it_published_not_its_heartbeats(procs: Procs, tmp_path, bus: Bus) -> None:
    broker = ProfiledBroker(procs, tmp_path, heartbeat_interval_s=0.1, heartbeat_liveness=30).start()
    learner = Learner(bus, broker)
    publish(learner, version(0))
    wait_for(lambda: counters(broker, bus)["policy_version"] == 0, WAIT_S, "version 0")
    learner.control.heartbeat("learner-0", -1)  # what a learner's BrokerLink reports: it holds no parameters
    until_status(learner.control, "learner-0")
    assert status(broker, bus)["members"]["learner-0"]["policy_version"] == 0


# ------------------------------------------------------------------------------------------------
# 2. Malformed trajectories: charged to the actor they can be attributed to, credit returned
# ------------------------------------------------------------------------------------------------


def attributable(run_id: str) -> dict[str, list[bytes]]:
    """Malformed trajectories that name actor-0 (docs/protocol.md section 8), by what is wrong with them."""
    good = wire(trajectory(run_id, "actor-0", 0))
    header = msgpack.unpackb(good[1])

    def with_header(**changes) -> list[bytes]:
        return [good[0], msgpack.packb({**header, **changes}), *good[2:]]

    return {
        "a valid header with one trailing byte": [good[0], good[1] + b"\x00", *good[2:]],
        "a version-2 preamble": [P.SIGNATURE + b"\x02", *good[1:]],
        "a 6-byte preamble": [P.PREAMBLE + b"\x00", *good[1:]],
        "an unknown field": with_header(bogus=1),
        "a bool for an int": with_header(seq=True),
        "the layout as an array": with_header(arrays=msgpack.unpackb(header["arrays"])),
        "a missing array frame": good[:-1],
    }


def anonymous(run_id: str) -> dict[str, list[bytes]]:
    """Malformed trajectories that cannot be attributed: counted, charged to no one, no credit returned."""
    good = wire(trajectory(run_id, "actor-0", 0))
    header = msgpack.unpackb(good[1])
    return {
        "a wrong signature": [b"ZDRX\x04", *good[1:]],
        "one frame": [good[0]],
        "a header that is not msgpack": [good[0], b"\xc1", *good[2:]],
        "a header that is a list": [good[0], msgpack.packb([header]), *good[2:]],
        "peer_id not a str": [good[0], msgpack.packb({**header, "peer_id": b"actor-0"}), *good[2:]],
        "peer_id of no joined actor": [
            good[0],
            msgpack.packb({**header, "peer_id": "stranger", "bogus": 1}),
            *good[2:],
        ],
    }


def test_attributable_malformed_trajectories_are_charged_and_their_credit_returned(
    procs: Procs, tmp_path, bus: Bus
) -> None:
    """Issue 18 item 2: each case is counted malformed, charged to actor-0 and its credit comes back."""
    broker = ProfiledBroker(procs, tmp_path, heartbeat_interval_s=0.3, heartbeat_liveness=30).start()
    learner = Learner(bus, broker, run=run_spec(max_in_flight=2))
    publish(learner, version(0))
    learner.grant(100)
    actor = Control(bus, broker, P.Hello(role="actor", peer_id="actor-0"))
    push = bus.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{actor.welcome.ports['trajectories']}")
    charged, uncharged = attributable("run-a"), anonymous("run-a")
    for frames in [*charged.values(), *uncharged.values()]:
        push.send_multipart(frames)
    push.send_multipart(wire(trajectory("run-a", "actor-0", 1)))
    assert [t.seq for t in learner.trajectories(1)] == [1]
    total = len(charged) + len(uncharged) + 1
    wait_for(lambda: counters(broker, bus)["received"] == total, WAIT_S, "every message to be read")

    def credited() -> bool:
        actor.poll(50)
        return actor.credits() >= len(charged) + 1

    wait_for(credited, WAIT_S, "the credit of every attributable trajectory")
    body = status(broker, bus)
    b = body["broker"]
    assert b["dropped"]["malformed"] == len(charged) + len(uncharged) and b["forwarded"] == 1 and b["accounted"]
    assert body["members"]["actor-0"]["dropped_malformed"] == len(charged)
    actor.next(P.Heartbeat)  # what a burst leaves pending goes back with the heartbeats: none is left here
    until_status(actor, "actor-0")
    assert actor.credits() == len(charged) + 1, "no credit twice, none for what cannot be attributed"


def test_the_attribution_rule_case_by_case() -> None:
    for what, frames in attributable("r").items():
        assert P.claimed_peer_id(frames) == "actor-0", what
        with pytest.raises(P.ProtocolError):
            P.validate_trajectory(frames, 1 << 20)
    for what, frames in anonymous("r").items():
        assert P.claimed_peer_id(frames) in (None, "stranger"), what
    bad_utf8 = msgpack.packb({"peer_id": "x"}).replace(b"\xa1x", b"\xa2x\xff")
    assert P.claimed_peer_id([P.PREAMBLE, bad_utf8]) == "x\udcff"  # names no member: hellos are strict UTF-8
    huge = msgpack.packb({"peer_id": "actor-0", "pad": "x" * P.MAX_HEADER_BYTES})
    assert P.claimed_peer_id([P.PREAMBLE, huge]) is None


# ------------------------------------------------------------------------------------------------
# 5. Parameters: verified before they are published or kept
# ------------------------------------------------------------------------------------------------


def corrupt(msg: P.Message, **changes) -> P.Message:
    return dataclasses.replace(msg, **changes)


def forged_versions(first: int) -> dict[str, list[P.Message]]:
    """Versions ``first``.. that must never be published, by what is wrong with them (3 chunks each, but one)."""
    out = {}
    v = version(first, n=96, chunk_bytes=128)  # 3 chunks of 32 weights
    bad_data = v[1].arrays["data"] + 1
    out["chunk data does not hash to its chunk_hash"] = [v[0], corrupt(v[1], arrays={"data": bad_data}), v[2]]
    v = version(first + 1, n=96, chunk_bytes=128)
    out["chunk_hash is not the table's"] = [
        v[0],
        corrupt(v[1], arrays={"data": bad_data}, chunk_hash=P.param_hash(bad_data)),
        v[2],
    ]
    v = version(first + 2, n=96, chunk_bytes=128)
    flat = v[0].arrays["flat"] + 1
    out["chunk 0 does not hash to chunk_hashes[0]"] = [corrupt(v[0], arrays={"flat": flat}), v[1], v[2]]
    v = version(first + 3)
    out["an unchunked buffer that does not hash to param_hash"] = [
        corrupt(v[0], arrays={"flat": v[0].arrays["flat"] + 1})
    ]
    v = version(first + 4, n=96, chunk_bytes=128)  # every chunk matches the table; the table does not match param_hash
    out["the whole buffer does not hash to param_hash"] = [corrupt(m, param_hash="0123456789abcdef") for m in v]
    v = version(first + 5, n=96, chunk_bytes=128)
    out["a chunk of the wrong size"] = [
        v[0],
        corrupt(v[1], arrays={"data": v[1].arrays["data"][:-1]}, chunk_hash=P.param_hash(v[1].arrays["data"][:-1])),
        v[2],
    ]
    return out


def test_the_frame_cache_keeps_nothing_that_fails_a_hash() -> None:
    cache = FrameCache()
    good = version(1, n=96, chunk_bytes=128)
    assert [cache.add(m, [i]) for i, m in enumerate(good)] == ["building", "building", "complete"]
    forged = forged_versions(2)["the whole buffer does not hash to param_hash"]
    assert [cache.add(m, ["x"]) for m in forged] == ["building", "building", "whole_hash"]  # the last is held
    expected = {
        "chunk data does not hash to its chunk_hash": "chunk_hash",
        "chunk_hash is not the table's": "chunk_hash",
        "chunk 0 does not hash to chunk_hashes[0]": "chunk_hash",
        "an unchunked buffer that does not hash to param_hash": "chunk_hash",
        "the whole buffer does not hash to param_hash": "whole_hash",
        "a chunk of the wrong size": "bad_chunk",
    }
    for what, msgs in forged_versions(2).items():
        outcomes = [cache.add(m, ["bad"]) for m in msgs]
        assert expected[what] in outcomes and "complete" not in outcomes, (what, outcomes)
        assert cache.version == 1 and cache.messages == [[0], [1], [2]], what
    v8 = version(8, n=96, chunk_bytes=128)
    assert cache.add(v8[0], ["h"]) == "building" and cache.add(v8[0], ["h"]) == "duplicate"
    assert cache.add(corrupt(v8[1], index=3), ["x"]) == "bad_chunk"  # past the chunk table
    assert cache.add(v8[2], ["2"]) == "building" and cache.add(v8[1], ["1"]) == "complete"  # out of order is fine
    assert cache.version == 8 and cache.messages == [["h"], ["1"], ["2"]]
    assert cache.abandoned == 3  # the versions that lost a chunk, replaced by the next params message


def test_a_params_message_without_flat_is_counted_by_its_chunking_fields() -> None:
    """docs/protocol.md 5.3: without a chunk table or numel it decodes and is a bad chunk; with either it is invalid
    (learner_malformed at the broker)."""
    head = version(1)[0]  # what split() sends: a chunk table even for one chunk
    bare = corrupt(head, arrays={}, numel=0, chunk_numel=0, chunk_hashes=[])
    assert FrameCache().add(P.decode(wire(bare)), wire(bare)) == "bad_chunk"
    for changes in ({"numel": 64}, {"numel": 64, "chunk_numel": 64, "chunk_hashes": head.chunk_hashes}):
        with pytest.raises(P.ProtocolError, match="flat"):
            P.decode(wire(corrupt(bare, **changes)))


def test_the_broker_publishes_and_keeps_only_verified_versions(broker: BrokerHandle, bus: Bus) -> None:
    """What passed its own checks goes out as it comes; the message that completes a version only once the whole
    version verified; what fails goes nowhere, and the snapshot is always the last whole, verified version."""
    learner = Learner(bus, broker)
    sub = bus.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, P.PREAMBLE)
    sub.connect(f"tcp://127.0.0.1:{learner.control.welcome.ports['params']}")
    published = 0
    while not sub.poll(100):  # PUB/SUB subscriptions take a moment: publish good versions until one lands
        assert published < 100, "the SUB never received a broadcast"
        publish(learner, version(published))
        published += 1
    good = version(published, n=96, chunk_bytes=128)  # the last good version: chunked
    publish(learner, good)
    wait_for(lambda: counters(broker, bus)["policy_version"] == published, WAIT_S, "the last good version")
    forged = forged_versions(published + 1)
    for msgs in forged.values():
        publish(learner, msgs)
    later = version(published + 10)
    publish(learner, later)  # a good version after them: the SUB sees it after anything published before
    wait_for(lambda: counters(broker, bus)["policy_version"] == published + 10, WAIT_S, "the version after them")
    seen: list[P.Message] = []
    while not seen or seen[-1].policy_version != published + 10:
        assert sub.poll(int(WAIT_S * 1000)), f"the SUB got {[m.policy_version for m in seen]}"
        seen.append(P.decode(sub.recv_multipart()))
    # Every message that went out passed its own checks: nothing whose data fails its hash was broadcast...
    heads = {(m.policy_version, m.param_hash): m for m in seen if isinstance(m, P.Parameters)}
    for m in seen:
        if isinstance(m, P.Parameters):
            assert P.param_hash(m.arrays["flat"]) == (m.chunk_hashes or [m.param_hash])[0], m.policy_version
        else:
            head = heads[(m.policy_version, m.param_hash)]
            assert P.param_hash(m.arrays["data"]) == m.chunk_hash == head.chunk_hashes[m.index], m.policy_version
            assert m.arrays["data"].size == min(head.chunk_numel, head.numel - m.index * head.chunk_numel)
    # ...and no forged version can be put together from what went out: its last message never did.
    for msgs in forged.values():
        out = [m for m in seen if m.policy_version == msgs[0].policy_version]
        assert len(out) < len(msgs), f"all of forged version {msgs[0].policy_version} went out"
    assembler = Assembler()
    whole = [v.policy_version for v in map(assembler.add, seen) if v is not None]
    assert whole[-2:] == [published, published + 10] and not set(assembler.rejected) - {"old", "orphan_chunk"}
    b = counters(broker, bus)
    assert b["params_chunk_hash"] == 4 and b["params_whole_hash"] == 1 and b["params_bad_chunk"] == 1
    assert b["params_published"] == published + 2
    late = Control(bus, broker, P.Hello(role="actor", peer_id="late"))
    assert late.next(P.Parameters).policy_version == published + 10


def test_a_corrupt_version_leaves_the_last_good_snapshot(broker: BrokerHandle, bus: Bus) -> None:
    learner = Learner(bus, broker)
    good = version(0, n=96, chunk_bytes=128)
    publish(learner, good)
    wait_for(lambda: counters(broker, bus)["policy_version"] == 0, WAIT_S, "version 0")
    publish(learner, forged_versions(1)["the whole buffer does not hash to param_hash"])
    wait_for(lambda: counters(broker, bus)["params_whole_hash"] == 1, WAIT_S, "the forged version to be refused")
    late = Control(bus, broker, P.Hello(role="actor", peer_id="late"))
    snapshot = [late.next(P.Parameters), *[late.next(P.ParamChunk) for _ in good[1:]]]
    assert [m.policy_version for m in snapshot] == [0, 0, 0]
    assert [wire(m) for m in snapshot] == [wire(m) for m in good], "the snapshot is the good version, byte for byte"


# ------------------------------------------------------------------------------------------------
# 8. A port that is taken: one line, which port, whose, how to choose others
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "offset,role,option",
    [
        (0, "control", "--bind"),
        (1, "trajectories", "--trajectory-port"),
        (2, "learners", "--learner-port"),
        (3, "params", "--params-port"),
    ],
)
def test_a_taken_port_is_one_line_naming_it(offset: int, role: str, option: str) -> None:
    taken = None
    for _ in range(50):  # four consecutive free ports; the one of ``role`` stays taken
        (base,) = free_ports(1)
        socks = [socket.socket() for _ in range(4)]
        try:
            for i, sock in enumerate(socks):
                sock.bind(("127.0.0.1", base + i))
        except OSError:
            for sock in socks:
                sock.close()
            continue
        for i, sock in enumerate(socks):
            if i != offset:
                sock.close()
        taken = socks[offset]
        break
    assert taken is not None, "no four consecutive free ports"
    try:
        taken.listen()
        out = subprocess.run(
            [sys.executable, "-m", "zddrl", "broker", "--bind", f"tcp://127.0.0.1:{base}", "--insecure"],
            capture_output=True,
            text=True,
            timeout=30,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    finally:
        taken.close()
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert len(lines) == 1, out.stderr
    assert f"port {base + offset} on 127.0.0.1 (the {role} socket) is in use" in lines[0], lines[0]
    assert option in lines[0] and "--bind tcp://HOST:PORT" in lines[0]
