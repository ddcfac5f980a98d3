"""The closed bus inside the broker's loop: who may say what, judged by the key a message came with.

``broker/auth.py`` admits connections (CURVE, ZAP per socket); ``Guard`` judges their messages: a hello's role
is its key's, a peer id belongs to the key that joined with it, a trajectory must come from the key of the actor
it names, a new run must be signed by a pinned learner key, and a key removed from the directory is revoked.
On an open bus (no keys) every check passes. Kept apart from ``broker.py``'s routing: plain records and checks.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import zmq

from zddrl import keys
from zddrl import protocol as P
from zddrl.broker.auth import BrokerAuth, is_loopback
from zddrl.broker.membership import LEFT_ACTORS_KEPT, Member
from zddrl.config import BrokerConfig, ConfigError, split_endpoint
from zddrl.transport import signatures as signing

REVOKED = "revoked:"
"""What an actor's peer id is bound to once its key is revoked: no user matches it."""
REVOKED_REASON = "this client's key was removed from the broker's key directory (revoked)"


class Guard:
    """The broker's key checks; ``auth`` is None on an open bus (a loopback bind, or ``insecure``)."""

    def __init__(self, config: BrokerConfig, ctx: zmq.Context, log: Any) -> None:
        """Keys, or a loopback bind, or ``insecure`` said out loud: a reachable open bus is never an accident.
        Raises ConfigError (one line) for a bad key directory or a reachable bind without keys."""
        self.auth: BrokerAuth | None = None
        self.pins: dict[str, Any] | None = None
        """The learners' Ed25519 keys that sign runs and versions; None on an open bus."""
        self._actor_users: OrderedDict[str, str] = OrderedDict()
        """Actor peer id -> the user it joined as, of members and of the last LEFT_ACTORS_KEPT that left (their
        trajectories still in flight count as theirs)."""
        host = split_endpoint(config.bind)[0]
        if config.keys:
            try:
                self.auth = BrokerAuth(ctx, config.keys)
                self.pins = keys.pinned_learners(config.keys)
            except keys.KeysError as exc:
                raise ConfigError(f"broker --keys: {exc}") from None
        elif not is_loopback(host):
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
        """Why this key may not say this hello (its role is the key's; a peer id held by a live member is taken
        over by the same key only), or ""."""
        if self.auth is None:
            return ""
        role = user.partition(":")[0]
        if role != msg.role:
            return f"the key {user!r} is a {role} key: it may not join as {msg.role}"
        if old is not None and old.user != user:
            return f"peer id {msg.peer_id!r} is held by a member that joined with another key"
        return ""

    def run_refusal(self, msg: P.Hello) -> str:
        """Why a learner's new run may not be adopted (not signed by a pinned learner key), or ""."""
        if self.pins is None:
            return ""
        return signing.run_refusal(msg.run_id, msg.run, msg.run_signer, msg.run_signature, self.pins)

    def joined(self, member: Member, members: dict[str, Member]) -> None:
        """An actor joined with its key: its trajectories must come with that key from now on."""
        if self.auth is None or member.role != "actor":
            return
        users = self._actor_users
        users[member.peer_id] = member.user
        users.move_to_end(member.peer_id)
        if len(users) > LEFT_ACTORS_KEPT + len(members):  # forget the oldest that is not a member
            for peer_id in users:
                if peer_id not in members:
                    del users[peer_id]
                    break

    def forged(self, peer_id: str, user: str) -> bool:
        """Whether a trajectory naming ``peer_id`` came with another key than the one that actor joined with."""
        return self.auth is not None and self._actor_users.get(peer_id, user) != user

    def refresh(self) -> frozenset[str]:
        """The users revoked since the last look at the key directory (raises KeysError for a directory that no
        longer reads: the allow-lists stay as they were). Their actors' peer ids match no key from now on."""
        if self.auth is None:
            return frozenset()
        revoked = self.auth.refresh()
        for peer_id, user in self._actor_users.items():
            if user in revoked:
                self._actor_users[peer_id] = REVOKED
        return revoked

    def zap_denied(self) -> int:
        return 0 if self.auth is None else sum(self.auth.allow.denied.values())

    def close(self) -> None:
        if self.auth is not None:
            self.auth.close()


def revoked_reject() -> P.Reject:
    return P.Reject(reason=f"{P.REFUSED_PREFIX}{REVOKED_REASON}")
