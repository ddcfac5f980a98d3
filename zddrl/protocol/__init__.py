"""The zddrl wire protocol: every message that crosses a socket is defined in this package, and only here.

Every message is one ZeroMQ multipart message::

    frame 0   preamble   b"ZDRL" + one byte protocol version (5 bytes)
    frame 1   header     msgpack map: {"kind": str, <kind's fields>, "arrays": bin}; the bin holds the
                         msgpack list [[name, dtype, shape], ...] (the layout)
    frame 2+  arrays     one raw, C-contiguous, little-endian buffer per spec of the layout, in order

Small values travel in the msgpack header; numpy arrays travel as their own frames, sent with
``copy=False`` and received zero-copy (a numpy view over the ZeroMQ frame). Nothing is ever
pickled. ``decode`` validates everything before a message is used and raises one
:class:`ProtocolError` that says what was wrong; ``validate_trajectory`` does the same checks for
a forwarder without building anything. docs/protocol.md documents every frame. The per-frame and
per-array work (limits, dtypes, layouts, which are validated once and remembered) is in
zddrl/protocol/frames.py, the rules of each kind's fields (welcome ports, parameter layouts and chunks) in
zddrl/protocol/rules.py, the messages themselves in zddrl/protocol/messages.py; all are re-exported here.

A ROUTER socket prepends the peer's identity frame; ``split_routed`` separates it.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import Any

import msgpack
import numpy as np

from zddrl.protocol.fields import builder, fast_reader, field_table
from zddrl.protocol.frames import (  # noqa: F401
    DEFAULT_MAX_MESSAGE_BYTES,
    DTYPES,
    MAX_ARRAYS,
    MAX_HEADER_BYTES,
    MAX_NDIM,
    PREAMBLE,
    PROTOCOL_VERSION,
    SIGNATURE,
    Layout,
    ProtocolError,
    ZmqFrame,
    check_arrays,
    check_preamble,
    encode_arrays,
    flat_buffer,
    frame_buffer,
    param_hash,
    wire_array,
)
from zddrl.protocol.messages import (  # noqa: F401  (part of this package's interface)
    CRASH_PREFIX,
    MESSAGE_TYPES,
    PASSIVE_PREFIX,
    REFUSED_PREFIX,
    ROLES,
    Bye,
    Credit,
    Fleet,
    Heartbeat,
    Hello,
    Message,
    ParamChunk,
    Parameters,
    ParamsRequest,
    Reject,
    ReplayBatch,
    ReplaySample,
    Stats,
    Status,
    StatusRequest,
    Subtree,
    Trajectory,
    Welcome,
)

# The byte layer (preamble, limits, dtypes, array frames) lives in zddrl.protocol.frames; its public names are
# part of this module's interface too.
from zddrl.protocol.rules import (  # noqa: F401
    BUS_ARRAYS,
    DATA_IDENTITY_BYTES,
    MAX_FLEET_ACTORS_BYTES,
    MAX_HEARTBEAT_INTERVAL_S,
    MAX_HOST_BYTES,
    MAX_ID_BYTES,
    MAX_NUM_ENVS,
    MAX_PARAM_CHUNKS,
    MAX_REPLAY_BATCH,
    MAX_REPLAY_RETURNS,
    MAX_SIGNER_BYTES,
    MIN_HEARTBEAT_INTERVAL_S,
    PARAM_DTYPES,
    REPLAY_BATCH_ARRAYS,
    SIGNATURE_BYTES,
    TRAJECTORY_ARRAYS,
    TRUNCATION_ARRAYS,
    DeclaredLayout,
    bus_refusal,
    check_chunk,
    check_fleet,
    check_heartbeat,
    check_hello,
    check_params,
    check_replay_batch,
    check_replay_sample,
    check_subtree,
    check_trajectory,
    check_trajectory_layout,
    check_welcome,
    declaration_of,
    fleet_entry_bytes,
    hello_refusal,
    run_bus,
)

_buffer = flat_buffer  # the name tests and docs/src/gen_protocol.py know


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


_packers = threading.local()


def _packb(header: dict[str, Any]) -> bytes:
    """``msgpack.packb(header)`` with this thread's Packer: building one per message costs more than packing a small
    header. A Packer resets its buffer after each pack, also when packing fails."""
    packer = getattr(_packers, "packer", None)
    if packer is None:
        packer = _packers.packer = msgpack.Packer(default=_msgpack_default, use_bin_type=True)
    return packer.pack(header)


def encode(msg: Message) -> list[Any]:
    """Frames of ``msg``: ``[PREAMBLE, header, *array buffers]``. Send with ``copy=False``."""
    names = _FIELD_NAMES.get(type(msg)) or tuple(f.name for f in dataclasses.fields(msg))
    # Field order is header order: the bytes stay what docs/protocol.md shows. A message's __dict__
    # holds its fields in that order (both __init__ and decode's builder fill it so): copy it at once.
    state = getattr(msg, "__dict__", None)
    if state is not None and tuple(state) == names:
        header: dict[str, Any] = {"kind": msg.KIND, **state}
    else:
        header = {"kind": msg.KIND, **{name: getattr(msg, name) for name in names}}
    buffers: list[Any] = []
    if "arrays" in header:
        header["arrays"] = encode_arrays(msg.KIND, header["arrays"], buffers)
    return [PREAMBLE, _packb(header), *buffers]


_MISSING = object()
_STR_KEYS = frozenset({str})
_FIELDS = {cls: field_table(cls) for cls in MESSAGE_TYPES.values()}
_FIELD_NAMES = {cls: table.names for cls, table in _FIELDS.items()}
_BUILD = {cls: builder(cls) for cls in MESSAGE_TYPES.values()}


# --------------------------------------------------------------------------------------------
# Decoding and validation
# --------------------------------------------------------------------------------------------


def decode_header(frames: Sequence[Any], max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> dict[str, Any]:
    """Check preamble, frame count and header; return the header map (arrays not yet checked)."""
    header = _unpack_header(frames)
    _check_kind(header)
    return header


def _unpack_header(frames: Sequence[Any]) -> dict[str, Any]:
    """Check preamble and frame count, unpack the header; raise unless it is a map (keys unchecked)."""
    if len(frames) < 2:
        raise ProtocolError(f"a message has at least 2 frames (preamble, header), got {len(frames)}")
    if len(frames) > MAX_ARRAYS + 2:
        raise ProtocolError(f"too many frames: {len(frames)} > {MAX_ARRAYS + 2}")
    first = frames[0]
    if not (
        type(first) is bytes
        and first == PREAMBLE
        or type(first) is ZmqFrame
        and len(first) == len(PREAMBLE)
        and first.bytes == PREAMBLE
    ):
        check_preamble(first)
    raw = frames[1]
    if type(raw) is not bytes and type(raw) is not ZmqFrame:  # those two msgpack reads as they are
        raw = flat_buffer(raw)
    if len(raw) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {len(raw)} bytes exceeds the {MAX_HEADER_BYTES}-byte limit")
    try:
        header = msgpack.unpackb(raw, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises a zoo of types on garbage
        raise ProtocolError(f"header is not valid msgpack: {exc}") from None
    if type(header) is not dict:
        raise ProtocolError(f"header must be a msgpack map, got {type(header).__name__}")
    return header


def _check_kind(header: dict[str, Any]) -> type[Message]:
    """The message class of an unpacked header; raises unless every key is a string and the kind known."""
    if not _STR_KEYS.issuperset(map(type, header)):
        key = next(k for k in header if type(k) is not str)
        raise ProtocolError(f"header keys must be strings, got {key!r}")
    kind = header.get("kind")
    if type(kind) is not str or kind not in MESSAGE_TYPES:
        raise ProtocolError(f"unknown message kind {kind!r}")
    return MESSAGE_TYPES[kind]


def _read(
    frames: Sequence[Any], max_message_bytes: int, views: bool, expect: type[Message] | None = None
) -> tuple[type[Message], dict[str, Any]]:
    """``(class, fields)`` of a message (of class ``expect`` if given); raises ProtocolError on any defect.

    The usual message (every field present with its sender's type) goes through its class's generated
    reader (fields.fast_reader); anything else, and every error, through the generic checks.
    """
    header = _unpack_header(frames)
    kind = header.get("kind")
    cls = MESSAGE_TYPES.get(kind) if type(kind) is str else None
    fields = None
    if cls is not None and (expect is None or cls is expect):
        fields = _FAST[cls](header, frames, max_message_bytes, views)
    if fields is None:
        cls = _check_kind(header)
        if expect is not None and cls is not expect:
            raise ProtocolError(f"a {cls.KIND} message is not a {expect.KIND}")
        fields = _fields(cls, header, frames, max_message_bytes, views)
    return cls, fields  # type: ignore[return-value]  # a class on both paths: the fast one or _check_kind


def _fields(
    cls: type[Message], header: dict[str, Any], frames: Sequence[Any], max_message_bytes: int, views: bool
) -> dict[str, Any]:
    """Every field of ``cls`` from a checked ``header`` (defaults filled in); raises on any defect.

    ``arrays`` becomes views over the frames if ``views``, else stays the header's (checked) specs.
    The header is not modified.
    """
    fields: dict[str, Any] = {}
    present = 1  # "kind"
    for name, check, default in _FIELDS[cls].rows:
        value = header.get(name, _MISSING)
        if value is _MISSING:
            if default is None:
                raise ProtocolError(f"{cls.KIND}: missing field {name!r}")
            fields[name] = default()
            continue
        present += 1
        if check is None:
            fields[name] = check_arrays(value, frames[2:], max_message_bytes, views, _LAYOUT_RULES.get(cls))
        elif type(value) is check or (type(check) is not type and check(value)):
            fields[name] = value
        else:
            raise ProtocolError(f"{cls.KIND}: field {name!r} has the wrong type ({type(value).__name__})")
    if not cls.HAS_ARRAYS and len(frames) > 2:
        raise ProtocolError(f"{cls.KIND} carries no arrays, got {len(frames) - 2} extra frames")
    if len(header) > present:  # keys that are neither "kind" nor a field
        unknown = sorted(set(header) - {"kind", *_FIELD_NAMES[cls]})
        raise ProtocolError(f"{cls.KIND}: unknown fields {unknown}")
    check = _CHECKS.get(cls)
    if check is not None:
        check(fields)
    return fields


def decode(frames: Sequence[Any], max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> Message:
    """Validate ``frames`` and build the message. Raises :class:`ProtocolError` on any defect.

    Array values are views over the frames (zero-copy, no copy is made): they share the frames'
    memory, so copy them before mutating or before the frames' buffers are reused.
    """
    cls, fields = _read(frames, max_message_bytes, True)
    return _BUILD[cls](fields)


def validate_trajectory(frames: Sequence[Any], max_message_bytes: int) -> dict[str, Any]:
    """Check a trajectory exactly as :func:`decode` does, without building arrays or the message.

    For a forwarder, which passes the frames on untouched: raises :class:`ProtocolError` wherever
    decode would (and for any other kind), and otherwise returns the header map: ``kind`` and every
    Trajectory field (defaults filled in), with ``arrays`` the checked ``[name, dtype, shape]`` specs
    (the layout cache's own list: read it, do not modify it).
    """
    return {"kind": Trajectory.KIND, **_read(frames, max_message_bytes, False, Trajectory)[1]}


def claimed_peer_id(frames: Sequence[Any]) -> str | None:
    """The ``peer_id`` a message can be attributed to, whatever else is wrong with it; else None.

    For accounting only, once a message has failed its checks (docs/protocol.md section 8): the broker
    charges a malformed trajectory to the actor it names and returns that actor's credit (the actor would
    otherwise stall with the credit lost). A message names ``peer_id`` when it has at least 2 frames,
    frame 0 starts with the signature ``ZDRL`` (any version byte, any length), and frame 1, at most
    MAX_HEADER_BYTES, starts with one complete msgpack map (any bytes may follow it) whose key
    ``"peer_id"`` holds a str. Nothing else of such a header is used or trusted; a str that is not
    valid UTF-8 comes back with its bad bytes escaped (so it names no member).
    """
    if len(frames) < 2:
        return None
    try:
        if bytes(flat_buffer(frames[0])[:4]) != SIGNATURE:
            return None
        raw = frames[1]
        if type(raw) is not bytes and type(raw) is not ZmqFrame:
            raw = flat_buffer(raw)
        if len(raw) > MAX_HEADER_BYTES:
            return None
        try:
            header = msgpack.unpackb(
                raw, raw=False, strict_map_key=False, use_list=False, unicode_errors="surrogateescape"
            )
        except msgpack.ExtraData as extra:  # a whole map, then trailing bytes
            header = extra.unpacked
        peer_id = header.get("peer_id") if type(header) is dict else None
    except Exception:  # noqa: BLE001 - garbage of any kind names no one
        return None
    return peer_id if type(peer_id) is str else None


_CHECKS = {
    Hello: check_hello,
    Welcome: check_welcome,
    Heartbeat: check_heartbeat,
    Parameters: check_params,
    ParamChunk: check_chunk,
    Trajectory: check_trajectory,
    Fleet: check_fleet,
    Subtree: check_subtree,
    ReplaySample: check_replay_sample,
    ReplayBatch: check_replay_batch,
}
_LAYOUT_RULES: dict[type[Message], Callable[[Layout], None]] = {Trajectory: check_trajectory_layout}
_FAST = {
    cls: fast_reader(_FIELDS[cls], check_arrays if cls.HAS_ARRAYS else None, _LAYOUT_RULES.get(cls), _CHECKS.get(cls))
    for cls in MESSAGE_TYPES.values()
}


def split_routed(frames: Sequence[Any]) -> tuple[bytes, Sequence[Any]]:
    """Split a ROUTER-received message into (peer identity, message frames)."""
    if len(frames) < 3:
        raise ProtocolError("routed message lacks an identity frame")
    return bytes(flat_buffer(frames[0])), frames[1:]


def message_nbytes(frames: Sequence[Any]) -> int:
    """Bytes of all frames together (what the counters call 'bytes')."""
    return sum(frame_buffer(f)[1] for f in frames)  # per forwarded message: no memoryview per frame
