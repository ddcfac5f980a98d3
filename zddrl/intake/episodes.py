"""Episode returns and lengths as the learner reads them from the arrays it verified, never from a header.

A trajectory's header carries the actor's own ``ep_returns`` and ``ep_lengths``; nothing checks them against the
arrays, so a buggy or hostile actor could report returns of 1e9 and end a run with ``reached: true``. The learner
ignores them. Instead, the shard that received a rollout (and found it fit to train on) sums its ``rewards``
between the ``terminated | truncated`` flags of each env column (``segments_of``): the rewards on the wire are
the env's own (reward normalisation is the learner's, later), so these are the true env returns. What travels
to the main shard in the rollout's record is that summary, a few numbers per env column, not the arrays.

The main shard stitches the summaries of one actor into streams, one per env column (``Episodes``): a running
return and length per column across the actor's rollouts in ``seq`` order, an episode reported when a flag
ends it. A stream is continuous only while that actor's rollouts follow one another: a gap in ``seq`` (a rollout
the learner never got, or refused on its shapes or header), a new incarnation (the actor process restarted) or
another env count breaks it, and every column is then *unknown* until its next episode end: that partial
episode is not reported. A rollout refused for its content (a NaN reward, say) is still read for its rewards,
which have the shape it claims: a column with a non-finite reward is broken up to its next episode end, the
others carry on. Rollouts from the learner shards arrive a little out of order, so up to ``REORDER_WINDOW`` of an
actor's rollouts wait for a missing one before the stream gives it up. A stream starts known only at seq 0
(an actor process's first rollout, whose envs were just reset).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

REORDER_WINDOW = 8
"""Rollouts of one actor held back while an earlier one is missing; past that it is taken as lost."""
STREAMS_KEPT = 4096
"""Actors whose streams are kept (least recently heard-from dropped first; a dropped actor's next rollout starts
an unknown stream). Bounds the main shard's memory whatever the peer ids."""
INCARNATION_CHARS = 64
"""The longest incarnation kept; a longer one (zddrl's actors send 12 hex digits) counts as none."""


class Segments(NamedTuple):
    """One rollout's rewards summed between episode ends, per env column (all plain lists, msgpack-able)."""

    head: list[float]
    """Rewards up to and including the first episode end of each column (all of them where none ended)."""
    head_len: list[int]
    head_ok: list[bool]
    """Whether those rewards were all finite (a refused rollout's may not be: its other columns still count)."""
    ended: list[bool]
    """Whether an episode ended in the column."""
    tail: list[float]
    """Rewards after the last episode end of each column (0 where none ended)."""
    tail_len: list[int]
    tail_ok: list[bool]
    inner: list[list[float]]
    """``[return, length]`` of each episode that began and ended inside the rollout with finite rewards only."""


def segments_of(arrays: Mapping[str, np.ndarray]) -> Segments:
    """The ``Segments`` of a rollout's ``rewards``, ``terminated`` and ``truncated`` ``[T, N]``."""
    rewards = np.asarray(arrays["rewards"], dtype=np.float64)
    done = np.asarray(arrays["terminated"]) | np.asarray(arrays["truncated"])
    T, N = rewards.shape
    bad = ~np.isfinite(rewards)
    zero = np.zeros((1, N))
    cum = np.concatenate([zero, np.cumsum(np.where(bad, 0.0, rewards), axis=0)])  # cum[t] = sum of rows < t
    cum_bad = np.concatenate([zero, np.cumsum(bad, axis=0)])

    def part(a: int, b: int, n: int) -> tuple[float, int, bool]:
        return float(cum[b, n] - cum[a, n]), b - a, bool(cum_bad[b, n] == cum_bad[a, n])

    heads, tails, ended = [], [], []
    inner: list[list[float]] = []
    for n in range(N):
        stops = np.flatnonzero(done[:, n]) + 1  # an episode ending at row t takes rows up to t
        first, last = (int(stops[0]), int(stops[-1])) if len(stops) else (T, T)
        heads.append(part(0, first, n))
        ended.append(bool(len(stops)))
        tails.append(part(last, T, n))
        for a, b in zip(stops[:-1], stops[1:]):
            ret, length, ok = part(int(a), int(b), n)
            if ok:
                inner.append([ret, length])
    head, head_len, head_ok = (list(x) for x in zip(*heads)) if N else ([], [], [])
    tail, tail_len, tail_ok = (list(x) for x in zip(*tails)) if N else ([], [], [])
    return Segments(head, head_len, head_ok, ended, tail, tail_len, tail_ok, inner)


