"""The byte layer of the zddrl wire protocol: preamble, limits, array dtypes and array frames.

zddrl.protocol defines the messages and re-exports everything public here; import it, not this
module. What lives here is the per-frame and per-array work of ``encode``/``decode``, which is
most of their cost, so it is written for speed: exact-type tests instead of isinstance where the
values come from msgpack, no memoryview per frame when the frame is a flat byte buffer already,
and one numpy call per received array.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping, Sequence
from operator import attrgetter
from typing import Any, NamedTuple

import msgpack
import numpy as np
from zmq import Frame as ZmqFrame

SIGNATURE = b"ZDRL"
PROTOCOL_VERSION = 9
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
DTYPE_NAMES = {dt: name for name, dt in DTYPES.items()}
"""numpy dtype -> wire name. A lookup matches every dtype *equal* to a wire dtype: for the numeric
kinds that is the same type in the same byte order (native "=" counts as "<" on little-endian)."""


class ProtocolError(ValueError):
    """A message that does not follow the protocol. The text says what was wrong."""


def param_hash(buffer: bytes | memoryview | np.ndarray) -> str:
    """Integrity hash of a flat parameter buffer: the first 16 hex digits of the SHA-1 of its wire bytes.

    An array is hashed as it travels (C order, little-endian), so the sender's and the receiver's
    hashes agree whatever the sender's memory layout or byte order.
    """
    if isinstance(buffer, np.ndarray):
        buffer = wire_array(buffer)
    return hashlib.sha1(flat_buffer(buffer)).hexdigest()[:16]


# --------------------------------------------------------------------------------------------
# Frames
# --------------------------------------------------------------------------------------------


def flat_buffer(frame: Any) -> memoryview:
    """The frame's bytes as a flat unsigned-byte view, without copying.

    zmq.Frame (``copy=False``) exposes ``.buffer``; bytes and arrays are buffers already.
    """
    buf = getattr(frame, "buffer", None)
    try:
        view = buf if isinstance(buf, memoryview) else memoryview(frame)
    except (TypeError, ValueError, BufferError):  # ValueError: a numpy array of datetimes, for one
        raise ProtocolError(f"a frame must be a bytes-like buffer, got {type(frame).__name__}") from None
    if view.nbytes == 0:
        return memoryview(b"")
    if not view.c_contiguous:
        raise ProtocolError("a frame must be a C-contiguous buffer")
    return view if view.ndim == 1 and view.format == "B" else view.cast("B")


def frame_buffer(frame: Any) -> tuple[Any, int]:
    """``(buffer, size)``: an object numpy can view the frame's bytes through, and their number.

    What arrives from a socket (zmq.Frame) and what tests and encode hand over (bytes, wire-ready
    arrays) are flat byte buffers already: len/nbytes is their size and they are their own buffer,
    which saves building (and casting) a memoryview per frame. Anything else goes through
    flat_buffer, with its checks.
    """
    kind = type(frame)
    if kind is ZmqFrame or kind is bytes:
        return frame, len(frame)
    if kind is np.ndarray and frame.flags.c_contiguous and frame.dtype in DTYPE_NAMES:
        return frame, frame.nbytes
    view = flat_buffer(frame)
    return view, view.nbytes


def check_preamble(frame: Any) -> None:
    """Raise unless ``frame`` is the preamble. decode_header calls it only for frames other than
    the usual 5-byte bytes or zmq.Frame, which it compares itself."""
    first = flat_buffer(frame)
    head = bytes(first[:8])  # never copy a huge frame
    if head[:4] != SIGNATURE:
        raise ProtocolError(f"bad signature {head!r}: not a zddrl message")
    if first.nbytes != len(PREAMBLE) or head[4] != PROTOCOL_VERSION:
        version = head[4] if len(head) > 4 else None
        raise ProtocolError(
            f"unsupported protocol version {version} in a {first.nbytes}-byte preamble "
            f"(this side speaks {PROTOCOL_VERSION}: preamble {PREAMBLE.hex()})"
        )


# --------------------------------------------------------------------------------------------
# Arrays
# --------------------------------------------------------------------------------------------


def wire_array(array: np.ndarray) -> np.ndarray:
    """The array as it goes on the wire: C-contiguous, little-endian, a whitelisted dtype, same shape.

    Copies only when needed (non-contiguous or big-endian input); 0-d arrays stay 0-d.
    """
    array = np.asarray(array)
    dtype = array.dtype.newbyteorder("<")  # a no-op for "<" and "|"; converts ">" and a big-endian "="
    if dtype not in DTYPE_NAMES or dtype.kind not in "biuf":
        raise ProtocolError(f"dtype {array.dtype} cannot travel; allowed: {', '.join(DTYPES)}")
    if array.ndim > MAX_NDIM:
        raise ProtocolError(f"array of {array.ndim} dimensions cannot travel (at most {MAX_NDIM})")
    # np.ascontiguousarray would turn a 0-d array into shape (1,); np.require keeps the shape.
    return np.require(array, dtype=dtype, requirements="C")


# The header's "arrays" value is a msgpack bin holding the msgpack list of [name, dtype, shape] specs
# (since protocol version 2). Being bytes, a layout can be recognised by a dictionary lookup: a message whose
# layout is byte-identical to one validated before skips the spec checks, and only its frames (count
# and every frame's size) are checked against it. Encoders keep the packed layouts they made, so an
# actor sending rollouts of one shape packs its layout once.

LAYOUT_CACHE_SIZE = 256
"""Layouts kept per process, for decoding and for encoding each. A rollout's layout changes only with its
variable-length arrays (episodes ended, truncations), so a few dozen cover a run. When full, the cache
is emptied at once (a single C call, safe with threads decoding side by side) and refills."""
MAX_CACHED_LAYOUT_BYTES = 8192
"""Longer layouts are validated every time, never kept: a hostile peer cannot fill memory with them."""


class Layout(NamedTuple):
    """A validated array layout: what the frames of a message carrying it must be."""

    specs: list
    """The ``[name, dtype, shape]`` specs as msgpack decoded them (lists). Shared: do not modify."""
    names: tuple
    shapes: tuple
    """Shapes as tuples (numpy builds arrays faster from tuples than from lists)."""
    dtypes: tuple
    sizes: list
    """Bytes of each array frame."""
    claim: int
    """The smallest ``max_message_bytes`` that admits the layout (the summed frame sizes or the largest
    array, zero-size arrays counted by their non-zero dimensions)."""


_DECODED: dict[bytes, Layout] = {}
_RULED: dict[Any, dict[bytes, bool]] = {}
"""Per kind rule: the packed layouts known to follow it."""
_ENCODED: dict[tuple, bytes] = {}
_DTYPE, _SHAPE, _NBYTES = attrgetter("dtype"), attrgetter("shape"), attrgetter("nbytes")
_C_CONTIGUOUS = attrgetter("flags.c_contiguous")
_NDARRAY: Callable[..., np.ndarray] = np.ndarray  # the constructor, typed as the callable that check_arrays maps
_PLAIN_ARRAY = frozenset({np.ndarray})  # exactly ndarray: a subclass goes through wire_array's np.asarray
_WIRE_DTYPES = frozenset(DTYPE_NAMES)
_last_encoded: tuple = ((), b"")
"""(key, packed layout) of the last layout encode_arrays used: compared before any hashing."""
_SOCKET_FRAMES = frozenset({ZmqFrame, bytes})  # what sockets deliver; len() is their size


def forget_layouts() -> None:
    """Empty the layout caches (tests that count layout checks start from nothing)."""
    global _last_encoded
    _DECODED.clear()
    _RULED.clear()
    _ENCODED.clear()
    _last_encoded = ((), b"")


def _remember(cache: dict, key: Any, value: Any) -> None:
    if len(cache) >= LAYOUT_CACHE_SIZE:
        cache.clear()
    cache[key] = value


def encode_arrays(kind: str, arrays: Mapping[str, Any], buffers: list[Any]) -> bytes:
    """The header's ``arrays`` value (the packed layout) of ``arrays``; appends their wire buffers to ``buffers``.

    Arrays an actor builds are wire-ready already (C-contiguous, a wire dtype): they go out as they are,
    checked with one C-level pass per property instead of a Python loop over the arrays. The packed
    layout is looked up by names, dtypes and shapes; only a layout that passed every check is kept, so
    a hit also vouches for the dtypes.
    """
    if len(arrays) > MAX_ARRAYS:
        raise ProtocolError(f"{kind}: {len(arrays)} arrays, at most {MAX_ARRAYS} can travel")
    values = list(arrays.values())
    if not (_PLAIN_ARRAY.issuperset(map(type, values)) and all(map(_C_CONTIGUOUS, values))):
        values = [_wire_ready(v) for v in values]
    key = (tuple(arrays), tuple(map(_DTYPE, values)), tuple(map(_SHAPE, values)))
    last = _last_encoded  # one read: another thread may replace it meanwhile
    if key == last[0]:  # a sender's next message usually has its last one's layout: no hashing
        blob = last[1]
    else:
        blob = _ENCODED.get(key)
        if blob is None:
            if not _WIRE_DTYPES.issuperset(key[1]):  # big-endian or not a wire dtype: convert (or refuse)
                values = [_wire_ready(v) for v in values]
                key = (key[0], tuple(map(_DTYPE, values)), key[2])
            blob = _pack_layout(kind, key)
        _remember_last(key, blob)
    buffers += values
    return blob


def _remember_last(key: tuple, blob: bytes) -> None:
    global _last_encoded
    if len(blob) <= MAX_CACHED_LAYOUT_BYTES and _ENCODED.get(key) is blob:  # only a kept (checked) layout
        _last_encoded = (key, blob)


def _wire_ready(value: Any) -> np.ndarray:
    """``value`` itself if it can travel as it is, else wire_array's copy (or its ProtocolError)."""
    if type(value) is np.ndarray and value.flags.c_contiguous and value.dtype in DTYPE_NAMES:
        return value
    return wire_array(value)


