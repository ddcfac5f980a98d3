"""A broker's view of the relays below it: which actors each relay serves, and each relay's counters.

A relay (a broker with an upstream: broker/upstream.py) joins its upstream with hello role ``relay`` and reports its
subtree there (subtree messages, docs/protocol.md section 5.8). Each relayed actor becomes a member here
(``Member.relay``) whose identity and key are its relay's: the fleet announced to the learners counts it, the data path
accepts its trajectories only from its relay's connection (and, on a closed bus, its relay's key), and its credit goes
back to the relay. A relayed actor leaves when its relay's report says so, when a full report no longer names it, when
it joins elsewhere (directly, or through another relay: the newest claim wins, since an actor moves to its fallback when
its relay dies), or when its relay leaves or expires.

The trust boundary: a relay's key may speak for the actors it reports, and for no others: it cannot take the id
of an actor joined directly and alive here (``id_conflict``), nor report more than the caps allow. That it
really serves those actors the root cannot see; docs/security.md says what follows from that.
Plain records and checks, no sockets: the broker's loop (broker.py) hands it the subtree messages.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from zddrl import protocol as P
from zddrl.broker.membership import Listener, Member, Membership

MAX_RELAY_COUNTERS = 64
"""Counters kept of one relay's report (the first ones, keys of MAX_COUNTER_KEY_CHARS at most): what its status
entry costs is bounded."""
MAX_COUNTER_KEY_CHARS = 64
RELAYS_LISTED = 32
"""Relays listed in the status body (by peer id); ``relays_total`` in ``broker`` counts them all."""
ACCOUNTING = ("received", "forwarded", "in_flight", "upstream_acked", "upstream_in_flight", "upstream_lost")


@dataclass
class RelayView:
    """What the last reports of one relay said."""

    actors: set[str] = field(default_factory=set)
    counters: dict[str, int] = field(default_factory=dict)
    seq: int = -1

    def accounted(self) -> bool:
        """The relay's invariants, from its report: received == forwarded + dropped + in_flight (what it read), and
        forwarded == upstream_acked + upstream_in_flight + upstream_lost (what it sent up: read here and credited,
        sent and not yet credited, or sent in a session that ended before its credit came)."""
        c = self.counters
        dropped = sum(v for k, v in c.items() if k.startswith("dropped_"))
        up = c.get("upstream_acked", 0) + c.get("upstream_in_flight", 0) + c.get("upstream_lost", 0)
        return (
            c.get("received", 0)
            == c.get("forwarded", 0) + dropped + c.get("in_flight", 0)
            == (up + dropped + c.get("in_flight", 0))
        )


class Subtrees(Listener):
    """The relays below one broker and their actors, who are members of its ``membership`` (it listens to it: a relay
    that leaves takes its subtree with it, a relay's new session keeps it). ``refuse(relay, hello, old)`` judges
    a reported actor as its own hello would be judged (joining.Joining.relayed_refused)."""

    def __init__(self, membership: Membership, refuse: Callable[[Member, P.Hello, Member | None], bool]) -> None:
        self.membership = membership
        self.refuse = refuse
        self.relays: dict[str, RelayView] = {}

    def report(self, relay: Member, msg: P.Subtree) -> None:
        """Take a subtree message of the member ``relay`` (ProtocolError if it is no relay)."""
        if relay.role != "relay":
            raise P.ProtocolError(f"subtree: {relay.role} {relay.peer_id} is not a relay")
        view = self.relays.setdefault(relay.peer_id, RelayView())
        view.seq = msg.seq
        kept = ((k, v) for k, v in msg.counters.items() if len(k) <= MAX_COUNTER_KEY_CHARS)
        view.counters = dict(kv for kv, _ in zip(kept, range(MAX_RELAY_COUNTERS)))
        gone = set(msg.left) | (view.actors - set(msg.actors) if msg.full else set())
        for peer_id in gone:
            self._drop(relay, peer_id, f"left relay {relay.peer_id}")
        now = time.monotonic()
        for peer_id, entry in msg.actors.items():
            old = self.membership.get(peer_id)
            if old is not None and old.relay == relay.peer_id and (old.host, old.pid) == (entry["host"], entry["pid"]):
                old.last_seen = now
                continue
            self._take(relay, view, peer_id, entry, old)
        self._versions(relay, msg.versions)

    def _versions(self, relay: Member, versions: dict[str, int]) -> None:
        """Relayed actors' rows show the version they act with, as their relay last heard it."""
        for peer_id, version in versions.items():
            member = self.membership.get(peer_id)
            if member is not None and member.relay == relay.peer_id:
                member.policy_version = version

    def _take(self, relay: Member, view: RelayView, peer_id: str, entry: dict, old: Member | None) -> None:
        """``peer_id`` joins as an actor of ``relay``, unless ``refuse`` says no (another process's live direct
        member, a full fleet, a cap ...)."""
        hello = P.Hello(role="actor", peer_id=peer_id, host=entry["host"], pid=entry["pid"], num_envs=entry["num_envs"])
        if self.refuse(relay, hello, old):
            return
        member = Member(
            peer_id=peer_id,
            role="actor",
            identity=relay.identity,
            host=hello.host,
            pid=hello.pid,
            num_envs=hello.num_envs,
            user=relay.user,
            relay=relay.peer_id,
        )
        if old is not None:
            member.counters = old.counters
        self.membership.admit(member, old)
        view.actors.add(peer_id)

    def _drop(self, relay: Member, peer_id: str, reason: str) -> None:
        member = self.membership.get(peer_id)
        if member is not None and member.relay == relay.peer_id:
            self.membership.remove(member, reason)
        view = self.relays.get(relay.peer_id)
        if view is not None:
            view.actors.discard(peer_id)

    # ---------------------------------------------------------------- membership's events
    def replaced(self, old: Member, new: Member) -> None:
        """A relay's hello from the same process and key as its member ``old`` (a new session after its upstream
        was silent) keeps its subtree, so its actors do not leave and join the fleet again (learners would see them
        go): their credit goes to the new connection, and what the old session's reads left to return is void (the
        relay starts its credit afresh with a welcome). Any other replacement is ``old`` leaving."""
        same = (old.role, old.user, old.host, old.pid) == (new.role, new.user, new.host, new.pid)
        if not (same and old.role == "relay"):
            self.left(old)
            return
        view = self.relays.get(old.peer_id)
        for peer_id in view.actors if view is not None else ():
            actor = self.membership.get(peer_id)
            if actor is not None and actor.relay == new.peer_id:
                actor.identity, actor.unacked = new.identity, 0

    def left(self, member: Member) -> None:
        """``member`` is out of the broker's indexes: a relay takes its whole subtree with it."""
        if member.relay:
            view = self.relays.get(member.relay)
            if view is not None:
                view.actors.discard(member.peer_id)
        elif member.role == "relay":
            view = self.relays.pop(member.peer_id, None)
            for peer_id in sorted(view.actors if view is not None else ()):
                actor = self.membership.get(peer_id)
                if actor is not None and actor.relay == member.peer_id:
                    self.membership.remove(actor, f"its relay {member.peer_id} left")

    def status(self) -> dict[str, Any]:
        """Per relay: its actors, its reported counters and invariants, and what this broker read of it (``read_here``;
        what the relay reports as ``upstream_acked`` is what this broker credited it, at most ``read_here``)."""
        out: dict[str, Any] = {}
        for peer_id, view in sorted(self.relays.items())[:RELAYS_LISTED]:
            relay = self.membership.get(peer_id)
            read = relay.counters["messages"] if relay is not None else 0
            out[peer_id] = {
                "actors": len(view.actors),
                "seq": view.seq,
                **{k: view.counters.get(k, 0) for k in ACCOUNTING},
                "dropped": {k[8:]: v for k, v in view.counters.items() if k.startswith("dropped_") and v},
                "accounted": view.accounted(),
                "read_here": read,
                "counters": view.counters,
            }
        return out

    def accounted(self) -> bool:
        return all(view.accounted() for view in self.relays.values())
