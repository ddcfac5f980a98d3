"""What the learner shards tell each other about every trajectory they receive.

After each poll every shard sends the others one ``Record`` per trajectory it took off its data
socket, so that all of them count the same global batch. A record carries what counting needs (steps,
episodes, staleness, the parameter-hash check), never the arrays. Records travel through
``ShardGroup.exchange`` as plain lists (msgpack) and are rebuilt with ``records_of``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from zddrl import protocol as P


class Record(NamedTuple):
    peer_id: str
    seq: int
    policy_version: int
    """The policy version the actor acted with."""
    env_steps: int
    total_env_steps: int | None
    """The actor's cumulative env steps, when it reports them (zddrl's actors do)."""
    param_hash: str
    incarnation: str | None
    """Which process of that actor id sent it (an actor restarted under the same id is a new one)."""
    ep_returns: list[float]
    fresh: bool
    """Taken off the socket in this poll (not yet counted), rather than kept from an earlier one."""
    used: bool
    """Went into the receiving shard's batch."""
    invalid: str = ""
    """Why the run cannot train on it (algos.rollout.mismatch), or "" when it can."""


def record_of(msg: P.Trajectory, fresh: bool, used: bool, invalid: str = "") -> Record:
    info = msg.info
    total, incarnation = info.get("total_env_steps"), info.get("incarnation")
    return Record(
        msg.peer_id,
        msg.seq,
        msg.policy_version,
        msg.env_steps,
        total if isinstance(total, int) and not isinstance(total, bool) else None,
        msg.param_hash,
        incarnation if isinstance(incarnation, str) else None,
        list(msg.ep_returns),
        fresh,
        used,
        invalid,
    )


def records_of(rows: list[Any]) -> list[Record]:
    """One shard's exchanged rows as records."""
    return [Record._make(row) for row in rows]


def in_order(by_shard: list[list[Record]]) -> list[Record]:
    """Every shard's records in (peer_id, seq) order: the same order on every shard."""
    return sorted((r for records in by_shard for r in records), key=lambda r: (r.peer_id, r.seq))
