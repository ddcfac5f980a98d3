"""The closed bus inside the broker's loop: who may say what, judged by the key a message came with.

``broker/auth.py`` admits connections (CURVE, ZAP per socket); ``Guard`` judges their messages: a hello's role
is its key's, a peer id belongs to a key (``Claims``, below), a learner's data identity is a secret of its
welcome, a run and a version are signed by the run's learner's own key, and a key removed from the directory is
revoked (routing.py holds a trajectory to the key of the actor it names).
On an open bus (no keys) every check passes. Kept apart from ``broker.py``'s routing: plain records and checks.

Peer ids belong to keys (docs/security.md, "Peer ids and keys"):

1. **An id names its role.** An id that starts with a role's prefix (``actor-``, ``learner-``, ``monitor-``,
   ``relay-``, ``replay-``: ``ID_PREFIXES``) may be claimed by keys of that role only: an actor or monitor key
   never holds ``learner-0``. A monitor key claims ``monitor-`` ids only: a monitor has its own session and no
   member id beyond it. Ids of no role's prefix (zddrl never makes one) belong to the first key that holds them.
2. **The key that held an id takes it back at once.** A live member's id is taken over by the same key only; the
   same key's new process is admitted at once when the old one's control connection has closed (a socket monitor
   sees a killed process's connection close within milliseconds: ``Claims.connection_closed``), or after two
   heartbeat intervals of silence (a host that vanished sends no close; ``membership.id_conflict``). Its old session
   is replaced.
3. **No other key takes an id until its holder's departure window ends**: while the holder is a member whose
   connection closed, and for ``grace_s`` (heartbeat interval x liveness, the grace in which its trajectories
   still count as its own) after it left. Such a hello gets a reject that is not final (the client asks again
   at its next heartbeat), counted as ``auth_refused``. A monitor's or a relayed actor's departure reserves
   nothing (a relay speaks for its actors, which move between relays); a revoked key's reservations end with it.
4. **Caps per key** (``limits.MAX_MEMBERS_PER_KEY``), not per reported host name.
"""

from __future__ import annotations

import os
import time
from collections import Counter, OrderedDict
from typing import Any

import zmq

from zddrl import keys
from zddrl import protocol as P
from zddrl.broker.auth import BrokerAuth, is_loopback
from zddrl.broker.membership import Listener, Member, Membership
from zddrl.brokerconf import BrokerConfig, is_ipc, split_endpoint
from zddrl.tomlconf import ConfigError
from zddrl.transport import signatures as signing

REVOKED_REASON = "this client's key was removed from the broker's key directory (revoked)"
ID_PREFIXES = {role: f"{role}-" for role in P.ROLES}
"""An id that starts with one of these belongs to that role: only its keys may claim it (closed bus)."""
HELD_KEPT = 16_384
"""Departed holders remembered at most (those whose window ended are forgotten first): more than all the members
the broker admits, so one key's churn of ids cannot push another key's reservation out."""


