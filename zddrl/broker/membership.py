"""The broker's view of its members: who is connected, their counters, and how the broker logs.

Kept apart from the routing loop in ``broker.py``: these are plain records and checks with no
sockets.
"""

from __future__ import annotations

import time
from collections import OrderedDict, defaultdict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from zddrl import protocol as P
from zddrl.broker.fleet import Fleet
from zddrl.broker.health import HealthWarning
from zddrl.config import AlgoConfig
from zddrl.logs import RateLimitedLog

RUN_SCHEDULES = ("sync", "async")
"""What ``algo.schedule`` may say in a run spec (the learner resolves ``auto`` before it announces the run)."""

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
    """Learners: the ZeroMQ identity of their data DEALER on the learners socket (routing.Router.by_data_id): the
    peer id on an open bus, 16 random bytes issued in the welcome on a closed one."""
    user: str = ""
    """The ZAP User-Id (``ROLE:NAME`` of its key) of the connection it joined from; "" on an open bus. Every
    message after the hello must come from the same key."""
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


STATUS_RATE_PER_S = 2.0
"""Status requests per second one connection (ZeroMQ identity) may make, after a burst of STATUS_BURST. `zddrl
status` and --watch open a connection per request: this binds a client that sends many on one connection."""
STATUS_BURST = 10
STATUS_TOTAL_RATE_PER_S = 100.0
"""Status requests per second answered for all connections together, after a burst of STATUS_TOTAL_BURST: what
building bodies may cost the broker's loop, whoever asks (a body of 10,000 members takes a few ms)."""
STATUS_TOTAL_BURST = 200
STATUS_TOTAL_BYTES_PER_S = 8 << 20
"""Bytes of status replies per second for all connections together, after a burst of STATUS_TOTAL_BURST_BYTES:
what replies nobody reads can add to the broker's memory each second, whoever asks. A small fleet's body (a few
KiB) never meets it; bodies at their bound (report.MAX_STATUS_BYTES) are about 10 per second."""
STATUS_TOTAL_BURST_BYTES = 16 << 20
HELLO_RATE_PER_S = 1.0
"""Hellos per second one connection may send, after a burst of HELLO_BURST (a client sends one per connection,
and one more per reject that asks for it); the excess is dropped unanswered (``hello_limited``)."""
HELLO_BURST = 5
LIMITED_IDENTITIES = 16384
"""Connections whose rate-limit buckets are kept (least recently seen forgotten first): a peer that cycles
through more connections than this starts each with a full bucket, which the totals above still bound."""
MAX_MEMBERS_PER_ROLE = {"actor": 10_000, "learner": 256, "monitor": 64, "relay": 256, "replay": 256}
"""Members of each role at most; a hello past the cap is refused (``hello_over_cap``). Every member costs a row
in the status pages, fleet entries, heartbeats and health tracks."""
MAX_ACTORS_PER_HOST = 1024
"""Actors reporting one ``host`` at most (refused past it, ``hello_over_cap``). ``host`` is what the hello says:
this catches a runaway launcher, not a peer that lies."""


class TokenBucket:
    """``take(now)`` is True at most ``burst`` times at once and ``rate_per_s`` times per second on average."""

    __slots__ = ("rate_per_s", "burst", "tokens", "at")

    def __init__(self, rate_per_s: float, burst: int, now: float) -> None:
        self.rate_per_s, self.burst = rate_per_s, burst
        self.tokens, self.at = float(burst), now

    def take(self, now: float, n: float = 1.0) -> bool:
        """Take ``n`` tokens if there are that many."""
        self.tokens = min(float(self.burst), self.tokens + max(now - self.at, 0.0) * self.rate_per_s)
        self.at = now
        if self.tokens < n:
            return False
        self.tokens -= n
        return True


class RateLimit:
    """A token bucket per ZeroMQ identity (the LIMITED_IDENTITIES most recently seen) and, optionally, one for
    all identities together: ``allow(identity, now)`` is True if both have a token."""

    def __init__(self, rate_per_s: float, burst: int, total: tuple[float, int] | None = None) -> None:
        self.rate_per_s, self.burst = rate_per_s, burst
        self._buckets: OrderedDict[bytes, TokenBucket] = OrderedDict()
        self._total = TokenBucket(total[0], total[1], time.monotonic()) if total else None

    def allow(self, identity: bytes, now: float) -> bool:
        bucket = self._buckets.get(identity)
        if bucket is None:
            bucket = self._buckets[identity] = TokenBucket(self.rate_per_s, self.burst, now)
            if len(self._buckets) > LIMITED_IDENTITIES:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(identity)
        return bucket.take(now) and (self._total is None or self._total.take(now))

    def __len__(self) -> int:
        return len(self._buckets)


