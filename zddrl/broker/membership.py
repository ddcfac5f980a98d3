"""Who is joined to the broker: ``Membership`` owns the members (by peer id and by ZeroMQ identity), the roster of
actors the fleet messages announce, and the departures, and tells its listeners (routing, subtrees, a relay's
upstream, the broker's health) of every join and leave. ``Member`` is one member's record.

Plain records and checks, no sockets: the broker's loop (broker.py) feeds it, the rest read it.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict, defaultdict, deque
from dataclasses import dataclass, field
from typing import Any

from zddrl import protocol as P
from zddrl.broker.roster import Roster

MAX_STATS_KEYS = 4096
"""Entries a stats map keeps (the learner sends one lag/<actor> entry per actor); later ones are dropped."""
MAX_STATS_KEY_BYTES = 160
"""Longest key kept, in UTF-8 bytes: "lag/" and a peer id of P.MAX_ID_BYTES fit."""
MAX_STATS_STRING = 256
"""Longest string value kept, in characters."""
MAX_STATS_BYTES = 64 << 10
"""Packed size a member's stats map may take (an upper bound of its msgpack size): every member row is in some
page of the status body, whose rows must fit report.PAGE_ROW_BYTES. 64 KiB holds the learner's lag/<actor>
entries of a fleet of about 3,000 actors; entries past it are dropped (``stats_truncated``)."""
STATS_NUMERIC_KEYS = ("sps", "comm_share")
"""Stats keys that `zddrl status` formats as numbers (see status.format_status)."""
DEPARTURES_KEPT = 20
"""Departures (with their reasons) listed in the status body."""
DEPARTURE_REASON_CHARS = 6000
"""Longest reason kept: 20 of them must fit in one status message (MAX_HEADER_BYTES) with the rest."""


MEMBER_COUNTERS = {"messages": 0, "bytes": 0, "env_steps": 0}
"""Counters every member row shows (trajectories and their bytes and env steps, forwarded from an actor or to
a learner shard); ``dropped_<reason>`` join them once non-zero."""


@dataclass
class Member:
    """One connected actor host or learner shard, as the broker sees it."""

    peer_id: str
    role: str
    identity: bytes
    host: str = ""
    pid: int = 0
    num_envs: int = 0
    joined: float = field(default_factory=time.time)
    last_seen: float = field(default_factory=time.monotonic)
    policy_version: int = -1
    credit: int = 0
    """Learners: trajectories the shard can take now."""
    unacked: int = 0
    """Actors: trajectories read from it whose credit has not gone back yet."""
    run_id: str = ""
    """Learners: the run they train (trajectories go only to shards of the current run)."""
    last_snapshot: float = 0.0
    """Actors: monotonic time the broker last sent it a parameter snapshot..."""
    snapshot_version: int = -1
    """...and that snapshot's version (a params_request for it is not answered twice in quick succession)."""
    fleet_seq: int = -1
    """Learners: seq of the last fleet message sent to it."""
    data_id: bytes = b""
    """Learners: the ZeroMQ identity of their data DEALER on the learners socket (routing.Shards.by_data_id): the
    peer id on an open bus, 16 random bytes issued in the welcome on a closed one."""
    user: str = ""
    """The ZAP User-Id (``ROLE:NAME`` of its key) of the connection it joined from; "" on an open bus. Every
    message after the hello must come from the same key."""
    conn_fd: int = -1
    """Closed bus: the file descriptor of the control connection it said hello on (-1: unknown, or an open bus)..."""
    conn_closed: bool = False
    """...and whether the broker saw that connection close (its process died, or its link reconnects): the same
    key may then take its id at once (guard.Claims)."""
    counters: dict[str, int] = field(default_factory=lambda: defaultdict(int, MEMBER_COUNTERS))
    """``messages``, ``bytes``, ``env_steps`` (always in the status row) and ``dropped_<reason>`` once non-zero."""
    stats: dict[str, Any] = field(default_factory=dict)
    stats_bytes: int = 5
    """Bound of the packed size of ``stats`` (checked_stats): what the member's status row costs, for paging."""
    relay: str = ""
    """Actors joined through a relay (broker/subtree.py): the relay's peer id. Such a member's ``identity`` and
    ``user`` are its relay's (credit goes back to the relay, and only the relay's key may send for it); it gets no
    heartbeats or snapshots of its own and expires with its relay or its relay's report. "" for direct members."""

    def take_stats(self, stats: dict) -> str:
        """Keep ``stats`` (checked_stats; ProtocolError if refused); returns what was dropped, for the log, or ""."""
        self.stats, self.stats_bytes, dropped = checked_stats(stats)
        if not dropped:
            return ""
        return (
            f"stats of {self.role} {self.peer_id}: {dropped} of {len(stats)} entries dropped (at most "
            f"{MAX_STATS_KEYS} entries, {MAX_STATS_BYTES} bytes, keys of {MAX_STATS_KEY_BYTES} bytes, strings of "
            f"{MAX_STATS_STRING} characters)"
        )

    def count(self, nbytes: int, env_steps: int | None = None) -> None:
        """One trajectory of ``nbytes`` forwarded for (or to) this member; actors also count env steps."""
        counters = self.counters
        counters["messages"] += 1
        counters["bytes"] += nbytes
        if env_steps is not None:
            counters["env_steps"] += env_steps

    def row(self, now: float) -> dict[str, Any]:
        return {
            "role": self.role,
            "host": self.host,
            "pid": self.pid,
            "num_envs": self.num_envs,
            "policy_version": self.policy_version,
            "last_seen_s": round(now - self.last_seen, 3),
            "credit": self.credit,
            **({"relay": self.relay} if self.relay else {}),
            **self.counters,
            "stats": self.stats,
        }


