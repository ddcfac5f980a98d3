"""The wire protocol (zddrl.protocol): round trips, zero-copy receipt, and every validation failure."""

from __future__ import annotations

import dataclasses
import math
import random

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from samples import traj, traj_arrays
from zddrl import protocol as P
from zddrl.transport.params import split as split_params

RUN = {"name": "demo", "env": {"id": "CartPole-v1", "num_envs": 2}, "algo": {"schedule": "sync"}}


def carrier(arrays: dict, **kw) -> P.Parameters:
    """A valid message carrying any arrays: a params message with them beside its 'flat' buffer."""
    return params(arrays={"flat": np.arange(6, dtype=np.float32), **arrays}, **kw)


def params(flat=None, layout=None, **kw) -> P.Parameters:
    flat = np.arange(6, dtype=np.float32) if flat is None else flat
    layout = [["w", "float32", [2, 2], 0], ["b", "float32", [2], 4]] if layout is None else layout
    fields = dict(
        run_id="r-1",
        peer_id="learner-0",
        policy_version=1,
        param_hash=P.param_hash(flat),
        layout=layout,
        arrays={"flat": flat, "obs_mean": np.zeros(3, np.float32)},
        meta={"rollout_len": 8},
    )
    return P.Parameters(**{**fields, **kw})


EXAMPLES = [
    P.Hello(role="actor", peer_id="actor-0", host="h", pid=1, num_envs=2),
    P.Hello(role="learner", peer_id="learner-0", run_id="r-1", run=RUN, shard=1, num_shards=2),
    P.Welcome(
        peer_id="actor-0",
        run_id="r-1",
        run=RUN,
        ports={"trajectories": 5556, "learners": 5557, "params": 5558},
        heartbeat_interval_s=0.5,
        heartbeat_liveness=3,
        max_message_bytes=1 << 28,
    ),
    P.Welcome(
        peer_id="a", run_id="", run=None, ports={}, heartbeat_interval_s=1, heartbeat_liveness=1, max_message_bytes=0
    ),
    P.Heartbeat(peer_id="actor-0", policy_version=7),
    P.Heartbeat(peer_id="broker"),
    P.Reject(reason="unknown peer: send hello first", rehello=True),
    P.Reject(reason="no"),
    traj(),
    traj(
        arrays=traj_arrays(T=3, N=1, obs_shape=(2, 2), discrete=False, K=2), ep_returns=[3.0, 500], ep_lengths=[3, 500]
    ),
    params(),
    *split_params(
        run_id="r-1",
        peer_id="learner-0",
        version=2,
        flat=np.arange(10, dtype=np.float32),
        layout=[["w", "float32", [10], 0]],
        extras={"obs_mean": np.zeros(2, np.float32)},
        chunk_bytes=16,
        dtype="bfloat16",
    ),
    P.ParamsRequest(peer_id="actor-0", policy_version=3),
    P.Credit(peer_id="learner-0", credit=16),
    P.Stats(peer_id="actor-0", role="actor", stats={"sps": 1.5, "nested": {"a": [1, None, True, "x", b"\x00"]}}),
    P.StatusRequest(),
    P.StatusRequest(peer_id="status"),
    P.Status(body={"broker": {"dropped": {"stale": 1}}}),
    P.Bye(peer_id="actor-0"),
    P.Bye(peer_id="actor-0", reason="done"),
    P.Fleet(run_id="r-1", seq=1, actors={"actor-0": {"num_envs": 2, "host": "h"}}),
    P.Subtree(
        peer_id="relay-0", seq=3, full=False, actors={"actor-0": {"num_envs": 2, "host": "h", "pid": 7}}, left=["a-1"]
    ),
    P.ReplaySample(
        run_id="r-1",
        peer_id="learner-0",
        request=1,
        batch=4,
        allow_steps=10,
        policy_version=0,
        rollout_len=8,
        arrays={"ids": np.arange(3, dtype=np.int64), "td_errors": np.ones(3, np.float32)},
    ),
    P.ReplayBatch(
        run_id="r-1",
        peer_id="replay-0",
        request=1,
        held=3,
        total=2.5,
        min_priority=0.5,
        max_priority=1.0,
        inserted=8,
        newest_version=0,
        capacity=16,
        nbytes=1024,
        ep_returns=[1.0],
        arrays={
            "ids": np.arange(2, dtype=np.int64),
            "priorities": np.ones(2),
            "obs": np.zeros((2, 4), np.float32),
            "next_obs": np.zeros((2, 4), np.float32),
            "actions": np.zeros(2, np.int64),
            "returns": np.ones(2, np.float32),
            "discounts": np.full(2, 0.99, np.float32),
            "versions": np.zeros(2, np.int32),
        },
    ),
]


def wire(frames) -> list[bytes]:
    return [bytes(P._buffer(f)) for f in frames]


def assert_same(a: P.Message, b: P.Message) -> None:
    assert type(a) is type(b)
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if f.name != "arrays":
            assert x == y, f.name
            continue
        assert list(x) == list(y)
        for name in x:
            want = P.wire_array(x[name])
            assert y[name].dtype == want.dtype and y[name].shape == want.shape, name
            assert y[name].tobytes() == want.tobytes(), name


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: m.KIND)
def test_round_trip_every_kind(msg: P.Message) -> None:
    frames = msg.encode()
    assert bytes(frames[0]) == P.PREAMBLE == b"ZDRL\x09"
    assert len(frames) == 2 + len(getattr(msg, "arrays", {}))
    assert_same(msg, P.decode(wire(frames)))
    assert_same(msg, P.decode(frames))  # numpy frames straight from encode work too
    assert wire(P.encode(P.decode(wire(frames)))) == wire(frames)


def test_examples_cover_every_kind() -> None:
    assert set(P.MESSAGE_TYPES) == {m.KIND for m in EXAMPLES}


def test_optional_fields_take_defaults_and_split_routed_and_nbytes() -> None:
    hdr = msgpack.packb({"kind": "hello", "role": "actor", "peer_id": "a"})
    assert P.decode([P.PREAMBLE, hdr]) == P.Hello(role="actor", peer_id="a")
    assert P.decode_header([P.PREAMBLE, hdr])["peer_id"] == "a"
    identity, body = P.split_routed([b"id", P.PREAMBLE, hdr])
    assert identity == b"id" and P.decode(body).peer_id == "a"
    assert P.message_nbytes([b"id", P.PREAMBLE, hdr]) == 2 + 5 + len(hdr)
    with pytest.raises(P.ProtocolError, match="identity"):
        P.split_routed([P.PREAMBLE, hdr])


# ------------------------------------------------------------------ properties over dtypes and shapes

DTYPE_NAMES = sorted(P.DTYPES)
shapes = hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=4)


