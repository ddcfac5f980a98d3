"""Parameters in transit: one version cut into bounded, hashed chunks, and put back together.

The learner publishes a version as a ``Parameters`` message (layout, hashes, chunk 0) followed by
``ParamChunk`` messages (chunks 1..). Receivers (actors; the broker, for the copy it gives late
joiners) may see the messages of two versions interleaved, a chunk twice, a chunk lost, or a
corrupted one. ``Assembler`` turns that stream into whole versions: a version comes out only once
every chunk has arrived and matched its hash and the whole buffer matched the version's hash, so
an actor can never act with a mix of two versions.

Transport precision (``param_dtype``): float32, float16, or bfloat16 (the upper half of each
float32, carried as uint16; rounding to nearest even). Receivers always get float32 back.
"""

from __future__ import annotations

import hashlib
import os
from collections import Counter
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from zddrl import protocol as P
from zddrl.transport import signatures as signing

MAX_PENDING_VERSIONS = 2
"""Versions an assembler builds at once; a newer one pushes the oldest out (latest wins anyway)."""

Verify = Callable[[P.Parameters], str]
"""Why a version's params message must not be used (its signature: protocol.signing.params_refusal), or ""."""


def to_transport(flat: np.ndarray, dtype: str) -> np.ndarray:
    """float32 ``[n]`` -> the wire buffer of ``dtype`` (a new array unless float32)."""
    flat = np.ascontiguousarray(flat, dtype=np.float32)
    if dtype == "float32":
        return flat
    if dtype == "float16":
        return flat.astype(np.float16)
    if dtype == "bfloat16":
        bits = flat.view(np.uint32)
        rounded = bits >> 16  # in place from here on: one buffer, no temporaries of the model's size
        rounded &= 1
        rounded += np.uint32(0x7FFF)
        rounded += bits  # + 0x7FFF + lowest kept bit: round to nearest, ties to even
        rounded >>= 16
        out = rounded.astype(np.uint16)
        nan = np.isnan(flat)
        if nan.any():  # a NaN whose payload sits in the low half would round to infinity: keep it NaN
            out[nan] = (bits[nan] >> 16).astype(np.uint16) | np.uint16(0x40)
        return out
    raise ValueError(f"unknown param_dtype {dtype!r}")


def from_transport(buf: np.ndarray, dtype: str) -> np.ndarray:
    """The wire buffer of ``dtype`` -> float32 ``[n]``."""
    if dtype == "bfloat16":
        return (buf.astype(np.uint32) << 16).view(np.float32)
    return np.asarray(buf, dtype=np.float32)


def split(
    *,
    run_id: str,
    peer_id: str,
    version: int,
    flat: np.ndarray,
    layout: list,
    extras: Mapping[str, np.ndarray] | None = None,
    meta: dict | None = None,
    chunk_bytes: int = 4 << 20,
    dtype: str = "float32",
    signer: signing.Signer | None = None,
) -> list[P.Message]:
    """The messages that publish one version: ``Parameters`` (chunk 0) then a ``ParamChunk`` per
    further chunk of at most ``chunk_bytes``. ``param_hash`` of the first is the version's hash;
    with a ``signer`` (name, Ed25519 key) the first carries its signature of the version."""
    wire = to_transport(flat, dtype)
    per = max(1, chunk_bytes // wire.itemsize)
    pieces = [wire[i : i + per] for i in range(0, max(wire.size, 1), per)]
    if len(pieces) == 1:
        hashes = [P.param_hash(wire)]
        whole = hashes[0]
    else:  # hashlib lets go of the GIL on big buffers: the whole-buffer hash runs beside the chunks'
        pool = _hash_pool()
        whole_future = pool.submit(P.param_hash, wire)
        hashes = list(pool.map(P.param_hash, pieces))
        whole = whole_future.result()
    first = P.Parameters(
        run_id=run_id,
        peer_id=peer_id,
        policy_version=version,
        param_hash=whole,
        layout=layout,
        arrays={"flat": pieces[0], **(extras or {})},
        meta=meta or {},
        param_dtype=dtype,
        numel=wire.size,
        chunk_numel=per,
        chunk_hashes=hashes,
    )
    if signer is not None:
        first = signing.signed_params(first, signer)
    return [
        first,
        *(
            P.ParamChunk(
                run_id=run_id,
                peer_id=peer_id,
                policy_version=version,
                param_hash=whole,
                index=i,
                chunk_hash=hashes[i],
                arrays={"data": pieces[i]},
            )
            for i in range(1, len(pieces))
        ),
    ]


_POOL: ThreadPoolExecutor | None = None


def _hash_pool() -> ThreadPoolExecutor:
    """Threads for the publisher's hashing (a learner has cores to spare while it publishes)."""
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=max(2, min(8, os.cpu_count() or 2)), thread_name_prefix="zddrl-hash")
    return _POOL


