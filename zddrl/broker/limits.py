"""What peers of the public control port may make the broker do: status requests and hellos per connection and in
all (token buckets), and the members of each role at most (caps). Plain records and checks, no sockets."""

from __future__ import annotations

import time
from collections import OrderedDict

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