@st.composite
def wire_arrays(draw) -> np.ndarray:
    dtype = P.DTYPES[draw(st.sampled_from(DTYPE_NAMES))]
    if dtype.itemsize > 1 and draw(st.booleans()):
        dtype = dtype.newbyteorder(">")  # big-endian input must arrive little-endian
    array = draw(hnp.arrays(dtype, draw(shapes)))
    if array.ndim >= 2 and draw(st.booleans()):
        array = array.T  # non-contiguous input
    return array


names = st.text(min_size=1, max_size=12)


@settings(max_examples=150, deadline=None)
@given(
    st.dictionaries(names.filter(lambda n: n != "flat"), wire_arrays(), max_size=6), st.integers(-(2**63), 2**63 - 1)
)
def test_arrays_round_trip_property(arrays: dict, version: int) -> None:
    msg = carrier(arrays, policy_version=version)
    decoded = P.decode(wire(msg.encode()))
    assert_same(msg, decoded)
    for name, array in arrays.items():
        got = decoded.arrays[name]
        assert got.dtype.byteorder in "<|=" and got.shape == array.shape
        assert np.array_equal(got, array, equal_nan=got.dtype.kind == "f")


@settings(max_examples=100, deadline=None)
@given(
    st.integers(1, 5),
    st.integers(1, 4),
    hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=3),
    st.booleans(),
    st.integers(0, 3),
    st.lists(st.tuples(st.floats(-1e9, 1e9), st.integers(1, 10**6)), max_size=4),
)
def test_trajectory_round_trip_property(
    T: int, N: int, obs_shape: tuple, discrete: bool, K: int, episodes: list
) -> None:
    episodes = episodes[: T * N]  # at most one episode ends per env step
    msg = traj(
        arrays=traj_arrays(T, N, obs_shape, discrete, K),
        ep_returns=[r for r, _ in episodes],
        ep_lengths=[n for _, n in episodes],
    )
    decoded = P.decode(wire(msg.encode()))
    assert_same(msg, decoded)
    assert ("trunc_idx" in decoded.arrays) == (K > 0) and decoded.env_steps == T * N


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4), st.integers(0, 3)),
        max_size=6,
        unique_by=lambda r: r,
    ),
    st.dictionaries(st.sampled_from(["obs_mean", "obs_var", "x"]), wire_arrays(), max_size=2),
    st.booleans(),
)
def test_params_round_trip_property(rows: list, extra: dict, big_endian: bool) -> None:
    layout, offset = [], 0
    for i, (shape, gap) in enumerate(rows):
        offset += gap
        layout.append([f"t{i}", "float32", list(shape), offset])
        offset += math.prod(shape)
    flat = np.random.default_rng(offset).standard_normal(offset).astype(">f4" if big_endian else "<f4")
    msg = params(flat=flat, layout=layout, arrays={"flat": flat, **extra})
    decoded = P.decode(wire(msg.encode()))
    assert_same(msg, decoded)
    assert P.param_hash(decoded.arrays["flat"]) == msg.param_hash == P.param_hash(flat.astype("<f4").tobytes())
    for _, _, shape, off in decoded.layout:
        np.testing.assert_array_equal(
            decoded.arrays["flat"][off : off + math.prod(shape)].reshape(shape),
            flat[off : off + math.prod(shape)].reshape(shape),
        )


def test_wire_array() -> None:
    for bad in (
        np.array([object()]),
        np.array([1j]),
        np.array([1 + 2j], np.complex64),
        np.array(["a"]),
        np.zeros(2, dtype=[("a", "<f4")]),
        np.array([1], "M8[s]"),
        np.zeros((1,) * 9),
    ):
        with pytest.raises(P.ProtocolError, match="cannot travel"):
            P.wire_array(bad)
    big = np.arange(6, dtype=">i4").reshape(2, 3)
    little = P.wire_array(big)
    assert little.dtype == np.dtype("<i4") and little.flags.c_contiguous and little.tolist() == big.tolist()
    assert bytes(little) == np.arange(6, dtype="<i4").tobytes()
    assert P.wire_array(np.array(2.5)).shape == ()  # 0-d stays 0-d
    ok = np.arange(4, dtype=np.float32)
    assert np.shares_memory(P.wire_array(ok), ok)  # no copy when already wire-ready
    assert P.wire_array(ok[::2]).flags.c_contiguous
    with pytest.raises(P.ProtocolError, match="name"):
        P.encode(traj(arrays={1: ok}))
    with pytest.raises(P.ProtocolError, match="at most 64"):
        P.encode(traj(arrays={str(i): ok for i in range(65)}))
    assert P.param_hash(b"") == "da39a3ee5e6b4b0d" and P.param_hash(np.zeros((0, 3))) == "da39a3ee5e6b4b0d"


# ------------------------------------------------------------------ zero-copy receipt from real sockets


@pytest.mark.parametrize("transport", ["inproc", "tcp"])
def test_zero_copy_over_a_real_socket_pair(transport: str) -> None:
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        if transport == "inproc":
            a.bind("inproc://zero-copy")
            b.connect("inproc://zero-copy")
        else:
            port = a.bind_to_random_port("tcp://127.0.0.1")
            b.connect(f"tcp://127.0.0.1:{port}")
        arrays = {
            "big": np.arange(200_000, dtype=np.float32).reshape(1000, 200),
            "small": np.arange(3, dtype=np.int64),
            "flag": np.array([True, False]),
            "scalar": np.array(1.5),
            "empty": np.zeros((0, 4), np.float16),
        }
        msg = carrier(arrays)
        a.send_multipart(msg.encode(), copy=False)
        assert b.poll(5000)
        frames = b.recv_multipart(copy=False)
        assert all(isinstance(f, zmq.Frame) for f in frames)
        decoded = P.decode(frames)
        assert_same(msg, decoded)
        for i, name in enumerate(msg.arrays):
            if msg.arrays[name].size:
                assert np.shares_memory(decoded.arrays[name], np.frombuffer(frames[2 + i].buffer, np.uint8)), name
    finally:
        a.close(linger=0)
        b.close(linger=0)
        ctx.term()


# ------------------------------------------------------------------ every validation failure

GOOD = {
    "kind": "trajectory",
    "run_id": "r",
    "peer_id": "s",
    "seq": 0,
    "policy_version": 0,
    "param_hash": "",
    "env_steps": 0,
    "arrays": [["a", "float32", [3]]],
    "info": {},
}
A3 = np.zeros(3, np.float32).tobytes()


def packed(specs) -> bytes:
    """The header's ``arrays`` value: the specs' msgpack, travelling as bin (protocol version 2)."""
    return msgpack.packb(specs, use_bin_type=True)