@dataclass
class _Build:
    """A version being put together."""

    head: P.Parameters
    buffer: np.ndarray
    missing: set[int]
    extras: dict[str, np.ndarray] = field(default_factory=dict)
    whole: Any = field(default_factory=hashlib.sha1)
    """SHA-1 of the buffer so far, fed chunk by chunk in order as they arrive (usually in order),
    so that the whole-buffer check at the end costs nothing more than the last chunk's share."""
    hashed: int = 0
    """Chunks fed to ``whole``: 0..hashed-1."""

    def feed(self) -> None:
        per = self.head.chunk_numel or self.buffer.size
        while self.hashed < self.head.num_chunks and self.hashed not in self.missing:
            self.whole.update(self.buffer[self.hashed * per : (self.hashed + 1) * per])
            self.hashed += 1


class Assembler:
    """``add(message) -> Parameters | None``: a whole, verified float32 version when one completes.

    Versions only move forward: once version v came out, nothing of v or older is used again (within
    a run: a message of another run starts afresh, since versions restart with every run).
    ``rejected`` counts what was refused, by reason (``chunk_hash``, ``whole_hash``, ``bad_chunk``,
    ``orphan_chunk``, ``old``, ``signature``). With ``verify``, a version whose params message it refuses
    is never started (``refusal`` keeps the last reason), so only versions it vouches for come out.
    """

    def __init__(self, max_pending: int = MAX_PENDING_VERSIONS, verify: Verify | None = None) -> None:
        self.max_pending = max_pending
        self.verify = verify
        self.refusal = ""
        self.run_id: str | None = None
        self.policy_version = -1
        self.building: dict[tuple[int, str], _Build] = {}
        self.rejected: Counter[str] = Counter()

    def add(self, msg: P.Parameters | P.ParamChunk) -> P.Parameters | None:
        if msg.run_id != self.run_id:  # a new run: versions start again
            self.run_id, self.policy_version = msg.run_id, -1
            self.building.clear()
        if msg.policy_version <= self.policy_version:
            self.rejected["old"] += 1
            return None
        key = (msg.policy_version, msg.param_hash)
        if isinstance(msg, P.Parameters):
            if key not in self.building and not self._start(key, msg):
                return None
        else:
            build = self.building.get(key)
            if build is None:  # its Parameters message was lost or is yet to come: a later copy completes it
                self.rejected["orphan_chunk"] += 1
                return None
            self._fill(build, msg.index, msg.arrays["data"], msg.chunk_hash)
        return self._finish(key)

    def _start(self, key: tuple[int, str], head: P.Parameters) -> bool:
        if self.verify is not None:
            why = self.verify(head)
            if why:
                self.rejected["signature"] += 1
                self.refusal = why
                return False
        flat = head.arrays["flat"]
        hashes = head.chunk_hashes or [head.param_hash]
        numel = head.numel or flat.size
        if P.param_hash(flat) != hashes[0]:
            self.rejected["chunk_hash"] += 1
            return False
        while len(self.building) >= self.max_pending:  # the oldest gives way
            del self.building[min(self.building)]
        buffer = np.empty(numel, dtype=flat.dtype)
        buffer[: flat.size] = flat
        extras = {k: np.array(v) for k, v in head.arrays.items() if k != "flat"}  # own copies: frames get reused
        self.building[key] = build = _Build(head, buffer, set(range(1, len(hashes))), extras)
        build.hashed = 1  # chunk 0 was just checked against its own hash: for one chunk, that is the whole
        if len(hashes) > 1:
            build.whole.update(flat)
        return True

    def _fill(self, build: _Build, index: int, data: np.ndarray, chunk_hash: str) -> None:
        head = build.head
        if index >= head.num_chunks:
            self.rejected["bad_chunk"] += 1
            return
        if index not in build.missing:
            return  # a second copy of a chunk already in place (a resend)
        start = index * head.chunk_numel
        if data.dtype != build.buffer.dtype or data.size != min(head.chunk_numel, build.buffer.size - start):
            self.rejected["bad_chunk"] += 1
            return
        if chunk_hash != head.chunk_hashes[index] or P.param_hash(data) != chunk_hash:
            self.rejected["chunk_hash"] += 1
            return
        build.buffer[start : start + data.size] = data
        build.missing.discard(index)
        build.feed()

    def _finish(self, key: tuple[int, str]) -> P.Parameters | None:
        build = self.building[key] if key in self.building else None
        if build is None or build.missing:
            return None
        del self.building[key]
        head = build.head
        if head.num_chunks > 1 and build.whole.hexdigest()[:16] != head.param_hash:
            self.rejected["whole_hash"] += 1
            return None
        self.policy_version = head.policy_version
        for older in [k for k in self.building if k[0] <= head.policy_version]:
            del self.building[older]
        flat = from_transport(build.buffer, head.param_dtype)
        return P.Parameters(
            run_id=head.run_id,
            peer_id=head.peer_id,
            policy_version=head.policy_version,
            param_hash=head.param_hash,
            layout=head.layout,
            arrays={"flat": flat, **build.extras},
            meta=head.meta,
            param_dtype="float32",
            numel=flat.size,
            signer=head.signer,
        )