class Guard:
    """The broker's key checks; ``auth`` is None on a bus without keys (a local ``ipc://`` bus, which its
    directory's mode closes; a loopback bind; or ``insecure``)."""

    def __init__(self, config: BrokerConfig, ctx: zmq.Context, log: Any, key: str | None = None) -> None:
        """Keys, or a loopback bind, or ``insecure`` said out loud: a reachable open bus is never an accident.
        ``key``: the name of the broker's own pair in ``broker/`` (needed when it holds several secrets).
        Raises ConfigError (one line) for a bad key directory or a reachable bind without keys."""
        self.auth: BrokerAuth | None = None
        self.pins: dict[str, Any] | None = None
        """The learners' Ed25519 keys that sign runs and versions; None on an open bus."""
        host = "" if is_ipc(config.bind) or not config.bind else split_endpoint(config.bind)[0]
        if config.keys:
            try:  # the pins first: a ZAP thread started before a failure would be left running
                self.pins = keys.pinned_learners(config.keys)
                self.auth = BrokerAuth(ctx, config.keys, key)
            except keys.KeysError as exc:
                raise ConfigError(f"broker --keys: {exc}") from None
        elif host and not is_loopback(host):
            if not config.insecure:
                raise ConfigError(
                    f"broker: binding {host} without keys would let anyone who reaches it join, inject, read and "
                    "exhaust the bus; make keys (zddrl keys new broker NAME, docs/security.md) and pass --keys DIR, "
                    "or bind 127.0.0.1, or pass --insecure"
                )
            log.warning(
                f"INSECURE: bound on {host} with no keys: anyone who can reach these ports can join as any role, "
                "push trajectories, publish parameters and read everything (docs/security.md)"
            )

    def admitted(self, user: str) -> bool:
        """Whether a message's key is allowed now (a key revoked after its connection was admitted is not)."""
        return self.auth is None or user in self.auth.users

    def hello_refusal(self, msg: P.Hello, user: str, old: Member | None) -> str:
        """Why this key may never say this hello (its role is the key's; an id of another role; a peer id a live,
        connected member of another key holds), or "": final refusals."""
        if self.auth is None:
            return ""
        role = user.partition(":")[0]
        if role != msg.role:
            return f"the key {user!r} is a {role} key: it may not join as {msg.role}"
        why = id_refusal(role, msg.peer_id)
        if why:
            return why
        if old is not None and old.user != user and not old.conn_closed:
            return f"peer id {msg.peer_id!r} is held by a member that joined with another key"
        return ""

    def window_refusal(self, peer_id: str, user: str, old: Member | None, claims: Claims) -> str:
        """Why ``user`` may not take ``peer_id`` yet: its holder's departure window (another key's) runs, or "".
        Not final: the client asks again."""
        if self.auth is None or (old is not None and old.user == user):
            return ""
        now = time.monotonic()
        if old is not None:
            if not old.conn_closed:  # a live member: hello_refusal's (or, for a relay's report, joining's) to judge
                return ""
            left_s = claims.window_left(old, now)
        else:
            held = claims.reserved_for(peer_id, now)
            if held is None or held[0] == user or held[0] not in self.auth.users:
                return ""
            left_s = held[1]
        return (
            f"peer id {peer_id!r} stays its last holder's key's until that member's departure window ends "
            f"(in about {left_s:.1f} s); asking again"
        )

    def relayed_refusal(self, relay: Member, peer_id: str, direct: Member | None, claims: Claims) -> str:
        """Why ``relay``'s key may not report an actor ``peer_id`` (an id of another role, or the departure window
        of a direct member's other key), or ""."""
        if self.auth is None:
            return ""
        return id_refusal("actor", peer_id) or self.window_refusal(peer_id, relay.user, direct, claims)

    def data_id(self, member: Member, old: Member | None) -> bytes:
        """The identity ``member``'s data DEALER is to use on the learners socket: its peer id on an open bus; on a
        closed bus a random secret, sent only in its (encrypted) welcome, so that no other key can take its
        trajectories by connecting with a known identity (ROUTER_HANDOVER hands it over to whoever asks). A
        re-hello of the same key keeps it: the shard's data socket goes on."""
        if self.auth is None:
            return member.peer_id.encode()
        if old is not None and old.user == member.user and old.data_id:
            return old.data_id
        return os.urandom(P.DATA_IDENTITY_BYTES)

    def run_refusal(self, msg: P.Hello, user: str) -> str:
        """Why a learner's new run may not be adopted (not signed by a pinned learner key, or signed with another
        key than the one this learner joined with), or ""."""
        if self.pins is None:
            return ""
        if user != f"learner:{msg.run_signer}":
            return f"signed by {msg.run_signer!r}, not by the key of the learner announcing it ({user!r})"
        return signing.run_refusal(msg.run_id, msg.run, msg.run_signer, msg.run_signature, self.pins)

    def params_refusal(self, msg: P.Parameters, user: str, run_signer: str) -> str:
        """Why a version's head may not be taken from the key ``user`` (closed bus): it must be signed with that
        key, the run's learner's (the signature itself is checked by the publisher with the pins), or ""."""
        if self.auth is None or (user == f"learner:{msg.signer}" and msg.signer == run_signer):
            return ""
        return f"signed by {msg.signer!r}, sent with the key {user!r}; the run's learner signs as {run_signer!r}"

    def refresh(self) -> frozenset[str]:
        """The users revoked since the last look at the key directory (raises KeysError for a directory that no
        longer reads: the allow-lists stay as they were)."""
        return frozenset() if self.auth is None else self.auth.refresh()

    def zap_denied(self) -> int:
        return 0 if self.auth is None else self.auth.allow.denied

    def close(self) -> None:
        if self.auth is not None:
            self.auth.close()