LEFT_ACTORS_KEPT = 1024
"""Departed actors remembered for the grace of routing.Router (bounded: ids come from peers)."""


class Departures:
    """The last DEPARTURES_KEPT members that left (bye, crash report or expiry), newest first.

    Kept for forensics: a crashed actor is gone from ``members`` by the time anyone looks, and its
    last words (exception and traceback, sent in its bye) would otherwise be only in its own log,
    on its own host.
    """

    def __init__(self, grace_s: float = 0.0) -> None:
        self._rows: deque[dict[str, Any]] = deque(maxlen=DEPARTURES_KEPT)
        self.grace_s = grace_s
        """How long an actor's trajectories still count as its own after it left (actor_left_lately)."""
        self._actors_left: OrderedDict[str, tuple[float, str]] = OrderedDict()
        """Peer id -> (monotonic time it left, the key it had joined with), of the last LEFT_ACTORS_KEPT actors."""

    def record(self, member: Member, reason: str) -> None:
        if member.role == "actor":
            self._actors_left[member.peer_id] = (time.monotonic(), member.user)
            self._actors_left.move_to_end(member.peer_id)
            if len(self._actors_left) > LEFT_ACTORS_KEPT:
                self._actors_left.popitem(last=False)
        if len(reason) > DEPARTURE_REASON_CHARS:  # the status body must stay under MAX_HEADER_BYTES
            reason = reason[:DEPARTURE_REASON_CHARS] + "\n... (truncated by the broker)"
        self._rows.appendleft(
            {
                "member": member.peer_id,
                "role": member.role,
                "host": member.host,
                "pid": member.pid,
                "reason": reason,
                "crashed": reason.startswith(P.CRASH_PREFIX),
                "time": time.time(),
                "at": time.monotonic(),
            }
        )

    def rows(self, now: float) -> list[dict[str, Any]]:
        return [
            {**{k: v for k, v in row.items() if k != "at"}, "ago_s": round(now - row["at"], 1)} for row in self._rows
        ]

    def actor_left_lately(self, peer_id: str, now: float | None = None) -> bool:
        """True if ``peer_id`` is an actor that left (bye, expiry, replaced) at most ``grace_s`` ago: what it
        sent before leaving may still be queued at the broker, and is its own, not a stranger's."""
        return self.left_with(peer_id, now) is not None

    def left_with(self, peer_id: str, now: float | None = None) -> str | None:
        """The key (``Member.user``) an actor that left at most ``grace_s`` ago had joined with; None if none did."""
        left = self._actors_left.get(peer_id)
        if left is None or (time.monotonic() if now is None else now) - left[0] > self.grace_s:
            return None
        return left[1]


def packed_bytes(value: Any) -> int:
    """An upper bound of the msgpack size of a stats key or value (nil, bool, int, float, str), without packing it."""
    if isinstance(value, str):
        return len(value.encode("utf-8", "surrogatepass")) + 5
    return 1 if value is None or isinstance(value, bool) else 9