class _Pending:
    """A version the broker is receiving: its messages' frames and checked data, chunk by chunk."""

    def __init__(self, head: P.Parameters, flat: np.ndarray, frames: list) -> None:
        self.head = head
        self.key = (head.policy_version, head.param_hash)
        self.dtype = flat.dtype
        self.missing = set(range(1, head.num_chunks))
        self.parts: dict[int, tuple[np.ndarray, list]] = {0: (flat, frames)}
        self.whole = hashlib.sha1() if head.num_chunks > 1 else None
        """SHA-1 of chunks 0..fed-1, fed in order as they become contiguous, each when the next message comes
        (after the broker published the chunk: the whole-buffer pass is not on its way out)."""
        self.fed = 0

    def add(self, index: int, data: np.ndarray, frames: list) -> None:
        self.parts[index] = (data, frames)
        self.missing.discard(index)

    def feed(self) -> None:
        if self.whole is not None:
            while self.fed in self.parts:
                self.whole.update(self.parts[self.fed][0].data)
                self.fed += 1

    def whole_hash_ok(self) -> bool:
        """One chunk: it was checked against param_hash itself. Several: their concatenation hashes to it."""
        self.feed()
        return self.whole is None or self.whole.hexdigest()[:16] == self.head.param_hash

    def messages(self) -> list[list]:
        return [self.parts[i][1] for i in range(self.head.num_chunks)]


