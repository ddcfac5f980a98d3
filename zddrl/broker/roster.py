"""The roster: which actors are joined, as the broker announces them to learner shards (fleet messages).

A plain record with no sockets, kept by ``membership.Membership``, which calls ``joined``/``left`` on every change
of its actor members; the broker, at loop level after socket handling, calls ``announce`` at most once per
FLEET_COALESCE_S, which says whether the map changed since the last announcement (docs/protocol.md section 5.5).
"""

from __future__ import annotations

import time
from typing import Any

from zddrl import protocol as P

FLEET_COALESCE_S = 0.1
"""Seconds between two fleet announcements at least: a burst of joins (a fleet starting) costs each learner
one message per interval, not one per actor. The first change after a quiet interval goes out at once."""


def first_seq() -> int:
    """A broker process's first fleet seq: its start time in milliseconds since the Unix epoch. Each change
    adds one, so a restarted broker's numbers do not repeat those its predecessor sent (unless that one
    announced more changes than milliseconds passed between the two starts): a learner may compare seqs
    for equality across a broker restart."""
    return time.time_ns() // 1_000_000


class Roster:
    """The joined actors' fleet entries, the last announced map and its seq (the wire message is ``P.Fleet``)."""

    def __init__(self, seq: int | None = None) -> None:
        self.seq = first_seq() if seq is None else seq
        """seq of the last announced map (``actors``)."""
        self.actors: dict[str, dict[str, Any]] = {}
        """The last announced map: peer id -> {"num_envs", "host"}. Replaced, never modified, when it changes."""
        self.changed = False
        """An actor joined or left since the last announcement."""
        self.next_at = 0.0
        """Monotonic time before which no announcement goes out (coalescing)."""
        self.nbytes = 0
        """Packed size of the current actors' entries (what the next announced map's entries take)."""
        self._entries: dict[str, tuple[int, str, int]] = {}
        """Joined actors now: peer id -> (num_envs, host, entry bytes)."""
        self._frames: tuple[str, int, list[Any]] | None = None
        self._per_host: dict[str, int] = {}
        """Joined actors per ``host`` (for membership.MAX_ACTORS_PER_HOST)."""

    def __len__(self) -> int:
        """Joined actors now."""
        return len(self._entries)

    def on_host(self, host: str) -> int:
        """Joined actors whose hello named ``host``."""
        return self._per_host.get(host, 0)

    def room_for(self, peer_id: str, num_envs: int, host: str) -> bool:
        """Whether the fleet message stays under MAX_HEADER_BYTES with this actor in it (replacing its old entry)."""
        old = self._entries.get(peer_id)
        return (
            self.nbytes - (old[2] if old else 0) + P.fleet_entry_bytes(peer_id, num_envs, host)
            <= P.MAX_FLEET_ACTORS_BYTES
        )

    def joined(self, peer_id: str, num_envs: int, host: str) -> None:
        self.left(peer_id)
        nbytes = P.fleet_entry_bytes(peer_id, num_envs, host)
        self._entries[peer_id] = (num_envs, host, nbytes)
        self._per_host[host] = self._per_host.get(host, 0) + 1
        self.nbytes += nbytes
        self.changed = True

    def left(self, peer_id: str) -> None:
        old = self._entries.pop(peer_id, None)
        if old is not None:
            self.nbytes -= old[2]
            self.changed = True
            left = self._per_host[old[1]] - 1
            if left:
                self._per_host[old[1]] = left
            else:
                del self._per_host[old[1]]

    def due(self, now: float) -> bool:
        return self.changed and now >= self.next_at

    def announce(self, now: float, coalesce_s: float = FLEET_COALESCE_S) -> None:
        """Bring ``actors`` up to date; ``seq`` grows by one if the map differs from the last announced one
        (a leave and a rejoin within one interval may leave it the same)."""
        self.changed = False
        self.next_at = now + coalesce_s
        actors = {peer_id: {"num_envs": n, "host": host} for peer_id, (n, host, _) in self._entries.items()}
        if actors != self.actors:
            self.seq += 1
            self.actors = actors

    def frames(self, run_id: str) -> list[Any]:
        """The fleet message of the last announced map for ``run_id``, encoded once per (run, seq)."""
        cached = self._frames
        if cached is None or cached[0] != run_id or cached[1] != self.seq:
            cached = self._frames = (
                run_id,
                self.seq,
                P.encode(P.Fleet(run_id=run_id, seq=self.seq, actors=self.actors)),
            )
        return cached[2]