class Limits:
    """What peers of the public control port may make the broker do: status requests per connection and in all
    (``status``, then ``status_bytes`` with the reply's size), hellos per connection (``hello``), and the member
    caps (``cap_refusal``)."""

    def __init__(self) -> None:
        self.status = RateLimit(STATUS_RATE_PER_S, STATUS_BURST, (STATUS_TOTAL_RATE_PER_S, STATUS_TOTAL_BURST))
        self.hello = RateLimit(HELLO_RATE_PER_S, HELLO_BURST)
        self._status_bytes = TokenBucket(STATUS_TOTAL_BYTES_PER_S, STATUS_TOTAL_BURST_BYTES, time.monotonic())

    def status_bytes(self, nbytes: int, now: float) -> bool:
        """Whether a status reply of ``nbytes`` may go out now (STATUS_TOTAL_BYTES_PER_S)."""
        return self._status_bytes.take(now, nbytes)

    @staticmethod
    def cap_refusal(msg: P.Hello, old: Member | None, members: int, learners: int, fleet: Fleet) -> str:
        """Why ``msg`` would take its role (or its host's actors) past a cap, or "". ``old``: the member it
        replaces (which does not count); ``members``, ``learners``: how many are joined; actors are the fleet's."""
        actors = len(fleet)
        # ``learners`` counts every member on the learners socket: shards and replays share one cap
        by_role = {"actor": actors, "learner": learners, "replay": learners, "monitor": members - actors - learners}
        joined = by_role.get(msg.role, 0)
        if old is not None and old.role == msg.role:
            joined -= 1
        cap = MAX_MEMBERS_PER_ROLE.get(msg.role, 0)
        if joined >= cap:
            return f"the broker takes at most {cap} members of role {msg.role!r}"
        if msg.role == "actor":
            on_host = fleet.on_host(msg.host) - (old is not None and old.role == "actor" and old.host == msg.host)
            if on_host >= MAX_ACTORS_PER_HOST:
                return f"the broker takes at most {MAX_ACTORS_PER_HOST} actors from one host ({msg.host or '?'!r})"
        return ""


LEFT_ACTORS_KEPT = 1024
"""Departed actors remembered for the grace of Broker._route_trajectory (bounded: ids come from peers)."""


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


def staleness_of(run: Any) -> int:
    """Versions of lag the run allows (0 under the sync schedule); ProtocolError if the spec is unusable. The
    broker reads nothing else of how the run learns: ``algo.schedule`` and ``algo.max_staleness``."""
    if not isinstance(run, dict):
        raise P.ProtocolError("the run spec must be a map")
    algo = run.get("algo", {})
    if not isinstance(algo, dict):
        raise P.ProtocolError("run spec: 'algo' must be a map")
    schedule = algo.get("schedule", "sync")
    if schedule not in RUN_SCHEDULES:
        raise P.ProtocolError(f"run spec: algo.schedule must be one of {RUN_SCHEDULES}, got {schedule!r}")
    staleness = algo.get("max_staleness", AlgoConfig.max_staleness)
    if not isinstance(staleness, int) or isinstance(staleness, bool) or staleness < 0:
        raise P.ProtocolError(f"run spec: algo.max_staleness must be an int >= 0, got {staleness!r}")
    return 0 if schedule == "sync" else staleness