def frames_of(header, *arrays, preamble=P.PREAMBLE) -> list:
    """Frames of ``header`` (a map, whose ``arrays`` list is packed as the protocol wants, or raw bytes)."""
    if isinstance(header, dict) and isinstance(header.get("arrays"), list):
        header = {**header, "arrays": packed(header["arrays"])}
    raw = header if isinstance(header, bytes) else msgpack.packb(header, use_bin_type=True)
    return [preamble, raw, *arrays]


def with_(**kw) -> dict:
    return {k: v for k, v in {**GOOD, **kw}.items() if v is not ...}


HB = {"kind": "heartbeat", "peer_id": "a"}
WELCOME = P.encode(EXAMPLES[2])[1]
W = msgpack.unpackb(WELCOME)

BAD = [
    ("too few frames", [P.PREAMBLE], "at least 2 frames"),
    ("no frames", [], "at least 2 frames"),
    ("too many frames", frames_of(HB, *[b""] * 65), "too many frames: 67 > 66"),
    ("bad signature", frames_of(HB, preamble=b"ZDRX\x01"), "bad signature"),
    ("empty preamble", frames_of(HB, preamble=b""), "bad signature"),
    ("wrong version", frames_of(HB, preamble=b"ZDRL\x01"), "unsupported protocol version 1"),
    ("preamble too long", frames_of(HB, preamble=b"ZDRL\x07\x00"), "unsupported protocol version 7 in a 6-byte"),
    ("preamble without version", frames_of(HB, preamble=b"ZDRL"), "unsupported protocol version None"),
    ("oversized header", frames_of(b"\x00" * (P.MAX_HEADER_BYTES + 1)), "exceeds the 1048576-byte limit"),
    ("header not msgpack", frames_of(b"\xc1"), "not valid msgpack"),
    ("truncated msgpack", frames_of(msgpack.packb(HB)[:-1]), "not valid msgpack"),
    ("trailing bytes", frames_of(msgpack.packb(HB) + b"\x00"), "not valid msgpack"),
    ("invalid utf-8", frames_of(b"\x81\xa4kind\xa2\xff\xfe"), "not valid msgpack"),
    ("header not a map", frames_of([1, 2]), "must be a msgpack map, got list"),
    ("int key", frames_of({**HB, 1: 2}), "int is not allowed for map key"),
    ("bytes key", frames_of({**HB, b"x": 2}), "keys must be strings"),
    ("unknown kind", frames_of({"kind": "gimme"}), "unknown message kind 'gimme'"),
    ("no kind", frames_of({"peer_id": "a"}), "unknown message kind None"),
    ("kind not str", frames_of({"kind": ["hello"]}), "unknown message kind"),
    ("missing field", frames_of({"kind": "heartbeat"}), "heartbeat: missing field 'peer_id'"),
    ("wrong field type", frames_of({**HB, "policy_version": "3"}), "'policy_version' has the wrong type (str)"),
    ("bool for int", frames_of({**HB, "policy_version": True}), "'policy_version' has the wrong type (bool)"),
    ("float for int", frames_of({**HB, "policy_version": 1.0}), "'policy_version' has the wrong type (float)"),
    ("int for bool", frames_of({"kind": "reject", "reason": "x", "rehello": 1}), "'rehello' has the wrong type"),
    ("nil for str", frames_of({**HB, "peer_id": None}), "'peer_id' has the wrong type (NoneType)"),
    ("bin for str", frames_of({**HB, "peer_id": b"a"}), "'peer_id' has the wrong type (bytes)"),
    ("NaN float", frames_of({**W, "heartbeat_interval_s": math.nan}), "'heartbeat_interval_s' has the wrong type"),
    ("inf float", frames_of({**W, "heartbeat_interval_s": math.inf}), "'heartbeat_interval_s' has the wrong type"),
    ("bool for float", frames_of({**W, "heartbeat_interval_s": True}), "'heartbeat_interval_s' has the wrong type"),
    ("list for map", frames_of({**W, "ports": [1]}), "'ports' has the wrong type (list)"),
    (
        "ext type in a map",
        frames_of({"kind": "stats", "peer_id": "a", "role": "actor", "stats": {"x": msgpack.ExtType(1, b"")}}),
        "'stats' has the wrong type",
    ),
    ("bytes nested key", frames_of({"kind": "status", "body": {"a": {b"k": 2}}}), "'body' has the wrong type"),
    ("unknown extra field", frames_of({**HB, "colour": "red"}), "heartbeat: unknown fields ['colour']"),
    ("array count mismatch", frames_of(GOOD), "names 1 arrays but 0 array frames follow"),
    ("extra array frame", frames_of(GOOD, A3, A3), "names 1 arrays but 2 array frames follow"),
    ("missing arrays field", frames_of(with_(arrays=...)), "trajectory: missing field 'arrays'"),
    ("arrays not a list", frames_of(with_(arrays=packed({"a": 1})), A3), "'arrays' must be a list"),
    ("arrays not bin", frames_of(msgpack.packb(GOOD), A3), "'arrays' must be bin"),
    ("arrays bin not msgpack", frames_of(with_(arrays=b"\xc1"), A3), "'arrays' is not valid msgpack"),
    (
        "arrays bin with trailing bytes",
        frames_of(with_(arrays=packed(GOOD["arrays"]) + b"\x00"), A3),
        "'arrays' is not valid msgpack",
    ),
    ("too many specs", frames_of(with_(arrays=[["a", "float32", [3]]] * 65), A3), "at most 64 can travel"),
    ("spec not a triple", frames_of(with_(arrays=[["a", "float32"]]), A3), "array spec 0 must be [name, dtype, shape]"),
    ("empty name", frames_of(with_(arrays=[["", "float32", [3]]]), A3), "name '' must be a non-empty string"),
    ("bad dtype name", frames_of(with_(arrays=[["a", "float128", [3]]]), A3), "dtype 'float128' is not allowed"),
    ("complex dtype", frames_of(with_(arrays=[["a", "complex64", [3]]]), A3), "dtype 'complex64' is not allowed"),
    ("object dtype", frames_of(with_(arrays=[["a", "object", [3]]]), A3), "dtype 'object' is not allowed"),
    ("numpy dtype code", frames_of(with_(arrays=[["a", "<f4", [3]]]), A3), "dtype '<f4' is not allowed"),
    ("dtype not str", frames_of(with_(arrays=[["a", 5, [3]]]), A3), "dtype 5 is not allowed"),
    ("negative dim", frames_of(with_(arrays=[["a", "float32", [-3]]]), A3), "shape [-3] must be a list"),
    ("float dim", frames_of(with_(arrays=[["a", "float32", [1.5]]]), A3), "shape [1.5] must be a list"),
    ("bool dim", frames_of(with_(arrays=[["a", "float32", [True]]]), A3), "shape [True] must be a list"),
    ("shape not a list", frames_of(with_(arrays=[["a", "float32", 3]]), A3), "shape 3 must be a list"),
    ("too many dims", frames_of(with_(arrays=[["a", "float32", [1] * 9]]), A3), "at most 8 non-negative ints"),
    (
        "huge zero-size shape",
        frames_of(with_(arrays=[["a", "float32", [0, 2**40, 2**40, 2**40]]]), b""),
        "is too large for the",
    ),
    (
        "frame size mismatch",
        frames_of(with_(arrays=[["a", "float32", [3]]]), A3[:8]),
        "shape [3] x float32 needs 12 bytes, frame has 8",
    ),
    (
        "duplicate array name",
        frames_of(with_(arrays=[["a", "float32", [3]], ["a", "float32", [3]]]), A3, A3),
        "duplicate array name 'a'",
    ),
    ("arrays on a kind without arrays", frames_of(HB, A3), "heartbeat carries no arrays, got 1 extra frames"),
    ("arrays field on a kind without arrays", frames_of({**HB, "arrays": []}), "unknown fields ['arrays']"),
    ("welcome bad port", frames_of({**W, "ports": {"params": 70000}}), "port 'params' must be an int in 1..65535"),
    ("welcome zero interval", frames_of({**W, "heartbeat_interval_s": 0.0}), "must be in 0.01..3600"),
    ("welcome zero liveness", frames_of({**W, "heartbeat_liveness": 0}), "heartbeat_liveness must be >= 1"),
]