def checked_stats(stats: dict) -> tuple[dict, int, int]:
    """(the map kept, its packed size bound, entries dropped) of a stats map. Stats are a flat map of figures:
    str keys, scalar values, numbers where status expects them; a map that breaks these rules is refused
    (ProtocolError): one client's bytes or nested maps would make every `zddrl status --json` fail (not
    JSON-serialisable), and a string "sps" would break the table. Size is bounded, not refused: entries with a key
    over MAX_STATS_KEY_BYTES or a string over MAX_STATS_STRING are dropped, and so is everything from the first entry
    past MAX_STATS_KEYS or MAX_STATS_BYTES on (in the sender's order): a member row always fits a status page."""
    kept: dict[str, Any] = {}
    nbytes = 5  # the map's own header
    for key, value in stats.items():
        if not isinstance(key, str):
            raise P.ProtocolError(f"stats: key {key!r} is not a string")
        if not (value is None or isinstance(value, (bool, int, float, str))):
            raise P.ProtocolError(f"stats: {key!r} must be a number, string, bool or nil, not {type(value).__name__}")
        if key in STATS_NUMERIC_KEYS and not isinstance(value, (int, float)):
            raise P.ProtocolError(f"stats: {key!r} must be a number")
        key_bytes = packed_bytes(key)
        if key_bytes > MAX_STATS_KEY_BYTES + 5 or (isinstance(value, str) and len(value) > MAX_STATS_STRING):
            continue
        size = key_bytes + packed_bytes(value)
        if len(kept) >= MAX_STATS_KEYS or nbytes + size > MAX_STATS_BYTES:
            break  # a prefix is kept: the loop stays short whatever the map's length
        kept[key] = value
        nbytes += size
    return kept, nbytes, len(stats) - len(kept)


TAKEOVER_BEATS = 2
"""A member's id goes to another process after this many heartbeat intervals of silence. One interval is a live
member's own period: its beat is due then and lands a poll later (an idle actor looked silent >= 1.0 s of a 1 s
interval in 3.8 % of 213 status polls, at most 1.069 s), so one interval would hand a live member's id away."""


def id_conflict(old: Member | None, hello: P.Hello, interval_s: float) -> tuple[str, bool]:
    """Why ``hello`` may not take its peer id ("" if it may), and whether that is final. Another live process
    holds it: two actors started with the same --actor-id would otherwise take the id from each other at every
    re-hello, and share seeds; a second learner would take over the bus from the live one. A holder heard from
    within ``interval_s`` (the longest interval it may beat at: ``Cadence.keeping_s``) is live: final. One silent
    for longer, but less than TAKEOVER_BEATS intervals, may be live and late or dead: not final, the new process
    asks again at its next heartbeat, by when the holder has beaten or is taken over. Taken over: a holder silent
    for longer, or (closed bus) whose control connection closed: a crashed process coming back (on a closed bus
    only by its own key: guard.Guard). The advice fits the role: what a user does about a clash of actor ids is
    not what they do about a second learner."""
    if old is None or old.conn_closed or (old.host, old.pid) == (hello.host, hello.pid):
        return "", True
    silent = time.monotonic() - old.last_seen
    if silent >= TAKEOVER_BEATS * interval_s:
        return "", True
    holder = f"pid {old.pid} on {old.host or '?'} (seen {silent:.1f} s ago)"
    if hello.role == "learner" and old.role == "learner":
        run = f"run {old.run_id!r}" if old.run_id else "a run"
        why = (
            f"another learner ({run}, {holder}) holds this broker as {hello.peer_id!r}; "
            "stop that learner first, or use another broker for this run"
        )
    else:
        advice = "give each actor host its own --actor-id" if hello.role == "actor" else "stop that process first"
        why = f"peer id {hello.peer_id!r} is in use by {holder}; {advice}"
    if silent >= interval_s:
        return f"{why} (its heartbeat is late: asking again at the next one)", False
    return why, True


class Listener:
    """What a part of the broker hears of membership (``Membership.listen``). Each method is a no-op here: a listener
    overrides what it needs. Listeners are called in the order they were added, after the indexes changed."""

    def joined(self, member: Member) -> None:
        """``member`` joined: it is in the indexes (and, an actor, in the roster)."""

    def left(self, member: Member) -> None:
        """``member`` is out of every index: it left for good, or a new session took its peer id."""

    def replaced(self, old: Member, new: Member) -> None:
        """``new``, a new session under ``old``'s peer id, took its place: by default ``left(old)`` then
        ``joined(new)``."""
        self.left(old)
        self.joined(new)

    def departed(self, member: Member, reason: str) -> None:
        """``member`` is gone for good (``left`` came first) and recorded as a departure: bye, expiry, its relay's
        word, a revoked key, or another process that took its peer id."""


