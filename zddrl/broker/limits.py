"""What peers of the public control port may make the broker do: status requests and hellos per connection and in
all (token buckets), the replies that connections hold unread (``UnreadReplies``), and the members of each role at
most (caps). Plain records and checks, no sockets."""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable

from zddrl import protocol as P
from zddrl.broker.membership import Member
from zddrl.broker.roster import Roster

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
"""Open bus: actors reporting one ``host`` at most (refused past it, ``hello_over_cap``). ``host`` is what the hello
says: this catches a runaway launcher, not a peer that lies; a closed bus caps per key instead."""
MAX_MEMBERS_PER_KEY = {"actor": 1024, "relay": 1024, "learner": 64, "replay": 64, "monitor": 16}
"""Closed bus: members joined with one key at most, by the key's role (a relay's key counts the relay and the
actors it reports); past it a hello is refused (``hello_over_cap``). A stolen key takes at most this share of
its role's cap. A fleet of more actor processes than this gives its hosts keys of their own (docs/security.md)."""


UNREAD_BYTES = 64 << 20
"""Bytes of replies to connections that have not joined (status bodies, their rejects, "send hello first") that
those connections may hold unread, all together; past it such a reply is dropped unsent (``replies_unread``). The
per-second rates above bound how fast replies go out, not what piles up at peers that never read them."""
UNREAD_BYTES_PER_KEY = 16 << 20
"""...and with one key (closed bus), so that one key's connections leave room for the others' status."""
UNREAD_CONNECTIONS = 4096
"""Connections holding unread replies, at most (a reply to one more is dropped, ``replies_unread``)."""
REPLY_OVERHEAD_BYTES = 256
"""What libzmq keeps per queued message besides its bytes (a message header per frame, the allocation): counted
with each reply, so that tiny rejects add up too."""
UNREAD_RESCAN_S = 0.5
"""A request that finds no room looks again at every connection holding replies (which of them read theirs since,
or closed), at most this often."""


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
    def cap_refusal(
        msg: P.Hello, old: Member | None, members: int, learners: int, roster: Roster, user: str = "", of_key: int = 0
    ) -> str:
        """Why ``msg`` would take its role, its host's actors (open bus) or its key's members (closed bus: ``user``
        the key, ``of_key`` its members now) past a cap, or "". ``old``: the member it replaces (which does not
        count); ``members``, ``learners``: how many are joined; actors are the roster's."""
        actors = len(roster)
        # ``learners`` counts every member on the learners socket: shards and replays share one cap
        by_role = {"actor": actors, "learner": learners, "replay": learners, "monitor": members - actors - learners}
        joined = by_role.get(msg.role, 0)
        if old is not None and old.role == msg.role:
            joined -= 1
        cap = MAX_MEMBERS_PER_ROLE.get(msg.role, 0)
        if joined >= cap:
            return f"the broker takes at most {cap} members of role {msg.role!r}"
        if user:
            role, _, name = user.partition(":")
            cap = MAX_MEMBERS_PER_KEY.get(role, 0)
            if of_key - (old is not None and old.user == user) >= cap:
                what = f"at most {cap} members with one {role} key ({name!r})"
                return f"the broker takes {what}: give hosts keys of their own"
        elif msg.role == "actor":
            on_host = roster.on_host(msg.host) - (old is not None and old.role == "actor" and old.host == msg.host)
            if on_host >= MAX_ACTORS_PER_HOST:
                return f"the broker takes at most {MAX_ACTORS_PER_HOST} actors from one host ({msg.host or '?'!r})"
        return ""


class UnreadReplies:
    """What connections that have not joined hold of the replies sent to them, by connection (its descriptor and routing
    identity) and key: ``admit`` says whether a reply may go out (UNREAD_BYTES in all, UNREAD_BYTES_PER_KEY per key,
    UNREAD_CONNECTIONS connections) and counts it. A connection's replies are forgotten once ``drained`` says its
    kernel send queue took them (nothing of them is left in libzmq: the peer reads, or it closed)."""

    def __init__(self, drained: Callable[[int], bool]) -> None:
        self._drained = drained
        self._held: dict[tuple[int, bytes], tuple[str, int]] = {}
        """(descriptor, identity) -> (key, bytes held)."""
        self._per_key: Counter[str] = Counter()
        self.total = 0
        self._scanned_at = -UNREAD_RESCAN_S

    def admit(self, fd: int, identity: bytes, user: str, nbytes: int, now: float) -> bool:
        """Whether a reply of ``nbytes`` to the connection (``fd``, ``identity``) of key ``user`` may go out now;
        if so it is counted as held. A reply with no descriptor to watch (-1: not from a socket) always may."""
        if fd < 0:
            return True
        conn = (fd, identity)
        if conn in self._held and self._drained(fd):
            self._release(conn)
        cost = nbytes + REPLY_OVERHEAD_BYTES
        if not self._room(conn, user, cost) and now - self._scanned_at >= UNREAD_RESCAN_S:
            self.sweep(now)
        if not self._room(conn, user, cost):
            return False
        _, before = self._held.get(conn, (user, 0))
        self._held[conn] = (user, before + cost)
        self._per_key[user] += cost
        self.total += cost
        return True

    def sweep(self, now: float) -> None:
        """Forget the replies of every connection that took them since, or closed (the broker sweeps at each tick,
        and a request that finds no room at most every UNREAD_RESCAN_S)."""
        self._scanned_at = now
        for conn in [c for c in self._held if self._drained(c[0])]:
            self._release(conn)

    def _room(self, conn: tuple[int, bytes], user: str, cost: int) -> bool:
        if conn not in self._held and len(self._held) >= UNREAD_CONNECTIONS:
            return False
        per_key_ok = not user or self._per_key[user] + cost <= UNREAD_BYTES_PER_KEY
        return per_key_ok and self.total + cost <= UNREAD_BYTES

    def _release(self, conn: tuple[int, bytes]) -> None:
        user, nbytes = self._held.pop(conn)
        self.total -= nbytes
        self._per_key[user] -= nbytes
        if self._per_key[user] <= 0:
            del self._per_key[user]

    def clear(self) -> None:
        """Every connection closed (the broker's sockets were reset): nothing is held."""
        self._held.clear()
        self._per_key.clear()
        self.total = 0

    def __len__(self) -> int:
        return len(self._held)

    def __str__(self) -> str:
        return (
            f"connections hold {self.total >> 10} KiB of replies unread (at most {UNREAD_BYTES >> 20} MiB, "
            f"{UNREAD_BYTES_PER_KEY >> 20} MiB per key)"
        )