ZEROS = np.zeros(4, np.float32)


def params_frames(layout, flat=ZEROS) -> list:
    return wire(params(flat=flat, layout=layout).encode())


CHUNKED = split_params(
    run_id="r-1",
    peer_id="learner-0",
    version=2,
    flat=np.arange(10, dtype=np.float32),
    layout=[["w", "float32", [10], 0]],
    chunk_bytes=16,
)
HEAD = dict(msgpack.unpackb(wire(CHUNKED[0].encode())[1]))


def head_frames(**changes) -> list:
    frames = wire(CHUNKED[0].encode())
    return [frames[0], msgpack.packb({**HEAD, **changes}), *frames[2:]]


def chunk_frames(data=ZEROS, **changes) -> list:
    msg = dataclasses.replace(CHUNKED[1], arrays={"data": data}, **changes)
    return wire(msg.encode())


BAD += [
    ("param_dtype unknown", head_frames(param_dtype="int8"), "param_dtype 'int8' is not one of"),
    ("param_dtype vs flat", head_frames(param_dtype="float16"), "'flat' must be float16 for param_dtype float16"),
    ("chunk count vs numel", head_frames(numel=100), "3 chunk hashes do not fit numel 100 in chunks of 4"),
    ("chunk hash not hex", head_frames(chunk_hashes=["x" * 16] * 3), "16 hex digits"),
    ("flat not chunk 0", head_frames(chunk_numel=5, numel=15), "'flat' must be chunk 0 (5 elements)"),
    ("numel without chunks", head_frames(chunk_hashes=[], numel=10), "numel 10 without chunk_hashes"),
    ("layout past numel", head_frames(layout=[["w", "float32", [11], 0]]), "does not fit the flat buffer of 10"),
    (
        "one chunk, two hashes",
        wire(
            dataclasses.replace(
                split_params(run_id="r", peer_id="l", version=1, flat=np.zeros(4, np.float32), layout=[])[0],
                param_hash="0" * 16,
            ).encode()
        ),
        "with one chunk, param_hash must be chunk_hashes[0]",
    ),
    ("chunk index 0", chunk_frames(index=0), "index 0 must be in 1.."),
    (
        "chunk two arrays",
        wire(
            dataclasses.replace(
                CHUNKED[1], arrays={"data": np.zeros(2, np.float32), "x": np.zeros(1, np.float32)}
            ).encode()
        ),
        "exactly one 1-d array",
    ),
    ("chunk 2-d", chunk_frames(data=np.zeros((2, 2), np.float32)), "exactly one 1-d array"),
    ("chunk hash not hex", chunk_frames(chunk_hash="nothex"), "chunk_hash must be 16 hex digits"),
    ("layout row not a quad", params_frames([["w", "float32", [2]]]), "layout row 0 must be [name, dtype, shape"),
    (
        "layout duplicate name",
        params_frames([["w", "float32", [1], 0], ["w", "float32", [1], 1]]),
        "name 'w' must be a unique",
    ),
    ("layout bad dtype", params_frames([["w", ["float32"], [1], 0]]), "dtype ['float32'] is not allowed"),
    ("layout bad shape", params_frames([["w", "float32", [-1], 0]]), "bad shape [-1]"),
    ("layout bad offset", params_frames([["w", "float32", [1], -1]]), "offset -1 must be a non-negative int"),
    ("layout past flat", params_frames([["w", "float32", [2, 2], 1]]), "does not fit the flat buffer of 4 elements"),
    ("flat not 1-d", params_frames([], flat=np.zeros((2, 2), np.float32)), "'flat' must be 1-d"),
]


def traj_frames(drop: tuple = (), K: int = 0, **changes) -> list:
    """Frames of a trajectory with arrays dropped, replaced or added (``changes`` that are arrays) and header
    fields changed (the other ``changes``): encode checks no trajectory rule, so it can make every broken one."""
    arrays = traj_arrays(K=K)
    fields = {k: v for k, v in changes.items() if not isinstance(v, np.ndarray)}
    arrays.update({k: v for k, v in changes.items() if isinstance(v, np.ndarray)})
    return wire(traj(arrays={k: v for k, v in arrays.items() if k not in drop}, **fields).encode())


