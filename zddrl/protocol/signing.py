"""What a learner signs, and how a receiver checks it (docs/protocol.md section 5.7).

A learner signs every parameter version and the run spec it announces, with its Ed25519 key
(zddrl.keys). The signature covers a canonical byte string defined here once, for signer and
verifier alike: the msgpack array of a domain tag and the fields, in a fixed order, with every map
turned into a key-sorted list of pairs (so that a map's order on the wire cannot change the bytes).

A version's payload covers everything of its params message but the buffers themselves: run,
version, signer, precision, sizes, the whole-buffer hash, every chunk hash, layout, meta, and each
beside-chunk-0 array's name, dtype, shape and hash. The hashes bind the buffers, and every receiver
checks every chunk against them (transport.params), so one signature per version vouches for all of
its bytes without hashing them again. Re-stamping a version, moving it to another run, or
reattributing it to another key all change the payload. A run's payload covers the run id, the
signer and the spec.

This module only builds the payloads (the protocol stays below the keys); signing and checking them, with
the ``cryptography`` package's Ed25519 through zddrl.keys, is zddrl.transport.signatures.
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np

from zddrl.protocol.frames import PROTOCOL_VERSION, param_hash, wire_array
from zddrl.protocol.messages import Parameters

PARAMS_TAG = f"zddrl-params-v{PROTOCOL_VERSION}"
RUN_TAG = f"zddrl-run-v{PROTOCOL_VERSION}"
"""Domain tags: a run signature is never a valid version signature, nor one of another protocol version."""


def canonical(value: Any) -> Any:
    """``value`` with every map a key-sorted list of ``[key, value]`` pairs and numpy values as plain ones."""
    if isinstance(value, dict):
        return [[k, canonical(value[k])] for k in sorted(value)]
    if isinstance(value, (list, tuple)):
        return [canonical(v) for v in value]
    if isinstance(value, (np.generic, np.ndarray)):
        return canonical(value.tolist())
    return value


def _pack(fields: list[Any]) -> bytes:
    return msgpack.packb(fields, use_bin_type=True)


def params_payload(head: Parameters, signer: str) -> bytes:
    """The bytes ``signer`` signs for the version ``head`` (a params message) announces."""
    beside = sorted(
        [name, wire_array(array).dtype.name, list(np.shape(array)), param_hash(array)]
        for name, array in head.arrays.items()
        if name != "flat"
    )
    return _pack(
        [
            PARAMS_TAG,
            head.run_id,
            head.policy_version,
            signer,
            head.param_dtype,
            head.numel,
            head.chunk_numel,
            head.param_hash,
            list(head.chunk_hashes),
            canonical(head.layout),
            canonical(head.meta),
            beside,
        ]
    )


def run_payload(run_id: str, run: dict | None, signer: str) -> bytes:
    """The bytes ``signer`` signs for announcing run ``run_id`` with spec ``run``."""
    return _pack([RUN_TAG, run_id, signer, canonical(run)])
