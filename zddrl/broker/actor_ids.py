"""Actor ids the broker hands out: the peer id an actor's hello with ``auto_id`` gets (`zddrl actor --actor-id auto`).

The rule (docs/protocol.md section 5.1): the id the hello names, if the process held it before and it is free for
its key; else the lowest id this key held whose holder departed, in its window (a restarted process of a fleet
keeps its id); else the lowest free ``actor-N``. Only a hello that names an id may replace a member whose
connection closed: that member may be a live process whose connection blipped (or every member, after a memory
reset), and its trajectories would be credited to the newcomer. An id is free for a key when no live member
holds it and, on a closed bus, no other key's departure window runs on it (guard.py, rule 3). Ids place seed
streams (actor/host.py ``env_seeds``): the lowest free id keeps a fleet's streams ``0..N-1`` however its
processes start.

A relay cannot hand out ids unique across its tree (its upstream and its sibling relays assign their own), so it
refuses ``auto_id`` (joining.py).
"""

from __future__ import annotations

import time

from zddrl import protocol as P
from zddrl.broker.guard import Claims, Guard
from zddrl.broker.membership import Member, Membership

PREFIX = "actor-"


def actor_number(peer_id: str) -> int | None:
    """N of a canonical ``actor-N`` (no sign, no leading zero), or None."""
    digits = peer_id[len(PREFIX) :] if peer_id.startswith(PREFIX) else ""
    if not digits.isascii() or not digits.isdigit() or (len(digits) > 1 and digits[0] == "0"):
        return None
    return int(digits)


def auto_id_refusal(hello: P.Hello, takes_learners: bool) -> str:
    """Why a hello may not ask for an id, or "": only actors ask, and only a root broker assigns."""
    if hello.role != "actor":
        return f"auto_id is for actors, not for a {hello.role}"
    if not takes_learners:
        return (
            "this broker is a relay: it cannot assign actor ids unique across its tree; give the actors behind a "
            "relay --actor-id N, or connect them to the root broker"
        )
    return ""


class ActorIds:
    """Chooses the id of an actor's ``auto_id`` hello from the members and (closed bus) the keys' claims."""

    def __init__(self, membership: Membership, guard: Guard, claims: Claims) -> None:
        self.membership = membership
        self.guard = guard
        self.claims = claims

    def assign(self, hello: P.Hello, user: str) -> str:
        """The peer id ``hello`` (an actor's, with ``auto_id``), sent with the key ``user``, gets."""
        if actor_number(hello.peer_id) is not None and self._takeable(hello.peer_id, hello, user, named=True):
            return hello.peer_id  # this process's id before a reconnection (or a restarted broker)
        again = [i for i in self._held_by(user) if self._takeable(i, hello, user, named=False)]
        if again:
            return min(again, key=lambda i: actor_number(i) or 0)
        n = 0
        while not self._takeable(f"{PREFIX}{n}", hello, user, named=False):  # ends: finitely many ids are taken
            n += 1
        return f"{PREFIX}{n}"

    def _held_by(self, user: str) -> list[str]:
        """Actor ids ``user``'s key held whose holder departed (left or expired) within its window. Not a member's
        whose connection closed: a connection blip, or a memory reset, sets that on live processes, and their
        trajectories still name the id. None on an open bus: there a dead process's id is free once it expired."""
        if not user:
            return []
        return [i for i in self.claims.held_by(user, time.monotonic()) if actor_number(i) is not None]

    def _takeable(self, peer_id: str, hello: P.Hello, user: str, named: bool) -> bool:
        """Whether ``peer_id`` is free for ``user``. A member holds it: only if ``hello`` named it (``named``: the
        process says it held it) and the member is of the same key and is this very process (same host and pid)
        or its connection closed (a reconnecting process). A hello that names no id never replaces a member."""
        old: Member | None = self.membership.get(peer_id)
        if old is not None:
            if not named or old.relay or old.user != user:
                return False
            return old.conn_closed or (old.host, old.pid) == (hello.host, hello.pid)
        return not self.guard.window_refusal(peer_id, user, None, self.claims)