F32 = np.float32
BAD += [
    ("trajectory without obs", traj_frames(drop=("obs",)), "trajectory: missing arrays ['obs']"),
    ("trajectory without next_value", traj_frames(drop=("next_value",)), "missing arrays ['next_value']"),
    ("trajectory obs float64", traj_frames(obs=np.zeros((2, 2, 3))), "'obs' must be float32 or uint8 [T, N"),
    ("trajectory obs without N", traj_frames(obs=np.zeros(2, F32)), "'obs' must be float32 or uint8 [T, N"),
    ("trajectory T = 0", traj_frames(obs=np.zeros((0, 2, 3), F32)), "with T, N >= 1"),
    ("trajectory actions int32", traj_frames(actions=np.zeros((2, 2), np.int32)), "'actions' must be int64 [2, 2]"),
    ("trajectory actions of another T", traj_frames(actions=np.zeros((3, 2), np.int64)), "'actions' must be int64"),
    ("trajectory box actions without A", traj_frames(actions=np.zeros((2, 2), F32)), "or float32 [2, 2] + [A]"),
    (
        "trajectory rewards of another N",
        traj_frames(rewards=np.zeros((2, 3), F32)),
        "'rewards' must be float32 [2, 2], got float32 [2, 3]",
    ),
    (
        "trajectory terminated uint8",
        traj_frames(terminated=np.zeros((2, 2), np.uint8)),
        "'terminated' must be bool [2, 2], got uint8 [2, 2]",
    ),
    (
        "trajectory next_obs of another shape",
        traj_frames(next_obs=np.zeros((2, 4), F32)),
        "'next_obs' must be float32 [2, 3]",
    ),
    ("trajectory next_value [N, 1]", traj_frames(next_value=np.zeros((2, 1), F32)), "'next_value' must be float32 [2]"),
    (
        "trajectory part of the truncation arrays",
        traj_frames(drop=("trunc_value",), K=1),
        "['trunc_idx', 'trunc_obs'] without the rest",
    ),
    (
        "trajectory truncation arrays with K = 0",
        traj_frames(
            K=1, trunc_idx=np.zeros(0, np.int64), trunc_obs=np.zeros((0, 3), F32), trunc_value=np.zeros(0, F32)
        ),
        "(K = 0): leave them out",
    ),
    (
        "trajectory trunc_obs of another K",
        traj_frames(K=1, trunc_obs=np.zeros((2, 3), F32)),
        "'trunc_obs' must be float32 [1, 3]",
    ),
    ("trajectory trunc_idx float", traj_frames(K=1, trunc_idx=np.zeros(1, F32)), "'trunc_idx' must be int64 [1]"),
    (
        "trajectory trunc_idx 0-d",
        traj_frames(K=1, trunc_idx=np.array(0, np.int64), trunc_obs=np.zeros(3, F32), trunc_value=np.array(0.0, F32)),
        "'trunc_idx' must be int64 [1], got int64 []",
    ),
    (
        "trajectory trunc_idx 2-d",
        traj_frames(K=1, trunc_idx=np.zeros((1, 1), np.int64)),
        "'trunc_idx' must be int64 [1]",
    ),
    ("trajectory life_lost float32", traj_frames(life_lost=np.zeros((2, 2), F32)), "'life_lost' must be bool [2, 2]"),
    ("trajectory env_steps not T * N", traj_frames(env_steps=5), "env_steps 5 must be T * N = 4"),
    ("trajectory episodes unpaired", traj_frames(ep_returns=[1.0], ep_lengths=[]), "must pair up"),
    ("trajectory more episodes than steps", traj_frames(ep_returns=[1.0] * 5, ep_lengths=[1] * 5), "must pair up"),
    ("trajectory episode of no steps", traj_frames(ep_returns=[1.0], ep_lengths=[0]), "lengths must be >= 1"),
    ("trajectory NaN return", traj_frames(ep_returns=[math.nan], ep_lengths=[1]), "'ep_returns' has the wrong type"),
    ("trajectory str return", traj_frames(ep_returns=["1"], ep_lengths=[1]), "'ep_returns' has the wrong type"),
    ("trajectory bool length", traj_frames(ep_returns=[1.0], ep_lengths=[True]), "'ep_lengths' has the wrong type"),
    ("trajectory float length", traj_frames(ep_returns=[1.0], ep_lengths=[1.0]), "'ep_lengths' has the wrong type"),
]


@pytest.mark.parametrize("frames,match", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_validation_failure_raises_protocol_error(frames: list, match: str) -> None:
    with pytest.raises(P.ProtocolError) as info:
        P.decode(frames)
    assert match in str(info.value)


def test_total_size_limit() -> None:
    frames = wire(carrier({"a": np.zeros(100, np.uint8), "b": np.zeros(100, np.uint8)}).encode())  # + 24 B of flat
    P.decode(frames, max_message_bytes=224)
    with pytest.raises(P.ProtocolError, match="exceed the 223-byte limit"):
        P.decode(frames, max_message_bytes=223)
    with pytest.raises(P.ProtocolError, match="too large for the 99-byte limit"):
        P.decode(frames, max_message_bytes=99)


def test_non_buffer_frames_are_protocol_errors() -> None:
    with pytest.raises(P.ProtocolError, match="bytes-like"):
        P.decode([P.PREAMBLE, "not bytes"])
    with pytest.raises(P.ProtocolError, match="C-contiguous"):
        P.decode([P.PREAMBLE, np.frombuffer(msgpack.packb(HB) * 2, np.uint8)[::2]])


# ------------------------------------------------------------------ hostile input


def accepted(frames: list, max_message_bytes: int = P.DEFAULT_MAX_MESSAGE_BYTES) -> P.Message | None:
    """decode's message, or None where it refused ``frames`` with a ProtocolError (any other exception fails
    the test). What it accepts must be a sound message: one that came with the preamble, and whose own
    encoding decodes again and encodes to the same bytes."""
    try:
        msg = P.decode(frames, max_message_bytes)
    except P.ProtocolError:
        return None
    assert bytes(P._buffer(frames[0])) == P.PREAMBLE, "accepted a message without the preamble"
    again = wire(msg.encode())
    assert wire(P.decode(again).encode()) == again, "accepted a message that does not round-trip"
    return msg


def test_random_frames_only_raise_protocol_error() -> None:
    """Random bytes are (all but) never a message: nearly all of them are refused, and only ever with a
    ProtocolError; whatever is accepted is a sound message."""
    verdicts: list[bool] = []

    @settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(st.lists(st.binary(max_size=40), max_size=6), st.booleans())
    def check(frames: list, with_preamble: bool) -> None:
        verdicts.append(accepted([P.PREAMBLE, *frames] if with_preamble else frames, 1 << 20) is None)

    check()
    assert sum(verdicts) >= 0.9 * len(verdicts), f"{len(verdicts) - sum(verdicts)} of {len(verdicts)} accepted"


plain = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8) | st.integers(-9, 9), inner, max_size=3)
    ),
    max_leaves=12,
)


def test_hostile_headers_only_raise_protocol_error() -> None:
    """Headers of a known kind with random fields and values: most are refused, only ever with a
    ProtocolError; what is accepted is a sound message of that kind, with no field its kind lacks."""
    verdicts: list[bool] = []

    @settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(
        st.sampled_from(sorted(P.MESSAGE_TYPES)),
        st.dictionaries(
            st.sampled_from(
                [
                    "arrays",
                    "peer_id",
                    "role",
                    "run",
                    "ports",
                    "heartbeat_interval_s",
                    "seq",
                    "layout",
                    "stats",
                    "body",
                    "credit",
                    "policy_version",
                    "info",
                    "meta",
                    "peer_id",
                    "run_id",
                    "reason",
                    "rehello",
                    "x",
                ]
            ),
            plain,
            max_size=6,
        ),
        st.lists(st.binary(max_size=16), max_size=3),
    )
    def check(kind: str, fields: dict, arrays: list) -> None:
        msg = accepted(frames_of({"kind": kind, **fields}, *arrays), 1 << 20)
        verdicts.append(msg is None)
        if msg is not None:
            assert msg.KIND == kind
            assert set(fields) <= {f.name for f in dataclasses.fields(msg)}, "an unknown field was let through"

    check()
    assert sum(verdicts) >= 0.5 * len(verdicts), f"{len(verdicts) - sum(verdicts)} of {len(verdicts)} accepted"


