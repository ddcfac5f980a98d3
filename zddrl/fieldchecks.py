"""What ``zddrl.protocol.decode`` checks of a message's fields beyond their types: the rules of each kind.

Part of the protocol's definition (docs/protocol.md sections 2.4 and 6); zddrl.protocol runs these
after the generic header checks and re-exports the constants. Each raises ``ProtocolError`` with the
reason.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from .wire import DTYPES, MAX_NDIM, ProtocolError

PARAM_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "uint16"}
"""Parameter transport precision -> the wire dtype of its buffers (bfloat16: the upper 16 bits of each
IEEE float32, carried as uint16, since the wire has no bfloat16 dtype)."""
MAX_PARAM_CHUNKS = 1 << 20


def _is_int(value: Any, lo: int, hi: int | None = None) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= lo and (hi is None or value <= hi)


def _shape_ok(shape: Any) -> bool:
    return isinstance(shape, list) and len(shape) <= MAX_NDIM and all(_is_int(d, 0) for d in shape)


def check_welcome(fields: dict[str, Any]) -> None:
    for name, port in fields["ports"].items():
        if not _is_int(port, 1, 65535):
            raise ProtocolError(f"welcome: port {name!r} must be an int in 1..65535, got {port!r}")
    if fields["heartbeat_interval_s"] <= 0:
        raise ProtocolError(f"welcome: heartbeat_interval_s must be > 0, got {fields['heartbeat_interval_s']}")
    if fields["heartbeat_liveness"] < 1:
        raise ProtocolError(f"welcome: heartbeat_liveness must be >= 1, got {fields['heartbeat_liveness']}")
    if fields["max_message_bytes"] < 0:
        raise ProtocolError(f"welcome: max_message_bytes must be >= 0, got {fields['max_message_bytes']}")


def check_params(fields: dict[str, Any]) -> None:
    """Chunking fields agree with each other and with chunk 0; layout rows ``[name, dtype, shape,
    offset]`` are well formed and fit the whole buffer."""
    flat = fields["arrays"].get("flat")
    if flat is not None and flat.ndim != 1:
        raise ProtocolError(f"params: array 'flat' must be 1-d, got shape {list(flat.shape)}")
    numel = _check_chunking(fields, flat)
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
        if numel is not None and offset + math.prod(shape) > numel:
            raise ProtocolError(f"params: layout row {name!r} (offset {offset}, shape {shape}) does not fit "
                                f"the flat buffer of {numel} elements")


def _hash_ok(value: Any) -> bool:
    return type(value) is str and len(value) == 16 and all(c in "0123456789abcdef" for c in value)


def _check_chunking(fields: dict[str, Any], flat: np.ndarray | None) -> int | None:
    """The whole buffer's element count (None if unknown: no flat buffer, no chunk table)."""
    dtype, hashes, numel, per = (fields["param_dtype"], fields["chunk_hashes"], fields["numel"],
                                 fields["chunk_numel"])
    if dtype not in PARAM_DTYPES:
        raise ProtocolError(f"params: param_dtype {dtype!r} is not one of {sorted(PARAM_DTYPES)}")
    if flat is not None and flat.dtype != DTYPES[PARAM_DTYPES[dtype]]:
        raise ProtocolError(f"params: 'flat' must be {PARAM_DTYPES[dtype]} for param_dtype {dtype}, got {flat.dtype}")
    if numel < 0 or per < 0:
        raise ProtocolError(f"params: numel ({numel}) and chunk_numel ({per}) must be >= 0")
    if not hashes:
        if numel and (flat is None or numel != flat.size):
            raise ProtocolError(f"params: numel {numel} without chunk_hashes must be the size of 'flat'")
        return flat.size if flat is not None else None
    if not 1 <= len(hashes) <= MAX_PARAM_CHUNKS or not all(_hash_ok(h) for h in hashes):
        raise ProtocolError(f"params: chunk_hashes must be 1..{MAX_PARAM_CHUNKS} hashes of 16 hex digits")
    if numel < 1 or per < 1 or len(hashes) != -(-numel // per):
        raise ProtocolError(f"params: {len(hashes)} chunk hashes do not fit numel {numel} in chunks of {per}")
    if flat is None or flat.size != min(per, numel):
        raise ProtocolError(f"params: 'flat' must be chunk 0 ({min(per, numel)} elements)")
    if len(hashes) == 1 and fields["param_hash"] != hashes[0]:
        raise ProtocolError("params: with one chunk, param_hash must be chunk_hashes[0] (both hash the whole buffer)")
    return numel


def check_chunk(fields: dict[str, Any]) -> None:
    arrays = fields["arrays"]
    if set(arrays) != {"data"} or arrays["data"].ndim != 1:
        raise ProtocolError("params_chunk: must carry exactly one 1-d array, 'data'")
    if not 1 <= fields["index"] < MAX_PARAM_CHUNKS:
        raise ProtocolError(f"params_chunk: index {fields['index']} must be in 1..{MAX_PARAM_CHUNKS - 1}")
    if not _hash_ok(fields["chunk_hash"]):
        raise ProtocolError("params_chunk: chunk_hash must be 16 hex digits")
