"""The zddrl wire protocol: every message that crosses a socket is defined here, and only here.

Every message is one ZeroMQ multipart message::

    frame 0   preamble   b"ZDRL" + one byte protocol version (5 bytes)
    frame 1   header     msgpack map: {"kind": str, <kind's fields>, "arrays": [[name, dtype, shape], ...]}
    frame 2+  arrays     one raw, C-contiguous, little-endian buffer per entry of header["arrays"], in order

Small values travel in the msgpack header; numpy arrays travel as their own frames, sent with
``copy=False`` and received zero-copy (``np.frombuffer`` over the ZeroMQ frame). Nothing is ever
pickled. ``decode`` validates everything before a message is used and raises one
:class:`ProtocolError` that says what was wrong. docs/protocol.md documents every frame.

A ROUTER socket prepends the peer's identity frame; ``split_routed`` separates it.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping, Sequence

import msgpack
import numpy as np

SIGNATURE = b"ZDRL"
PROTOCOL_VERSION = 1
PREAMBLE = SIGNATURE + bytes([PROTOCOL_VERSION])

MAX_HEADER_BYTES = 1 << 20
"""A header is metadata; anything bigger than 1 MiB is hostile or a bug."""
MAX_ARRAYS = 64
MAX_NDIM = 8
"""Most dimensions an array (or a parameter-layout row) may have."""
DEFAULT_MAX_MESSAGE_BYTES = 1 << 30
"""Default limit on the summed size of all array frames of one message (1 GiB)."""

# Wire dtype names (language-neutral) -> numpy dtype. Everything is little-endian on the wire.
DTYPES: dict[str, np.dtype] = {
    "bool": np.dtype(np.bool_),
    "int8": np.dtype("<i1"),
    "uint8": np.dtype("<u1"),
    "int16": np.dtype("<i2"),
    "uint16": np.dtype("<u2"),
    "int32": np.dtype("<i4"),
    "uint32": np.dtype("<u4"),
    "int64": np.dtype("<i8"),
    "uint64": np.dtype("<u8"),
    "float16": np.dtype("<f2"),
    "float32": np.dtype("<f4"),
    "float64": np.dtype("<f8"),
}
_DTYPE_NAMES = {dt: name for name, dt in DTYPES.items()}


class ProtocolError(ValueError):
    """A message that does not follow the protocol. The text says what was wrong."""


def param_hash(buffer: bytes | memoryview | np.ndarray) -> str:
    """Integrity hash of a flat parameter buffer: the first 16 hex digits of the SHA-1 of its wire bytes.

    An array is hashed as it travels (C order, little-endian), so the sender's and the receiver's
    hashes agree whatever the sender's memory layout or byte order.
    """
    if isinstance(buffer, np.ndarray):
        buffer = wire_array(buffer)
    return hashlib.sha1(_buffer(buffer)).hexdigest()[:16]


# --------------------------------------------------------------------------------------------
# Messages. One frozen dataclass per kind; fields are the header's keys, ``arrays`` the frames.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Message:
    KIND: ClassVar[str] = ""
    HAS_ARRAYS: ClassVar[bool] = False

    def encode(self) -> list[Any]:
        return encode(self)


@dataclass(frozen=True)
class Hello(Message):
    """Client -> broker control socket: join. Learners also announce the run they own."""

    KIND: ClassVar[str] = "hello"
    role: str  # "actor" | "learner" | "monitor"
    peer_id: str
    host: str = ""
    pid: int = 0
    num_envs: int = 0
    run_id: str = ""
    run: dict | None = None  # learner only: the run spec every actor receives in its welcome
    shard: int = 0
    num_shards: int = 1


@dataclass(frozen=True)
class Welcome(Message):
    """Broker -> client: the data ports (same host as the control endpoint) and the run spec."""

    KIND: ClassVar[str] = "welcome"
    peer_id: str
    run_id: str
    run: dict | None
    ports: dict  # {"trajectories": int, "learners": int, "params": int}
    heartbeat_interval_s: float
    heartbeat_liveness: int
    max_message_bytes: int


@dataclass(frozen=True)
class Heartbeat(Message):
    """Both ways on the control socket. Clients report the policy version they act with."""

    KIND: ClassVar[str] = "heartbeat"
    peer_id: str
    policy_version: int = -1


@dataclass(frozen=True)
class Reject(Message):
    """Broker -> client: the request was refused; ``reason`` says why. Unknown peers must send hello again."""

    KIND: ClassVar[str] = "reject"
    reason: str
    rehello: bool = False


@dataclass(frozen=True)
class Trajectory(Message):
    """Actor -> broker -> one learner shard: one rollout, time-major ``[T, N, ...]`` arrays."""

    KIND: ClassVar[str] = "trajectory"
    HAS_ARRAYS: ClassVar[bool] = True
    run_id: str
    sender: str
    seq: int
    policy_version: int
    param_hash: str
    env_steps: int
    arrays: Mapping[str, np.ndarray] = field(default_factory=dict)
    info: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Parameters(Message):
    """Learner -> broker -> every actor: one policy version as a flat buffer plus its layout.

    ``layout`` rows are ``[name, dtype, shape, offset]`` with ``offset`` in elements of the flat
    buffer ``arrays["flat"]``; ``param_hash`` is ``param_hash(flat)``. Other arrays (for example
    observation-normalisation statistics) travel beside it. ``meta`` carries small per-version
    settings such as the sync-mode rollout length.
    """

    KIND: ClassVar[str] = "params"
    HAS_ARRAYS: ClassVar[bool] = True
    run_id: str
    sender: str
    policy_version: int
    param_hash: str
    layout: list
    arrays: Mapping[str, np.ndarray] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)


@dataclass(frozen=True)
class ParamsRequest(Message):
    """Actor -> broker control: send me the cached parameters if they are newer than ``have_version``."""

    KIND: ClassVar[str] = "params_request"
    peer_id: str
    have_version: int = -1


@dataclass(frozen=True)
class Credit(Message):
    """Learner shard -> broker learner socket: I can take ``credit`` more trajectories."""

    KIND: ClassVar[str] = "credit"
    sender: str
    credit: int


@dataclass(frozen=True)
class Stats(Message):
    """Any client -> broker control: a flat map of figures for ``zddrl status``."""

    KIND: ClassVar[str] = "stats"
    sender: str
    role: str
    stats: dict


@dataclass(frozen=True)
class StatusRequest(Message):
    KIND: ClassVar[str] = "status_request"
    peer_id: str = ""


@dataclass(frozen=True)
class Status(Message):
    """Broker -> requester: counters, members and drops (see docs/protocol.md for the keys)."""

    KIND: ClassVar[str] = "status"
    body: dict


@dataclass(frozen=True)
class Bye(Message):
    """Client -> broker control: I am leaving on purpose (no expiry needed)."""

    KIND: ClassVar[str] = "bye"
    peer_id: str
    reason: str = ""


MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.KIND: cls
    for cls in (Hello, Welcome, Heartbeat, Reject, Trajectory, Parameters, ParamsRequest, Credit, Stats,
                StatusRequest, Status, Bye)
}


# --------------------------------------------------------------------------------------------
# Encoding
# --------------------------------------------------------------------------------------------


def _msgpack_default(obj: Any) -> Any:
    # numpy scalars and small arrays show up in stats and meta maps; send them as plain values.
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    raise TypeError(f"cannot put a {type(obj).__name__} in a message header")


def wire_array(array: np.ndarray) -> np.ndarray:
    """The array as it goes on the wire: C-contiguous, little-endian, a whitelisted dtype, same shape.

    Copies only when needed (non-contiguous or big-endian input); 0-d arrays stay 0-d.
    """
    array = np.asarray(array)
    dtype = array.dtype.newbyteorder("<")  # a no-op for "<" and "|"; converts ">" and a big-endian "="
    if dtype not in _DTYPE_NAMES or dtype.kind not in "biuf":
        raise ProtocolError(f"dtype {array.dtype} cannot travel; allowed: {', '.join(DTYPES)}")
    if array.ndim > MAX_NDIM:
        raise ProtocolError(f"array of {array.ndim} dimensions cannot travel (at most {MAX_NDIM})")
    # np.ascontiguousarray would turn a 0-d array into shape (1,); np.require keeps the shape.
    return np.require(array, dtype=dtype, requirements="C")


def encode(msg: Message) -> list[Any]:
    """Frames of ``msg``: ``[PREAMBLE, header, *array buffers]``. Send with ``copy=False``."""
    header: dict[str, Any] = {"kind": msg.KIND}
    buffers: list[Any] = []
    for f in dataclasses.fields(msg):
        value = getattr(msg, f.name)
        if f.name == "arrays":
            if len(value) > MAX_ARRAYS:
                raise ProtocolError(f"{msg.KIND}: {len(value)} arrays, at most {MAX_ARRAYS} can travel")
            specs = []
            for name, array in value.items():
                if not isinstance(name, str) or not name:
                    raise ProtocolError(f"{msg.KIND}: array name {name!r} must be a non-empty string")
                array = wire_array(array)
                specs.append([name, _DTYPE_NAMES[array.dtype], list(array.shape)])
                buffers.append(array)
            header["arrays"] = specs
        else:
            header[f.name] = value
    return [PREAMBLE, msgpack.packb(header, default=_msgpack_default, use_bin_type=True), *buffers]


# --------------------------------------------------------------------------------------------
# Decoding and validation
# --------------------------------------------------------------------------------------------


def _buffer(frame: Any) -> memoryview:
    """The frame's bytes as a flat unsigned-byte view, without copying.

    zmq.Frame (``copy=False``) exposes ``.buffer``; bytes and arrays are buffers already.
    """
    buf = getattr(frame, "buffer", None)
    try:
        view = buf if isinstance(buf, memoryview) else memoryview(frame)
    except TypeError:
        raise ProtocolError(f"a frame must be a bytes-like buffer, got {type(frame).__name__}") from None
    if view.nbytes == 0:
        return memoryview(b"")
    if not view.c_contiguous:
        raise ProtocolError("a frame must be a C-contiguous buffer")
    return view if view.ndim == 1 and view.format == "B" else view.cast("B")


def _plain(value: Any) -> bool:
    """True if ``value`` is plain data: nil, bool, int, float, str, bin, arrays and str-keyed maps of those.

    Iterative, so a deeply nested hostile header cannot exhaust the Python stack.
    """
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            if not all(isinstance(k, str) for k in v):
                return False
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
        elif not (v is None or isinstance(v, (bool, int, float, str, bytes))):
            return False  # msgpack ext types (ExtType, Timestamp) have no place in a header
    return True


def _type_ok(value: Any, hint: Any) -> bool:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return any(_type_ok(value, h) for h in typing.get_args(hint))
    origin = typing.get_origin(hint) or hint
    if hint is type(None):
        return value is None
    if origin is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if origin is bool:
        return isinstance(value, bool)
    if origin in (dict, Mapping):
        return isinstance(value, dict) and _plain(value)
    if origin in (list, Sequence):
        return isinstance(value, list) and _plain(value)
    return isinstance(value, origin)


def _is_int(value: Any, lo: int, hi: int | None = None) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= lo and (hi is None or value <= hi)


def _shape_ok(shape: Any) -> bool:
    return isinstance(shape, list) and len(shape) <= MAX_NDIM and all(_is_int(d, 0) for d in shape)


_HINTS: dict[type[Message], dict[str, Any]] = {cls: typing.get_type_hints(cls) for cls in MESSAGE_TYPES.values()}


def _decode_arrays(specs: Any, frames: Sequence[Any], max_message_bytes: int) -> dict[str, np.ndarray]:
    if not isinstance(specs, list):
        raise ProtocolError("header 'arrays' must be a list of [name, dtype, shape]")
    if len(specs) != len(frames):
        raise ProtocolError(f"header names {len(specs)} arrays but {len(frames)} array frames follow")
    arrays: dict[str, np.ndarray] = {}
    total = 0
    for i, (spec, frame) in enumerate(zip(specs, frames)):
        if not (isinstance(spec, list) and len(spec) == 3):
            raise ProtocolError(f"array spec {i} must be [name, dtype, shape]")
        name, dtype_name, shape = spec
        if not isinstance(name, str) or not name:
            raise ProtocolError(f"array spec {i}: name {name!r} must be a non-empty string")
        if name in arrays:
            raise ProtocolError(f"array spec {i}: duplicate array name {name!r}")
        dtype = DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
        if dtype is None:
            raise ProtocolError(f"array {name!r}: dtype {dtype_name!r} is not allowed; allowed: {', '.join(DTYPES)}")
        if not _shape_ok(shape):
            raise ProtocolError(f"array {name!r}: shape {shape!r} must be a list of at most {MAX_NDIM} "
                                "non-negative ints")
        # Zero-size arrays may have huge other dimensions; numpy (and sanity) cannot hold those.
        if math.prod(d for d in shape if d) * dtype.itemsize > max_message_bytes:
            raise ProtocolError(f"array {name!r}: shape {shape} is too large for the {max_message_bytes}-byte "
                                "limit")
        buf = _buffer(frame)
        expected = math.prod(shape) * dtype.itemsize
        if expected != buf.nbytes:
            raise ProtocolError(f"array {name!r}: shape {shape} x {dtype_name} needs {expected} bytes, "
                                f"frame has {buf.nbytes}")
        total += expected
        if total > max_message_bytes:
            raise ProtocolError(f"message arrays exceed the {max_message_bytes}-byte limit")
        arrays[name] = np.frombuffer(buf, dtype=dtype).reshape(shape)
    return arrays


def decode_header(frames: Sequence[Any], max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> dict[str, Any]:
    """Check preamble, frame count and header; return the header map (arrays not yet checked)."""
    if len(frames) < 2:
        raise ProtocolError(f"a message has at least 2 frames (preamble, header), got {len(frames)}")
    if len(frames) > MAX_ARRAYS + 2:
        raise ProtocolError(f"too many frames: {len(frames)} > {MAX_ARRAYS + 2}")
    first = _buffer(frames[0])
    head = bytes(first[:8])  # never copy a huge frame
    if head[:4] != SIGNATURE:
        raise ProtocolError(f"bad signature {head!r}: not a zddrl message")
    if first.nbytes != len(PREAMBLE) or head[4] != PROTOCOL_VERSION:
        version = head[4] if len(head) > 4 else None
        raise ProtocolError(f"unsupported protocol version {version} in a {first.nbytes}-byte preamble "
                            f"(this side speaks {PROTOCOL_VERSION}: preamble {PREAMBLE.hex()})")
    raw = _buffer(frames[1])
    if raw.nbytes > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {raw.nbytes} bytes exceeds the {MAX_HEADER_BYTES}-byte limit")
    try:
        header = msgpack.unpackb(raw, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises a zoo of types on garbage
        raise ProtocolError(f"header is not valid msgpack: {exc}") from None
    if not isinstance(header, dict):
        raise ProtocolError(f"header must be a msgpack map, got {type(header).__name__}")
    bad_keys = [k for k in header if not isinstance(k, str)]
    if bad_keys:
        raise ProtocolError(f"header keys must be strings, got {bad_keys[0]!r}")
    kind = header.get("kind")
    if not isinstance(kind, str) or kind not in MESSAGE_TYPES:
        raise ProtocolError(f"unknown message kind {kind!r}")
    return header


def decode(frames: Sequence[Any], max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> Message:
    """Validate ``frames`` and build the message. Raises :class:`ProtocolError` on any defect.

    Array values are views over the frames (zero-copy, no copy is made): they share the frames'
    memory, so copy them before mutating or before the frames' buffers are reused.
    """
    header = decode_header(frames, max_message_bytes)
    cls = MESSAGE_TYPES[header.pop("kind")]
    hints = _HINTS[cls]
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name == "arrays":
            if "arrays" not in header:
                raise ProtocolError(f"{cls.KIND}: missing field 'arrays'")
            kwargs["arrays"] = _decode_arrays(header.pop("arrays"), frames[2:], max_message_bytes)
            continue
        if f.name not in header:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ProtocolError(f"{cls.KIND}: missing field {f.name!r}")
            continue
        value = header.pop(f.name)
        if not _type_ok(value, hints[f.name]):
            raise ProtocolError(f"{cls.KIND}: field {f.name!r} has the wrong type ({type(value).__name__})")
        kwargs[f.name] = value
    if not cls.HAS_ARRAYS and len(frames) > 2:
        raise ProtocolError(f"{cls.KIND} carries no arrays, got {len(frames) - 2} extra frames")
    if header:
        raise ProtocolError(f"{cls.KIND}: unknown fields {sorted(header)}")
    check = _CHECKS.get(cls)
    if check is not None:
        check(kwargs)
    return cls(**kwargs)


def _check_welcome(fields: dict[str, Any]) -> None:
    for name, port in fields["ports"].items():
        if not _is_int(port, 1, 65535):
            raise ProtocolError(f"welcome: port {name!r} must be an int in 1..65535, got {port!r}")
    if fields["heartbeat_interval_s"] <= 0:
        raise ProtocolError(f"welcome: heartbeat_interval_s must be > 0, got {fields['heartbeat_interval_s']}")
    if fields["heartbeat_liveness"] < 1:
        raise ProtocolError(f"welcome: heartbeat_liveness must be >= 1, got {fields['heartbeat_liveness']}")
    if fields["max_message_bytes"] < 0:
        raise ProtocolError(f"welcome: max_message_bytes must be >= 0, got {fields['max_message_bytes']}")


def _check_params(fields: dict[str, Any]) -> None:
    """Layout rows ``[name, dtype, shape, offset]`` must be well formed and fit the flat buffer."""
    flat = fields["arrays"].get("flat")
    if flat is not None and flat.ndim != 1:
        raise ProtocolError(f"params: array 'flat' must be 1-d, got shape {list(flat.shape)}")
    names: set[str] = set()
    for i, row in enumerate(fields["layout"]):
        if not (isinstance(row, list) and len(row) == 4):
            raise ProtocolError(f"params: layout row {i} must be [name, dtype, shape, offset], got {row!r}")
        name, dtype_name, shape, offset = row
        if not isinstance(name, str) or not name or name in names:
            raise ProtocolError(f"params: layout row {i}: name {name!r} must be a unique non-empty string")
        names.add(name)
        if not isinstance(dtype_name, str) or dtype_name not in DTYPES:
            raise ProtocolError(f"params: layout row {name!r}: dtype {dtype_name!r} is not allowed")
        if not _shape_ok(shape):
            raise ProtocolError(f"params: layout row {name!r}: bad shape {shape!r}")
        if not _is_int(offset, 0):
            raise ProtocolError(f"params: layout row {name!r}: offset {offset!r} must be a non-negative int")
        if flat is not None and offset + math.prod(shape) > flat.size:
            raise ProtocolError(f"params: layout row {name!r} (offset {offset}, shape {shape}) does not fit "
                                f"the flat buffer of {flat.size} elements")


_CHECKS = {Welcome: _check_welcome, Parameters: _check_params}


def split_routed(frames: Sequence[Any]) -> tuple[bytes, Sequence[Any]]:
    """Split a ROUTER-received message into (peer identity, message frames)."""
    if len(frames) < 3:
        raise ProtocolError("routed message lacks an identity frame")
    return bytes(_buffer(frames[0])), frames[1:]


def message_nbytes(frames: Sequence[Any]) -> int:
    """Bytes of all frames together (what the counters call 'bytes')."""
    return sum(_buffer(f).nbytes for f in frames)