class Membership:
    """The broker's members, one object that changes them: ``admit`` a member (in place of an earlier session of its
    peer id), ``remove`` one that left for good; everyone else reads (``get``, ``of_identity``, ``joined_actor``,
    ``members``) and listens (``listen``).

    A relayed actor (``Member.relay``) is indexed by peer id only: its ZeroMQ identity is its relay's."""

    def __init__(self, counters: dict[str, int], grace_s: float = 0.0) -> None:
        self.members: dict[str, Member] = {}
        """Every member by peer id. Read it freely; change it only through ``admit`` and ``remove``."""
        self.by_identity: dict[bytes, Member] = {}
        """The direct members (heartbeats both ways) by the ZeroMQ identity of their control connection."""
        self.roster = Roster()
        """The joined actors, as fleet messages announce them to the learner shards of the run."""
        self.departures = Departures(grace_s)
        self._counters = counters
        """The broker's counters: ``expired_or_left`` is counted here."""
        self._roles: Counter[str] = Counter()
        self._listeners: list[Listener] = []

    def listen(self, listener: Listener) -> None:
        self._listeners.append(listener)

    # ---------------------------------------------------------------- reads
    def __len__(self) -> int:
        return len(self.members)

    def get(self, peer_id: str) -> Member | None:
        return self.members.get(peer_id)

    def of_identity(self, identity: bytes) -> Member | None:
        """The direct member whose control connection has this ZeroMQ identity."""
        return self.by_identity.get(identity)

    def count(self, *roles: str) -> int:
        """Members of these roles now (relayed actors included)."""
        return sum(self._roles[role] for role in roles)

    def joined_actor(self, peer_id: str | None, user: str | None = None) -> Member | None:
        """The actor member ``peer_id`` (if ``user`` is given: only if it joined with that key)."""
        member = self.members.get(peer_id) if peer_id is not None else None
        if member is None or member.role != "actor" or (user is not None and member.user != user):
            return None
        return member

    def silent(self, now: float, limit_s: float) -> list[Member]:
        """Direct members not heard from for more than ``limit_s`` (a relayed actor goes with its relay)."""
        return [m for m in self.members.values() if now - m.last_seen > limit_s and not m.relay]

    # ---------------------------------------------------------------- changes
    def admit(self, member: Member, old: Member | None = None, departure: str = "") -> None:
        """``member`` joins in place of ``old`` (the member its peer id had, if any): listeners hear ``replaced``,
        or ``joined`` if there was none. ``departure`` (another process took the id) records ``old`` as departed."""
        if old is not None:
            self._unindex(old)
        self._index(member)
        for listener in self._listeners:
            if old is None:
                listener.joined(member)
            else:
                listener.replaced(old, member)
        if old is not None and departure:
            self._departed(old, departure)

    def remove(self, member: Member, reason: str) -> None:
        """``member`` left for good (bye, expiry, its relay's word or departure, a revoked key): out of every index,
        counted (``expired_or_left``) and recorded as a departure. A member no longer indexed is left alone."""
        if self.members.get(member.peer_id) is not member:
            return
        self._unindex(member)
        for listener in self._listeners:
            listener.left(member)
        self._counters["expired_or_left"] += 1
        self._departed(member, reason)

    def _departed(self, member: Member, reason: str) -> None:
        self.departures.record(member, reason)
        for listener in self._listeners:
            listener.departed(member, reason)

    def _index(self, member: Member) -> None:
        self.members[member.peer_id] = member
        if not member.relay:
            self.by_identity[member.identity] = member
        self._roles[member.role] += 1
        if member.role == "actor":
            self.roster.joined(member.peer_id, member.num_envs, member.host)

    def _unindex(self, member: Member) -> None:
        if self.members.get(member.peer_id) is not member:
            return
        del self.members[member.peer_id]
        if self.by_identity.get(member.identity) is member:  # a relayed actor's identity is its relay's
            del self.by_identity[member.identity]
        self._roles[member.role] -= 1
        if member.role == "actor":
            self.roster.left(member.peer_id)