def mutated(data, frames: list[bytes]) -> list[bytes]:
    """``frames`` with one of them damaged: 1-4 bytes overwritten, and maybe cut short."""
    i = data.draw(st.integers(0, len(frames) - 1))
    raw = bytearray(frames[i])
    for _ in range(data.draw(st.integers(1, 4))):
        if raw:
            raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        raw = raw[: data.draw(st.integers(0, len(raw)))]
    return [*frames[:i], bytes(raw), *frames[i + 1 :]]


def test_mutated_valid_messages_only_raise_protocol_error() -> None:
    """Valid messages with a few bytes damaged: most are refused, only ever with a ProtocolError. A damaged
    preamble is always refused; what is accepted is a sound message, and where only array bytes changed
    (same sizes), it carries them as they came: it re-encodes to the damaged frames byte for byte."""
    verdicts: list[bool] = []

    @settings(max_examples=300, deadline=None)
    @given(st.data())
    def check(data) -> None:
        frames = wire(data.draw(st.sampled_from(EXAMPLES)).encode())
        damaged = mutated(data, frames)
        msg = accepted(damaged)
        verdicts.append(msg is None)
        changed = [i for i, (a, b) in enumerate(zip(frames, damaged)) if a != b]
        if msg is not None and changed:
            assert changed[0] != 0, "accepted a damaged preamble"
            if changed[0] >= 2 and all(len(a) == len(b) for a, b in zip(frames, damaged)):
                assert wire(msg.encode()) == damaged

    check()
    assert sum(verdicts) >= 0.5 * len(verdicts), f"{len(verdicts) - sum(verdicts)} of {len(verdicts)} accepted"


# ------------------------------------------------------------------ fast paths keep the wire bytes and the objects

DTYPE_NAMES_OF = {dtype: name for name, dtype in P.DTYPES.items()}


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(names, wire_arrays(), max_size=6))
def test_encode_header_bytes_are_the_plain_msgpack_of_the_header(arrays: dict) -> None:
    """encode's shortcuts (wire-ready arrays as they are, tuple specs) change no byte of the header."""
    msg = traj(arrays=arrays)
    want = {"kind": "trajectory", **{f.name: getattr(msg, f.name) for f in dataclasses.fields(msg)}}
    want["arrays"] = packed(
        [[name, DTYPE_NAMES_OF[P.wire_array(a).dtype], list(np.shape(a))] for name, a in arrays.items()]
    )
    frames = msg.encode()
    assert bytes(frames[1]) == msgpack.packb(want, use_bin_type=True)
    for frame, array in zip(frames[2:], arrays.values()):
        assert bytes(P._buffer(frame)) == P.wire_array(array).tobytes()


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: m.KIND)
def test_decoded_message_is_what_its_constructor_builds(msg: P.Message) -> None:
    decoded = P.decode(wire(msg.encode()))
    rebuilt = type(decoded)(**{f.name: getattr(decoded, f.name) for f in dataclasses.fields(decoded)})
    assert vars(decoded).keys() == vars(rebuilt).keys()
    assert repr(decoded) == repr(rebuilt)
    with pytest.raises(dataclasses.FrozenInstanceError):  # still frozen without its __init__
        setattr(decoded, dataclasses.fields(decoded)[0].name, None)


FRAME_KINDS = ["bytes", "bytearray", "memoryview", "uint8 array", "float32 array"]


def frames_as(frames: list, kind: str) -> list:
    """The same bytes as another buffer type: decode takes any C-contiguous buffer."""
    raw = [bytes(P._buffer(f)) for f in frames]
    if kind == "bytearray":
        return [bytearray(r) for r in raw]
    if kind == "memoryview":
        return [memoryview(r) for r in raw]
    if kind == "uint8 array":
        return [np.frombuffer(r, np.uint8) for r in raw]
    if kind == "float32 array":  # a multi-byte itemsize, where the byte count allows it
        return [np.frombuffer(r, np.float32) if len(r) % 4 == 0 else r for r in raw]
    return raw


@pytest.mark.parametrize("kind", FRAME_KINDS)
def test_every_buffer_type_decodes_the_same(kind: str) -> None:
    for msg in EXAMPLES:
        assert_same(msg, P.decode(frames_as(msg.encode(), kind)))
        assert P.message_nbytes(frames_as(msg.encode(), kind)) == P.message_nbytes(wire(msg.encode()))


def generic_decode(frames: list, max_message_bytes: int = P.DEFAULT_MAX_MESSAGE_BYTES) -> P.Message:
    """decode without the generated readers: the reference they must agree with."""
    header = P._unpack_header(frames)
    cls = P._check_kind(header)
    return P._BUILD[cls](P._fields(cls, header, frames, max_message_bytes, True))


def same_outcome(frames: list, max_message_bytes: int = P.DEFAULT_MAX_MESSAGE_BYTES) -> None:
    msg, error = outcome(P.decode, frames, max_message_bytes)
    want, want_error = outcome(generic_decode, frames, max_message_bytes)
    assert error == want_error
    if want is not None:
        assert_same(want, msg)


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: m.KIND)
def test_generated_reader_takes_every_example(msg: P.Message) -> None:
    """The usual message goes through its kind's generated reader (else the speed-up is silently gone)
    and comes out as the generic checks build it."""
    frames = wire(msg.encode())
    header = P._unpack_header(frames)
    fields = P._FAST[type(msg)](header, frames, P.DEFAULT_MAX_MESSAGE_BYTES, True)
    want = P._fields(type(msg), header, frames, P.DEFAULT_MAX_MESSAGE_BYTES, True)
    assert fields is not None and fields.keys() == want.keys()
    assert_same(P._BUILD[type(msg)](want), P._BUILD[type(msg)](fields))