def revoked_reject() -> P.Reject:
    return P.Reject(reason=f"{P.REFUSED_PREFIX}{REVOKED_REASON}")


def id_role(peer_id: str) -> str:
    """The role whose prefix ``peer_id`` carries, or "" for an id of no role's."""
    for role, prefix in ID_PREFIXES.items():
        if peer_id.startswith(prefix):
            return role
    return ""


def id_refusal(role: str, peer_id: str) -> str:
    """Why a key of ``role`` may not claim ``peer_id`` (rule 1 above), or ""."""
    owner = id_role(peer_id)
    if role == "monitor" and owner != "monitor":
        return f"a monitor key claims monitor ids only ({ID_PREFIXES['monitor']}...), not {peer_id!r}"
    if owner and owner != role:
        return f"peer id {peer_id!r} is a {owner}'s: a {role} key may not claim it"
    return ""


class Claims(Listener):
    """What the rules above need to know, kept as a membership listener: each key's members (the caps), the
    departed holders' keys (the windows) and the control connection of each direct member (its file descriptor,
    for rule 2). On an open bus members have no key and no descriptor: it holds nothing."""

    def __init__(self, membership: Membership) -> None:
        self.membership = membership
        self._held: OrderedDict[str, tuple[float, str]] = OrderedDict()
        """Peer id -> (monotonic time its holder left, the holder's key), oldest first."""
        self._by_fd: dict[int, Member] = {}
        """File descriptor of a direct member's control connection -> that member."""
        self._per_key: Counter[str] = Counter()
        """Key (``Member.user``) -> its members now (a relayed actor counts for its relay's key)."""

    @property
    def grace_s(self) -> float:
        """How long a departed holder's key keeps its id: the departures' grace (liveness.Liveness sets it)."""
        return self.membership.departures.grace_s

    def of_key(self, user: str) -> int:
        """Members joined with the key ``user`` now."""
        return self._per_key.get(user, 0)

    def reserved_for(self, peer_id: str, now: float) -> tuple[str, float] | None:
        """(the key, seconds left) of ``peer_id``'s departure window, if one runs now; else None."""
        held = self._held.get(peer_id)
        if held is None or now - held[0] > self.grace_s:
            return None
        return held[1], held[0] + self.grace_s - now

    def held_by(self, user: str, now: float) -> list[str]:
        """The departed ids whose window runs for the key ``user`` now (an auto id prefers them: actor_ids.py)."""
        return [peer_id for peer_id, (since, key) in self._held.items() if key == user and now - since <= self.grace_s]

    def window_left(self, holder: Member, now: float) -> float:
        """Seconds until the window of a member whose connection closed ends: its expiry, then the grace."""
        return max(0.0, holder.last_seen + 2 * self.grace_s - now)

    def connection_closed(self, fd: int) -> None:
        """The control connection on ``fd`` closed: its member's process is gone (or its link reconnects: then it
        says hello again from its new connection)."""
        member = self._by_fd.pop(fd, None)
        if member is not None:
            member.conn_closed = True

    # ---------------------------------------------------------------- membership's events
    def joined(self, member: Member) -> None:
        if member.user:
            self._per_key[member.user] += 1
        if member.conn_fd >= 0:
            stale = self._by_fd.get(member.conn_fd)
            if stale is not None and stale is not member:  # the descriptor was reused: that connection is gone
                stale.conn_closed = True
            self._by_fd[member.conn_fd] = member
        self._held.pop(member.peer_id, None)  # a live member holds it now

    def left(self, member: Member) -> None:
        if member.user:
            self._per_key[member.user] -= 1
            if self._per_key[member.user] <= 0:
                del self._per_key[member.user]
        if member.conn_fd >= 0 and self._by_fd.get(member.conn_fd) is member:
            del self._by_fd[member.conn_fd]

    def departed(self, member: Member, reason: str) -> None:
        if not member.user or member.relay or member.role == "monitor":
            return
        if self.membership.get(member.peer_id) is not None:  # replaced: its new session holds the id
            return
        now = time.monotonic()
        self._held[member.peer_id] = (now, member.user)
        self._held.move_to_end(member.peer_id)
        while self._held:  # oldest first: those past their window, and any past the bound
            since = next(iter(self._held.values()))[0]
            if len(self._held) <= HELD_KEPT and now - since <= self.grace_s:
                break
            self._held.popitem(last=False)
