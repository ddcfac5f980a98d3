"""What the learner shards tell each other about every trajectory they receive.

After each poll every shard sends the others one ``Record`` per trajectory it took off its data
socket, so that all of them count the same global batch. A record carries what counting needs (steps,
the episode segments read from the verified arrays, staleness, the parameter-hash check), never the arrays.
Records travel through ``ShardGroup.exchange`` as plain lists (msgpack) and are rebuilt with ``records_of``.

Every number a record takes from the header is bounded here or checked before (``admit.py``): ``env_steps`` is
``T * N`` of the arrays (the protocol's decoder checks it), the actor's own episode figures and
``total_env_steps`` are not read at all (``episodes.py``), and strings are cut to a length that matters.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from zddrl import protocol as P
from zddrl.intake.episodes import INCARNATION_CHARS, Segments, segments_of

HASH_CHARS = 64
"""A parameter hash is 16 hex digits; a record keeps at most this many characters of whatever the header says."""


class Record(NamedTuple):
    peer_id: str
    seq: int
    policy_version: int
    """The policy version the actor acted with."""
    env_steps: int
    """``T * N`` of its arrays."""
    param_hash: str
    incarnation: str | None
    """Which process of that actor id sent it (an actor restarted under the same id is a new one)."""
    segments: Segments | None
    """Its rewards summed between episode ends (``episodes.segments_of``); None when it was not read: kept from an
    earlier poll (counted then), or refused on its shapes or header (``admit.py``)."""
    fresh: bool
    """Taken off the socket in this poll (not yet counted), rather than kept from an earlier one."""
    used: bool
    """Went into the receiving shard's batch."""
    invalid: str = ""
    """Why the run cannot train on it (``admit.refusal``, ``algos.rollout.mismatch``), or "" when it can."""


def record_of(msg: P.Trajectory, fresh: bool, used: bool, invalid: str = "", readable: bool | None = None) -> Record:
    """``readable``: whether its episode segments may be read (default: fresh and valid). A rollout refused for
    its content (``algos.rollout.mismatch``) still has rewards of the shape it claims: the columns whose rewards
    are finite carry their episodes on, so one NaN reward breaks one env's episode, not every env's."""
    incarnation = msg.info.get("incarnation")
    return Record(
        msg.peer_id,
        msg.seq,
        msg.policy_version,
        msg.env_steps,
        msg.param_hash[:HASH_CHARS],
        incarnation if isinstance(incarnation, str) and len(incarnation) <= INCARNATION_CHARS else None,
        segments_of(msg.arrays) if (readable if readable is not None else fresh and not invalid) else None,
        fresh,
        used,
        invalid,
    )


def records_of(rows: list[Any]) -> list[Record]:
    """One shard's exchanged rows as records."""
    records = [Record._make(row) for row in rows]
    return [r if r.segments is None else r._replace(segments=Segments._make(r.segments)) for r in records]


def in_order(by_shard: list[list[Record]]) -> list[Record]:
    """Every shard's records in (peer_id, seq) order: the same order on every shard."""
    return sorted((r for records in by_shard for r in records), key=lambda r: (r.peer_id, r.seq))