@pytest.mark.parametrize("frames,match", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_generated_readers_refuse_every_invalid_case_as_the_generic_checks_do(frames: list, match: str) -> None:
    same_outcome(frames)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_generated_readers_agree_on_mutated_and_reshaped_headers(data) -> None:
    """Damaged messages, and valid headers with a field dropped, added or retyped: decode's verdict (or
    message, defaults filled in) is the generic checks' one."""
    msg = data.draw(st.sampled_from(EXAMPLES))
    frames = wire(msg.encode())
    if data.draw(st.booleans()):
        frames = mutated(data, frames)
    else:
        header = msgpack.unpackb(frames[1])
        key = data.draw(st.sampled_from(sorted(header) + ["x"]))
        if data.draw(st.booleans()):
            header.pop(key, None)
        else:
            header[key] = data.draw(plain)
        frames = [frames[0], msgpack.packb(header, use_bin_type=True), *frames[2:]]
    same_outcome(frames, 1 << 20)


# ------------------------------------------------------------------ validate_trajectory: decode's verdict, no views


def outcome(fn, frames: list, max_message_bytes: int):
    try:
        return fn(frames, max_message_bytes), None
    except P.ProtocolError as exc:
        return None, str(exc)


def assert_validate_agrees(frames: list, max_message_bytes: int = P.DEFAULT_MAX_MESSAGE_BYTES) -> None:
    """validate_trajectory accepts exactly the trajectories decode accepts and fails with decode's error
    (for another kind, valid or not, with "not a trajectory" once the header itself is sound)."""
    msg, error = outcome(P.decode, frames, max_message_bytes)
    header, v_error = outcome(P.validate_trajectory, frames, max_message_bytes)
    if isinstance(msg, P.Trajectory):
        assert v_error is None, v_error
        want = {f.name: getattr(msg, f.name) for f in dataclasses.fields(msg)}
        want["arrays"] = [[name, DTYPE_NAMES_OF[a.dtype], list(a.shape)] for name, a in msg.arrays.items()]
        assert header == {"kind": "trajectory", **want}
        return
    assert header is None, "validate_trajectory accepted what decode refused or decoded as another kind"
    try:
        kind = P.decode_header(frames, max_message_bytes)["kind"]
    except P.ProtocolError:
        kind = "trajectory"  # the header itself is bad: both fail in decode_header
    if kind == "trajectory":
        assert v_error == error
    else:
        assert v_error == f"a {kind} message is not a trajectory"


@pytest.mark.parametrize("frames,match", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_validate_trajectory_agrees_on_every_invalid_case(frames: list, match: str) -> None:
    assert_validate_agrees(frames)


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: m.KIND)
def test_validate_trajectory_agrees_on_every_example(msg: P.Message) -> None:
    for kind in FRAME_KINDS:
        assert_validate_agrees(frames_as(msg.encode(), kind))


def test_claimed_sender_reads_only_what_a_readable_header_names() -> None:
    """For charging a malformed trajectory (and returning its credit) to an actor: the header's peer_id if the
    preamble and header can be read at all, whatever else is wrong; None otherwise."""
    good = traj_frames()
    assert P.claimed_peer_id(good) == "actor-0"
    assert P.claimed_peer_id(traj_frames(ep_returns=[math.nan], ep_lengths=[1])) == "actor-0"  # invalid, readable
    assert P.claimed_peer_id(good[:2]) == "actor-0"  # array frames missing
    header = msgpack.unpackb(bytes(good[1]))
    assert P.claimed_peer_id([good[0], msgpack.packb({**header, "peer_id": 7}), *good[2:]]) is None
    assert P.claimed_peer_id([good[0], msgpack.packb({k: v for k, v in header.items() if k != "peer_id"})]) is None
    assert P.claimed_peer_id([good[0], b"\xc1not msgpack"]) is None
    assert P.claimed_peer_id([b"XXXX\x01", good[1]]) is None
    assert P.claimed_peer_id([b"junk"]) is None


def test_validate_trajectory_limits_and_result() -> None:
    msg = traj(arrays=traj_arrays(T=2, N=2, obs_shape=(25,)))  # obs 400 B, next_obs 200 B, 116 B more
    frames = wire(msg.encode())
    total = sum(a.nbytes for a in msg.arrays.values())
    for limit in (total, total - 1, 400, 399, 0):
        assert_validate_agrees(frames, limit)
    header = P.validate_trajectory(frames, total)
    assert header["arrays"][:2] == [["obs", "float32", [2, 2, 25]], ["actions", "int64", [2, 2]]]
    assert header["seq"] == 3 and header["env_steps"] == 4
    with pytest.raises(P.ProtocolError, match=f"exceed the {total - 1}-byte limit"):
        P.validate_trajectory(frames, total - 1)
    minimal = msgpack.unpackb(frames[1])
    for optional in ("info", "ep_returns", "ep_lengths"):  # their defaults are filled in
        del minimal[optional]
    minimal_frames = [frames[0], msgpack.packb(minimal), *frames[2:]]
    assert P.validate_trajectory(minimal_frames, total)["info"] == {} == P.decode(minimal_frames).info
    assert P.decode(minimal_frames).ep_returns == [] == P.decode(minimal_frames).ep_lengths
    with pytest.raises(P.ProtocolError, match="a heartbeat message is not a trajectory"):
        P.validate_trajectory(frames_of(HB), 0)


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(names, wire_arrays(), max_size=6), st.integers(0, 400), st.sampled_from(FRAME_KINDS))
def test_validate_trajectory_agrees_on_random_trajectories(arrays: dict, limit: int, kind: str) -> None:
    assert_validate_agrees(frames_as(traj(arrays=arrays).encode(), kind), limit)


def spec_nbytes(spec: list) -> int | None:
    """Bytes of the frame ``spec`` asks for, if it is a well-formed spec small enough to build."""
    try:
        name, dtype_name, shape = spec
        size = math.prod(shape) * P.DTYPES[dtype_name].itemsize
    except Exception:  # noqa: BLE001 - any malformed spec
        return None
    return size if all(type(d) is int and d >= 0 for d in shape) and size <= 4096 else None


def hostile_trajectory(rnd: random.Random) -> tuple[list, int]:
    """Frames of a trajectory with a few defects, and a size limit. Most parts are well formed (specs,
    frames of the announced size, fields), so every check of decode gets reached, not just the first."""

    def pick(good: list, bad: list, p_bad: float = 0.08):
        return rnd.choice(bad if rnd.random() < p_bad else good)

    arrays, frames = [], []
    for _ in range(rnd.choice([0, 1, 2, 3, 4])):
        shape = [rnd.randint(0, 4) for _ in range(rnd.randint(0, 3))]
        if rnd.random() < 0.1:
            shape.insert(rnd.randint(0, len(shape)), rnd.choice([-1, True, False, 1.0, 2**40, "2", None]))
        spec = [
            pick(list("abcdef"), ["", 7, None, "a"]),
            pick(DTYPE_NAMES, ["complex64", "<f4", 4, None, ["int8"]]),
            pick([shape], [3, None, "ab", [1] * 9, [0, 2**40, 2**40]]),
        ]
        arrays.append(pick([spec], [spec[:2], [*spec, 1], None, "abc"]))
        size = spec_nbytes(spec)
        frames.append(b"\x01" * (rnd.randint(0, 24) if size is None or rnd.random() < 0.08 else size))
    if rnd.random() < 0.08:
        frames = frames[1:] if frames and rnd.random() < 0.5 else [*frames, b""]
    header = {**GOOD, "arrays": pick([arrays], [None, {}, "arrays", [], ..., b"\xc1", packed({"a": 1})])}
    if rnd.random() < 0.3:
        header[rnd.choice(["run_id", "seq", "env_steps", "info", "x"])] = rnd.choice(
            ["r", 1, -1, True, 1.5, None, {}, {"k": [1]}, {"k": {"n": b""}}, {"k": {2: 1}}, [], ...]
        )
    header = {k: v for k, v in header.items() if v is not ...}
    return frames_of(header, *frames), rnd.choice([P.DEFAULT_MAX_MESSAGE_BYTES, 64, 8, 0])