class FrameCache:
    """The broker's copy of the newest whole, verified version, kept as the frames of its messages.

    ``add(message, frames)`` checks one message and says what it is to the cache:

    * ``"building"``: a message of the version being received that passed its own checks; it can go
      out now (it does not complete the version, so no receiver can use the version yet);
    * ``"complete"``: the message that completed that version, and the whole version passed every
      hash check: it is now the cached one (``messages``), and this message can go out;

    or why it is refused (the message must not go out):

    * ``"repeat"``: the cached version itself (same version and hash) sent again: a learner re-publishes its
      current version after every re-welcome, which a restarted broker needs and this one already has;
    * ``"stale"``: older than the cached version, or the same version with another hash;
    * ``"signature"``: a params message that ``verify`` refuses (``refusal`` says why): unsigned, signed by a
      key not pinned, or a signature that does not verify;
    * ``"duplicate"``: the params message of the version being received again, or a chunk of it
      already in;
    * ``"orphan_chunk"``: a chunk of no version being received (same ``policy_version`` and ``param_hash``);
    * ``"bad_chunk"``: a params message without ``flat``, or a chunk whose index is past the version's
      chunk table, or whose size or dtype is not what the table says;
    * ``"chunk_hash"``: data that does not hash to its chunk's entry in the version's table (for the
      params message: ``flat`` against ``chunk_hashes[0]``, or ``param_hash`` when unchunked; for a chunk:
      its ``chunk_hash`` is not ``chunk_hashes[index]``, or its data does not hash to it). The message is
      dropped; the version waits for a good copy or is superseded;
    * ``"whole_hash"``: the message would complete the version, but the concatenation of the chunks does
      not hash to ``param_hash``: the whole version is dropped, and with it this last message, so no
      receiver can put the version together.

    Nothing that failed a check is ever kept or goes out, so the cached version stays the last good one.
    A params message of a newer version (or the same version with another hash) replaces one still
    incomplete: ``abandoned`` counts those. Each chunk is hashed once against its entry and fed, in
    order, into the whole-buffer hash: a version costs two SHA-1 passes over its bytes (one if unchunked).
    """

    def __init__(self, verify: Verify | None = None) -> None:
        self.verify = verify
        self.refusal = ""
        """Why ``verify`` refused the last params message it refused."""
        self.version = -1
        self.param_hash = ""
        self.messages: list[list] = []
        """Frames of each message of the cached version, params first, then chunks 1, 2, ... (what is published
        and what a late joiner gets)."""
        self.abandoned = 0
        """Versions dropped before all their messages came (replaced by a newer params message)."""
        self._building: _Pending | None = None

    @property
    def building(self) -> bool:
        """A version is being received."""
        return self._building is not None

    def add(self, msg: P.Parameters | P.ParamChunk, frames: list) -> str:
        if msg.policy_version <= self.version:
            return "repeat" if (msg.policy_version, msg.param_hash) == (self.version, self.param_hash) else "stale"
        building = self._building
        if building is not None:
            building.feed()  # what the last messages added, now that they went out
        if isinstance(msg, P.Parameters):
            if building is not None and building.key == (msg.policy_version, msg.param_hash):
                return "duplicate"
            if self.verify is not None:
                why = self.verify(msg)
                if why:
                    self.refusal = why
                    return "signature"
            flat = msg.arrays.get("flat")
            if flat is None:
                return "bad_chunk"
            if P.param_hash(flat) != (msg.chunk_hashes[0] if msg.chunk_hashes else msg.param_hash):
                return "chunk_hash"
            if building is not None:
                self.abandoned += 1
            building = self._building = _Pending(msg, flat, frames)
        else:
            if building is None or building.key != (msg.policy_version, msg.param_hash):
                return "orphan_chunk"
            head, index, data = building.head, msg.index, msg.arrays["data"]
            if index >= head.num_chunks:
                return "bad_chunk"
            if index not in building.missing:
                return "duplicate"
            size = min(head.chunk_numel, head.numel - index * head.chunk_numel)
            if data.dtype != building.dtype or data.size != size:
                return "bad_chunk"
            if msg.chunk_hash != head.chunk_hashes[index] or P.param_hash(data) != msg.chunk_hash:
                return "chunk_hash"
            building.add(index, data, frames)
        if building.missing:
            return "building"
        self._building = None
        if not building.whole_hash_ok():
            return "whole_hash"
        self.version, self.param_hash, self.messages = (
            building.head.policy_version,
            building.head.param_hash,
            building.messages(),
        )
        return "complete"
