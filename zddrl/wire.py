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
from typing import Any, Mapping, Sequence

import numpy as np
import zmq
from zmq import Frame as ZmqFrame

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
        raise ProtocolError(f"unsupported protocol version {version} in a {first.nbytes}-byte preamble "
                            f"(this side speaks {PROTOCOL_VERSION}: preamble {PREAMBLE.hex()})")


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


def encode_arrays(kind: str, arrays: Mapping[str, Any], buffers: list[Any]) -> list[tuple[Any, ...]]:
    """The header's ``[name, dtype, shape]`` specs of ``arrays``; appends their wire buffers to ``buffers``.

    Specs are tuples and shapes numpy's tuples: msgpack packs a tuple exactly as a list, so the
    bytes are the same without building two lists per array.
    """
    if len(arrays) > MAX_ARRAYS:
        raise ProtocolError(f"{kind}: {len(arrays)} arrays, at most {MAX_ARRAYS} can travel")
    specs = []
    for name, array in arrays.items():
        if not isinstance(name, str) or not name:
            raise ProtocolError(f"{kind}: array name {name!r} must be a non-empty string")
        # The arrays an actor builds are wire-ready already (C-contiguous, a wire dtype), and then
        # wire_array returns them unchanged: skip its np.asarray/np.require (most of encode's cost).
        dtype_name = None
        if type(array) is np.ndarray and array.flags.c_contiguous and array.ndim <= MAX_NDIM:
            dtype_name = DTYPE_NAMES.get(array.dtype)
        if dtype_name is None:
            array = wire_array(array)
            dtype_name = DTYPE_NAMES[array.dtype]
        specs.append((name, dtype_name, array.shape))
        buffers.append(array)
    return specs


def _shape_error(name: str, shape: Any) -> ProtocolError:
    return ProtocolError(f"array {name!r}: shape {shape!r} must be a list of at most {MAX_NDIM} non-negative ints")


def check_arrays(specs: Any, frames: Sequence[Any], max_message_bytes: int, views: bool) -> Any:
    """Check the header's array specs (a value msgpack made) against the array frames.

    Returns the arrays as zero-copy views over the frames if ``views``, else ``specs`` unchanged.
    This loop is most of decode's cost: each check is written out in line, and type tests are
    exact (msgpack makes exact built-in types, so ``type(d) is int`` is "int and not bool").
    """
    if not isinstance(specs, list):
        raise ProtocolError("header 'arrays' must be a list of [name, dtype, shape]")
    if len(specs) != len(frames):
        raise ProtocolError(f"header names {len(specs)} arrays but {len(frames)} array frames follow")
    arrays: dict[str, Any] = {}  # len(arrays) is the index of the spec at hand
    total = 0
    for spec, frame in zip(specs, frames):
        if type(spec) is not list or len(spec) != 3:
            raise ProtocolError(f"array spec {len(arrays)} must be [name, dtype, shape]")
        name, dtype_name, shape = spec
        if type(name) is not str or not name:
            raise ProtocolError(f"array spec {len(arrays)}: name {name!r} must be a non-empty string")
        if name in arrays:
            raise ProtocolError(f"array spec {len(arrays)}: duplicate array name {name!r}")
        dtype = DTYPES.get(dtype_name) if type(dtype_name) is str else None
        if dtype is None:
            raise ProtocolError(f"array {name!r}: dtype {dtype_name!r} is not allowed; allowed: {', '.join(DTYPES)}")
        if type(shape) is not list or len(shape) > MAX_NDIM:
            raise _shape_error(name, shape)
        for d in shape:
            if type(d) is not int or d < 0:
                raise _shape_error(name, shape)
        expected = math.prod(shape) * dtype.itemsize
        # Zero-size arrays may have huge other dimensions; numpy (and sanity) cannot hold those.
        if (expected or math.prod([d for d in shape if d]) * dtype.itemsize) > max_message_bytes:
            raise ProtocolError(f"array {name!r}: shape {shape} is too large for the {max_message_bytes}-byte "
                                "limit")
        if type(frame) is ZmqFrame or type(frame) is bytes:  # frame_buffer's first case, in line
            size = len(frame)
        else:
            frame, size = frame_buffer(frame)
        if expected != size:
            raise ProtocolError(f"array {name!r}: shape {shape} x {dtype_name} needs {expected} bytes, "
                                f"frame has {size}")
        total += expected
        if total > max_message_bytes:
            raise ProtocolError(f"message arrays exceed the {max_message_bytes}-byte limit")
        # np.ndarray over the buffer is np.frombuffer(buffer, dtype).reshape(shape) in one call.
        arrays[name] = np.ndarray(shape, dtype, frame) if views else None
    return arrays if views else specs


# Socket helpers for hot paths (the broker's forwarding loop).
_SNDMORE = int(zmq.SNDMORE)  # plain ints: pyzmq builds enum objects per call otherwise (hot path)
NOBLOCK = int(zmq.NOBLOCK)


def recv_frames(sock: zmq.Socket, flags: int = 0) -> list[zmq.Frame]:
    """``recv_multipart(copy=False)`` without its per-frame getsockopt: ~3x cheaper per message."""
    frame = sock.recv(flags, copy=False)
    frames = [frame]
    while frame.more:
        frame = sock.recv(0, copy=False)
        frames.append(frame)
    return frames


def send_frames(sock: zmq.Socket, frames: Sequence[Any], flags: int = 0) -> None:
    """``send_multipart(copy=False)`` with int flags (the forwarding hot path)."""
    last = len(frames) - 1
    for i, frame in enumerate(frames):
        sock.send(frame, flags | _SNDMORE if i < last else flags, copy=False)