@settings(max_examples=500, deadline=None)
@given(st.randoms(use_true_random=True))  # real frequencies, not shrink-friendly ones
def test_validate_trajectory_agrees_on_hostile_trajectories(rnd: random.Random) -> None:
    assert_validate_agrees(*hostile_trajectory(rnd))


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_validate_trajectory_agrees_on_mutated_messages(data) -> None:
    frames = wire(
        data.draw(
            st.sampled_from(
                [
                    traj(),
                    params(),
                    traj(arrays=traj_arrays(K=1)),
                    traj(arrays={"x": np.arange(6.0).reshape(2, 3), "y": np.zeros(0, np.int8)}),
                ]
            )
        ).encode()
    )
    frames = mutated(data, frames)
    if data.draw(st.booleans()):
        frames = data.draw(st.permutations(frames)) if data.draw(st.booleans()) else [*frames, frames[-1]]
    assert_validate_agrees(frames, data.draw(st.sampled_from([P.DEFAULT_MAX_MESSAGE_BYTES, 16, 0])))


def test_zmq_frames_take_the_same_checks_as_bytes() -> None:
    """zmq.Frame has its own fast paths (preamble, header, array sizes): same verdicts, same errors."""
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        a.bind("inproc://frames-vs-bytes")
        b.connect("inproc://frames-vs-bytes")
        cases = [wire(m.encode()) for m in EXAMPLES] + [frames for _, frames, _ in BAD if frames]
        for frames in cases:
            a.send_multipart(frames, copy=False)
            assert b.poll(5000)
            received = b.recv_multipart(copy=False)
            assert all(isinstance(f, zmq.Frame) for f in received)
            assert P.message_nbytes(received) == P.message_nbytes(frames) == sum(len(bytes(f)) for f in frames)
            assert outcome(P.decode, received, 1 << 20)[1] == outcome(P.decode, frames, 1 << 20)[1]
            assert_validate_agrees(received, 1 << 20)
    finally:
        a.close(linger=0)
        b.close(linger=0)
        ctx.term()


def test_encode_sends_wire_ready_arrays_without_copying() -> None:
    ready = {"f": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.zeros(3, bool), "s": np.array(7, np.int64)}
    other = {"t": ready["f"].T, "be": np.arange(3, dtype=">i4"), "list": [1.5, 2.5]}
    frames = P.encode(carrier({**ready, **other}))
    for frame, array in zip(frames[3:], ready.values()):  # after 'flat'
        assert frame is array
    for frame, array in zip(frames[3 + len(ready) :], other.values()):
        assert not np.shares_memory(frame, np.asarray(array)) and np.array_equal(frame, array)
    assert_same(carrier({**ready, **other}), P.decode(frames))


def test_unexportable_array_frames_are_protocol_errors() -> None:
    header = with_(arrays=[["a", "int64", [2]]])
    for frame in (np.zeros(2, "M8[s]"), np.zeros(2, "m8[s]")):
        with pytest.raises(P.ProtocolError, match="bytes-like"):
            P.decode(frames_of(header, frame))
        with pytest.raises(P.ProtocolError, match="bytes-like"):
            P.validate_trajectory(frames_of(header, frame), 1 << 20)


DECLARED = P.declaration_of([["actor_td", "float32", [], "step"], ["h0", "float32", [3], "rollout"]])


def test_a_trajectory_carries_its_runs_declared_arrays() -> None:
    """Decode takes arrays beyond section 7's; the run's declaration (section 7.1) says which: a forwarder refuses
    the rest, and a declared array of another dtype or shape, or missing."""
    td, h0 = np.arange(4, dtype=F32).reshape(2, 2), np.zeros((2, 3), F32)
    msg = P.decode(traj_frames(actor_td=td, h0=h0))
    np.testing.assert_array_equal(msg.arrays["actor_td"], td)
    header = P.validate_trajectory(traj_frames(actor_td=td, h0=h0), 1 << 20)
    assert DECLARED.refusal(header["arrays"]) == "" and DECLARED.refusal_of(msg.arrays) == ""
    assert "neither a trajectory's own nor declared" in P.DeclaredLayout().refusal(header["arrays"])
    cases = [
        ({"h0": h0}, "declared array 'actor_td' must be float32 [2, 2], got missing"),
        ({"actor_td": td.astype(np.float64), "h0": h0}, "'actor_td' must be float32 [2, 2], got float64 [2, 2]"),
        ({"actor_td": td, "h0": np.zeros((2, 2, 3), F32)}, "'h0' must be float32 [2, 3], got float32 [2, 2, 3]"),
        ({"actor_td": td, "h0": h0, "q_taken": td}, "arrays ['q_taken'] are neither"),
    ]
    for arrays, error in cases:
        specs = P.validate_trajectory(traj_frames(**arrays), 1 << 20)["arrays"]
        assert error in DECLARED.refusal(specs), arrays
        assert error in DECLARED.refusal(specs)  # the answer kept for this layout is the same


@pytest.mark.parametrize(
    ("arrays", "error"),
    [
        ("x", "must be a list"),
        ([["a", "float32", []]], "[name, dtype, shape, per]"),
        ([["rewards", "float32", [], "step"]], "a trajectory's own"),
        ([["a", "float32", [], "step"], ["a", "float32", [], "step"]], "declared twice"),
        ([["a b", "float32", [], "step"]], "must be an identifier"),
        ([["a", "float128", [], "step"]], "has dtype 'float128'"),
        ([["a", "float32", [0], "step"]], "sizes >= 1"),
        ([["a", "float32", [], "episode"]], "per must be one of"),
    ],
)
def test_a_bus_with_a_bad_declaration_is_refused(arrays: object, error: str) -> None:
    bus = {"sync": True, "max_staleness": 0, "max_in_flight": 2, "arrays": arrays}
    assert error in P.bus_refusal(bus)


def test_a_declaration_travels_in_the_bus_and_back() -> None:
    bus = {"sync": False, "max_staleness": 4, "max_in_flight": 2, "arrays": DECLARED.to_wire()}
    assert P.bus_refusal(bus) == "" and P.run_bus(bus).arrays == DECLARED and P.run_bus(bus).to_wire() == bus