def credit_batch_of(run: dict) -> int:
    """How many of an actor's trajectories the broker reads before it returns their credit: half the run's
    ``algo.max_in_flight`` (at least 1), as a learner shard returns half its window. An actor that may
    have 2 in flight (the default) gets its credit back after every burst; one with 16 in flight after 8."""
    algo = run.get("algo", {}) if isinstance(run, dict) else {}
    limit = algo.get("max_in_flight", AlgoConfig.max_in_flight) if isinstance(algo, dict) else 1
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
        raise P.ProtocolError(f"run spec: algo.max_in_flight must be an int >= 1, got {limit!r}")
    return max(1, limit // 2)


def trajectory_refusal(header: dict[str, Any], run_id: str, latest: int, max_staleness: int) -> tuple[str, str]:
    """(drop reason, log text) for a trajectory (its validated header) the run cannot use, else ("", "")."""
    peer_id, version = header["peer_id"], header["policy_version"]
    # With no run yet (run_id "") a trajectory stamped run_id "" must not pass as the run's.
    if not run_id or header["run_id"] != run_id:
        return "unknown_run", (
            f"dropped a trajectory of unknown run {header['run_id']!r} from {peer_id} (current run {run_id!r})"
        )
    # Negative versions are never published: -1 must not pass before version 0 exists.
    if version < 0 or version > latest:
        return "unknown_version", (
            f"dropped a trajectory from {peer_id} with version {version} never published (latest {latest})"
        )
    if version < latest - max_staleness:
        return "stale", f"dropped stale data from {peer_id}: version {version}, latest {latest}"
    return "", ""


def log_health_events(log: RateLimitedLog, events: Iterable[tuple[bool, HealthWarning]]) -> None:
    """Onsets and ends, rate-limited per check: a thousand actors warned at once make one line and a count, not a
    thousand (their rows are in the status body). Keyed by check, not member: the log's keys are never forgotten,
    and peer ids come from peers."""
    for raised, w in events:
        if raised:
            log.warning(f"health/{w.check}", f"health: {w.member}: {w.check}: {w.message}")
        else:
            log.info(f"health-end/{w.check}", f"health: {w.member}: {w.check} cleared")


def id_conflict(old: Member | None, hello: P.Hello, interval_s: float) -> str:
    """Why ``hello`` may not take its peer id, or "". Another live process holds it: two actors started
    with the same --actor-id would otherwise take the id from each other at every re-hello, and share
    seeds; a second learner would take over the bus from the live one. A member silent for a heartbeat
    interval is taken over: a crashed process coming back. The advice fits the role: what a user does about
    a clash of actor ids is not what they do about a second learner."""
    if old is None or (old.host, old.pid) == (hello.host, hello.pid):
        return ""
    silent = time.monotonic() - old.last_seen
    if silent >= interval_s:
        return ""
    holder = f"pid {old.pid} on {old.host or '?'} (seen {silent:.1f} s ago)"
    if hello.role == "learner" and old.role == "learner":
        run = f"run {old.run_id!r}" if old.run_id else "a run"
        return (
            f"another learner ({run}, {holder}) holds this broker as {hello.peer_id!r}; "
            "stop that learner first, or use another broker for this run"
        )
    advice = "give each actor host its own --actor-id" if hello.role == "actor" else "stop that process first"
    return f"peer id {hello.peer_id!r} is in use by {holder}; {advice}"


def hello_conflict(msg: P.Hello, fleet_has_room: bool, run_id: str) -> str:
    """Why the broker refuses ``msg`` as malformed (one line for the reject), or "": an unknown role, a field out
    of bounds (``P.hello_refusal``), a full fleet message, a new run without a usable spec. A peer id another
    live process holds is no fault of the hello: ``id_conflict`` says it, and the broker counts it apart."""
    if msg.role not in P.ROLES:
        return f"hello with unknown role {msg.role!r}"
    refusal = P.hello_refusal(msg)
    if refusal:
        return f"hello: {refusal}"
    if msg.role == "actor" and not fleet_has_room:
        return (
            f"the fleet is full: its message would exceed {P.MAX_HEADER_BYTES} bytes with this actor "
            "(docs/protocol.md section 5.5)"
        )
    if msg.role == "learner" and msg.run_id and msg.run_id != run_id:  # a new run: its spec must be usable
        if msg.run is None:
            return "a learner hello for a new run must carry the run spec"
        try:
            staleness_of(msg.run)
            credit_batch_of(msg.run)
        except P.ProtocolError as exc:
            return str(exc)
    return ""


def member_of(msg: P.Hello, identity: bytes) -> Member:
    """The member a hello makes (its counters are its own unless it replaces an earlier session)."""
    return Member(
        peer_id=msg.peer_id,
        role=msg.role,
        identity=identity,
        host=msg.host,
        pid=msg.pid,
        num_envs=msg.num_envs,
        run_id=msg.run_id,
    )