class _Stream:
    """One actor's env columns: running return and length, and whether each is known since its episode began."""

    def __init__(self, incarnation: str | None, next_seq: int, known: bool, envs: int = 0) -> None:
        self.incarnation = incarnation
        self.next_seq = next_seq
        self.ret = np.zeros(envs)
        self.length = np.zeros(envs, dtype=np.int64)
        self.known = np.full(envs, known)
        self.start_known = known
        """Columns of the first rollout are known (seq 0: fresh envs) before the width is known."""
        self.pending: dict[int, Segments | None] = {}

    def lose(self) -> None:
        """A rollout of this actor is missing: every column's current episode is broken."""
        self.known[:] = False
        self.start_known = False

    def apply(self, seg: Segments | None) -> list[tuple[float, int]]:
        """Fold in the next rollout (None: one the run refused, which breaks every column); its episodes."""
        if seg is None:
            self.lose()
            return []
        if len(seg.head) != len(self.ret):  # the first rollout, or another env count: a new set of columns
            known = self.start_known and not len(self.ret)
            self.ret, self.length = np.zeros(len(seg.head)), np.zeros(len(seg.head), dtype=np.int64)
            self.known = np.full(len(seg.head), known)
        episodes = [
            (float(self.ret[n] + seg.head[n]), int(self.length[n] + seg.head_len[n]))
            for n in range(len(seg.head))
            if seg.ended[n] and self.known[n] and seg.head_ok[n]
        ]
        episodes.extend((float(r), int(n)) for r, n in seg.inner)
        ended = np.asarray(seg.ended, dtype=bool)
        self.ret = np.where(ended, seg.tail, self.ret + np.asarray(seg.head))
        self.length = np.where(ended, seg.tail_len, self.length + np.asarray(seg.head_len))
        self.known = np.where(ended, seg.tail_ok, self.known & np.asarray(seg.head_ok, dtype=bool))
        return episodes


class Episodes:
    """``add(peer_id, incarnation, seq, segments)`` per received rollout (segments None for one the run refused);
    returns the ``(return, length)`` of the episodes it completes."""

    def __init__(self) -> None:
        self.streams: dict[str, _Stream] = {}

    def add(self, peer_id: str, incarnation: Any, seq: int, segments: Segments | None) -> list[tuple[float, int]]:
        incarnation = incarnation if isinstance(incarnation, str) and len(incarnation) <= INCARNATION_CHARS else None
        stream = self.streams.pop(peer_id, None)  # re-inserted below: the dict's order is least recent first
        if stream is None or stream.incarnation != incarnation:
            stream = _Stream(incarnation, seq, known=seq == 0)
        self.streams[peer_id] = stream
        while len(self.streams) > STREAMS_KEPT:
            del self.streams[next(iter(self.streams))]
        if seq < stream.next_seq:  # given up on already, or a duplicate: it cannot be stitched in
            return []
        stream.pending[seq] = segments
        episodes: list[tuple[float, int]] = []
        while stream.pending:
            if stream.next_seq not in stream.pending:
                if len(stream.pending) <= REORDER_WINDOW:
                    break
                stream.lose()
                stream.next_seq = min(stream.pending)
            episodes.extend(stream.apply(stream.pending.pop(stream.next_seq)))
            stream.next_seq += 1
        return episodes