def _pack_layout(kind: str, key: tuple) -> bytes:
    """Check names and ranks (the cache key holds both, so a cached layout was checked) and pack the specs."""
    names, dtypes, shapes = key
    for name, shape in zip(names, shapes):
        if not isinstance(name, str) or not name:
            raise ProtocolError(f"{kind}: array name {name!r} must be a non-empty string")
        if len(shape) > MAX_NDIM:
            raise ProtocolError(f"array of {len(shape)} dimensions cannot travel (at most {MAX_NDIM})")
    # Specs are tuples and shapes numpy's tuples: msgpack packs a tuple exactly as a list.
    blob = msgpack.packb(list(zip(names, map(DTYPE_NAMES.__getitem__, dtypes), shapes)), use_bin_type=True)
    if len(blob) <= MAX_CACHED_LAYOUT_BYTES:
        _remember(_ENCODED, key, blob)
    return blob


def _shape_error(name: str, shape: Any) -> ProtocolError:
    return ProtocolError(f"array {name!r}: shape {shape!r} must be a list of at most {MAX_NDIM} non-negative ints")


def layout_of(blob: Any) -> Layout:
    """The validated layout in the header's ``arrays`` value; raises ProtocolError if it is not one."""
    layout = _DECODED.get(blob) if type(blob) is bytes else None
    if layout is not None:
        return layout
    if type(blob) is not bytes:
        raise ProtocolError("header 'arrays' must be bin: the msgpack encoding of a list of [name, dtype, shape]")
    try:
        specs = msgpack.unpackb(blob, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises a zoo of types on garbage
        raise ProtocolError(f"header 'arrays' is not valid msgpack: {exc}") from None
    layout = _check_specs(specs)
    if len(blob) <= MAX_CACHED_LAYOUT_BYTES:
        _remember(_DECODED, blob, layout)
    return layout


def _follows(rule: Callable[[Layout], None], blob: Any, layout: Layout) -> None:
    """Raise unless ``layout`` follows a kind's ``rule``; a layout that does is remembered (per rule)."""
    passed = _RULED.get(rule)
    if passed is None:
        passed = _RULED[rule] = {}
    if type(blob) is bytes and blob in passed:
        return
    rule(layout)
    if type(blob) is bytes and len(blob) <= MAX_CACHED_LAYOUT_BYTES:
        _remember(passed, blob, True)


def _check_specs(specs: Any) -> Layout:
    """Every check of the specs themselves (names, dtypes, shapes); none of the frames."""
    if type(specs) is not list:
        raise ProtocolError("header 'arrays' must be a list of [name, dtype, shape]")
    if len(specs) > MAX_ARRAYS:
        raise ProtocolError(f"header names {len(specs)} arrays, at most {MAX_ARRAYS} can travel")
    names: dict[str, None] = {}  # len(names) is the index of the spec at hand
    shapes, dtypes, sizes = [], [], []
    claim = 0
    for spec in specs:
        if type(spec) is not list or len(spec) != 3:
            raise ProtocolError(f"array spec {len(names)} must be [name, dtype, shape]")
        name, dtype_name, shape = spec
        if type(name) is not str or not name:
            raise ProtocolError(f"array spec {len(names)}: name {name!r} must be a non-empty string")
        if name in names:
            raise ProtocolError(f"array spec {len(names)}: duplicate array name {name!r}")
        dtype = DTYPES.get(dtype_name) if type(dtype_name) is str else None
        if dtype is None:
            raise ProtocolError(f"array {name!r}: dtype {dtype_name!r} is not allowed; allowed: {', '.join(DTYPES)}")
        if type(shape) is not list or len(shape) > MAX_NDIM:
            raise _shape_error(name, shape)
        for d in shape:
            if type(d) is not int or d < 0:
                raise _shape_error(name, shape)
        names[name] = None
        shapes.append(tuple(shape))
        dtypes.append(dtype)
        sizes.append(math.prod(shape) * dtype.itemsize)
        # Zero-size arrays may have huge other dimensions; numpy (and sanity) cannot hold those.
        claim = max(claim, sizes[-1] or math.prod([d for d in shape if d]) * dtype.itemsize)
    return Layout(specs, tuple(names), tuple(shapes), tuple(dtypes), sizes, max(claim, sum(sizes)))


def _limit_error(layout: Layout, max_message_bytes: int) -> ProtocolError:
    """The error of a layout whose ``claim`` exceeds ``max_message_bytes``: the first array too large, else the sum."""
    for (name, _, shape), dtype in zip(layout.specs, layout.dtypes):
        if math.prod([d for d in shape if d]) * dtype.itemsize > max_message_bytes:
            return ProtocolError(f"array {name!r}: shape {shape} is too large for the {max_message_bytes}-byte limit")
    return ProtocolError(f"message arrays exceed the {max_message_bytes}-byte limit")


def _frame_sizes(frames: Sequence[Any]) -> tuple[Sequence[Any], list[int]]:
    """``(buffers, sizes)`` of the array frames: objects numpy can view them through, and their bytes.

    A socket's frames (all zmq.Frame, or all bytes) and encode's arrays (all wire-ready ndarrays) are
    read with one C-level pass each; any other mix goes frame by frame through frame_buffer's checks.
    """
    if _SOCKET_FRAMES.issuperset(map(type, frames)):
        return frames, list(map(len, frames))
    if (
        _PLAIN_ARRAY.issuperset(map(type, frames))
        and all(map(_C_CONTIGUOUS, frames))
        and _WIRE_DTYPES.issuperset(map(_DTYPE, frames))
    ):
        return frames, list(map(_NBYTES, frames))
    pairs = [frame_buffer(f) for f in frames]
    return [buffer for buffer, _ in pairs], [size for _, size in pairs]


def check_arrays(
    blob: Any, frames: Sequence[Any], max_message_bytes: int, views: bool, rule: Callable[[Layout], None] | None = None
) -> Any:
    """Check the header's ``arrays`` value (a packed layout) against the array frames.

    Returns the arrays as zero-copy views over the frames if ``views``, else the layout's specs. The
    layout's own checks run once per distinct layout (layout_of), and so do a kind's ``rule`` (which
    arrays, dtypes, shapes; it raises ProtocolError) after the frames; the frames are checked every time.
    """
    layout = _DECODED.get(blob) if type(blob) is bytes else None
    if layout is None:
        layout = layout_of(blob)
    if layout.claim > max_message_bytes:
        raise _limit_error(layout, max_message_bytes)
    sizes = layout.sizes
    if len(frames) != len(sizes):
        raise ProtocolError(f"header names {len(sizes)} arrays but {len(frames)} array frames follow")
    buffers, got = _frame_sizes(frames)
    if got != sizes:
        i = next(i for i, (a, b) in enumerate(zip(got, sizes)) if a != b)
        name, dtype_name, shape = layout.specs[i]
        raise ProtocolError(f"array {name!r}: shape {shape} x {dtype_name} needs {sizes[i]} bytes, frame has {got[i]}")
    if rule is not None:  # the kind's own rules, once the frames are known to fit the layout
        _follows(rule, blob, layout)
    if not views:
        return layout.specs
    # np.ndarray over a buffer is np.frombuffer(buffer, dtype).reshape(shape) in one call.
    return dict(zip(layout.names, map(_NDARRAY, layout.shapes, layout.dtypes, buffers)))
