"""The broker's parameter side (docs/protocol.md section 5.3): verify, publish, keep, and send snapshots.

Every params and params_chunk message of a learner is checked (transport.params.FrameCache) before it goes
out on the PUB socket: chunk 0 and each chunk against the version's chunk table as they come, and the
whole buffer against ``param_hash`` before the message that completes the version goes out. So the chunks
of a version stream to the actors as they arrive, as before, but none that fails a check ever goes out,
and no receiver can put together a version the broker did not verify (it never gets its last message).
Only a whole, verified version becomes the snapshot that actors get on the control socket: after their
hello, when their heartbeats show them behind, and on params_request. A corrupt version leaves the last
good one in place. With pinned learner keys (a broker with keys), a version whose params message is not signed by
one of them is refused before any of it goes out (protocol.signing; counted as ``params_signature``).
A member whose control connection has not taken what was sent to it before (its kernel send queue is full:
sockets.drained) gets no snapshot on a heartbeat or a params_request (``snapshots_unread``): one that reads
nothing holds at most the snapshot it was sent last, however often it says it is behind.

Latency: each message goes out after one SHA-1 pass over its data (about 2.8 ms for a 4 MiB chunk at
~1.5 GB/s; 0.03 ms for the CartPole model), the completing one after two (its own and the rest of the
whole-buffer hash). Receivers hash every chunk twice as well, so the broker's hashing overlaps theirs:
a version reaches an actor later by about one chunk's hashing, not by the whole version's. (Holding a
whole version until it verified would have added the broker's two passes over all of it and the
broker-to-actor transfer to every chunked broadcast: tens of ms for a 40 MB model.)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

from zddrl import protocol as P
from zddrl.broker.membership import Member
from zddrl.broker.sockets import drained
from zddrl.logs import RateLimitedLog
from zddrl.transport import signatures as signing
from zddrl.transport.params import FrameCache, Verify

if TYPE_CHECKING:  # cryptography is imported only where a key is used (zddrl.keys)
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

Publish = Callable[[P.Parameters | P.ParamChunk, Sequence[Any]], bool]
"""Broker.publish: one message of a version (a learner's, or a relay's upstream's) into the run; True once the
version is complete and published."""
PARAMS_REQUEST_MIN_INTERVAL_S = 0.25
"""A params_request is not answered with a version the broker sent the same actor less than this long ago
(it is on its way): one actor asking in a loop costs the broker at most 4 snapshots a second."""


class Publisher:
    """``add`` what learners send; ``on_join``/``on_heartbeat``/``on_request`` give actors the snapshot."""

    def __init__(
        self,
        publish: Callable[[Sequence[Any]], None],
        send: Callable[[bytes, Sequence[Any]], None],
        counters: dict[str, int],
        ratelog: RateLimitedLog,
        heartbeat_interval_s: float,
        pins: dict[str, Ed25519PublicKey] | None = None,
    ) -> None:
        self._publish = publish
        """Sends frames out of the params socket, to every actor."""
        self._send = send
        """Sends frames to a control identity (counting what cannot be routed)."""
        self.counters = counters
        self._ratelog = ratelog
        self.interval_s = heartbeat_interval_s
        self.verify: Verify | None = None if pins is None else partial(signing.params_refusal, pins=pins)
        """Without pins (no keys) signatures are optional and not checked."""
        self.cache = FrameCache(self.verify)
        self.published_at = 0.0
        """Monotonic time the newest version went out on the PUB socket."""

    @property
    def version(self) -> int:
        """The newest published version of the run (-1 none)."""
        return self.cache.version

    def new_run(self) -> None:
        """Versions restart with a run: forget the cached one (and count one still incomplete)."""
        self.counters["params_incomplete"] += self.cache.building
        self.cache = FrameCache(self.verify)

    def add(self, msg: P.Parameters | P.ParamChunk, frames: Sequence[Any], run_id: str) -> bool:
        """Take one message of a learner of run ``run_id``: publish it if it passed its checks; True if it
        completed a version (verified as a whole), now the published one and the snapshot."""
        cache = self.cache
        abandoned = cache.abandoned
        outcome = "unknown_run" if msg.run_id != run_id else cache.add(msg, list(frames))
        self.counters["params_incomplete"] += cache.abandoned - abandoned
        if outcome == "repeat":  # a learner re-publishes its version after a re-welcome: nothing to do, all is well
            self.counters["params_repeat"] += 1
            return False
        if outcome not in ("building", "complete"):
            self.counters[f"params_{outcome}"] += 1
            why = f"{outcome}: {cache.refusal}" if outcome == "signature" else outcome
            self._ratelog.warning(
                f"params_{outcome}",
                f"dropped a {msg.KIND} message of run {msg.run_id!r} version "
                f"{msg.policy_version} ({why}; run {run_id!r} is at "
                f"version {cache.version})",
            )
            return False
        self._publish(frames)
        self.counters["params_bytes"] += P.message_nbytes(frames)
        if outcome == "building":
            return False
        self.published_at = time.monotonic()
        self.counters["params_published"] += 1
        return True

    def on_join(self, actor: Member) -> None:
        """An actor said hello: the cached version follows its welcome."""
        if self.cache.messages:
            self._snapshot(actor, time.monotonic())

    def on_heartbeat(self, actor: Member) -> None:
        """An actor whose heartbeat reports an older version than the cached one (it missed a PUB) gets the
        cached version directly, at most once per heartbeat interval."""
        cache = self.cache
        if actor.role not in ("actor", "relay") or not cache.messages or actor.policy_version >= cache.version:
            return
        now = time.monotonic()
        if now - actor.last_snapshot < self.interval_s:
            return
        # A heartbeat sent just before a new version reached the actor over PUB reports the previous one:
        # a snapshot waits until the PUB had a heartbeat's time to land (no doubled traffic).
        if now - self.published_at < self.interval_s:
            return
        if self._unread(actor):
            return
        self._snapshot(actor, now)

    def on_request(self, actor: Member, held: int) -> None:
        """A params_request is answered by its own ``policy_version`` (``held``), whatever the actor's heartbeats
        said: the snapshot goes out if the cached version is newer, unless this actor was sent that same
        version less than PARAMS_REQUEST_MIN_INTERVAL_S ago (counted as params_request_limited)."""
        self.counters["params_requests"] += 1
        if actor.role not in ("actor", "relay") or not self.cache.messages or held >= self.cache.version:
            return
        now = time.monotonic()
        if actor.snapshot_version == self.cache.version and now - actor.last_snapshot < PARAMS_REQUEST_MIN_INTERVAL_S:
            self.counters["params_request_limited"] += 1
            return
        if self._unread(actor):
            return
        self._snapshot(actor, now)

    def _unread(self, actor: Member) -> bool:
        """Whether ``actor``'s control connection still holds what was sent to it (closed bus: its descriptor is
        known); counted, and then no snapshot goes out."""
        if actor.conn_fd < 0 or drained(actor.conn_fd):
            return False
        self.counters["snapshots_unread"] += 1
        return True

    def _snapshot(self, actor: Member, now: float) -> None:
        actor.last_snapshot, actor.snapshot_version = now, self.cache.version
        for frames in self.cache.messages:
            self._send(actor.identity, frames)
        self.counters["params_snapshots"] += 1
