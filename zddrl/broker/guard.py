"""The closed bus inside the broker's loop: who may say what, judged by the key a message came with.

``broker/auth.py`` admits connections (CURVE, ZAP per socket); ``Guard`` judges their messages: a hello's role
is its key's, a peer id belongs to the key that joined with it, a learner's data identity is a secret of its
welcome, a run and a version are signed by the run's learner's own key, and a key removed from the directory is
revoked (routing.py holds a trajectory to the key of the actor it names).
On an open bus (no keys) every check passes. Kept apart from ``broker.py``'s routing: plain records and checks.
"""

from __future__ import annotations

import os
from typing import Any

import zmq

from zddrl import keys
from zddrl import protocol as P
from zddrl.broker.auth import BrokerAuth, is_loopback
from zddrl.broker.membership import Member
from zddrl.brokerconf import BrokerConfig, split_endpoint
from zddrl.tomlconf import ConfigError
from zddrl.transport import signatures as signing

REVOKED_REASON = "this client's key was removed from the broker's key directory (revoked)"


class Guard:
    """The broker's key checks; ``auth`` is None on an open bus (a loopback bind, or ``insecure``)."""

    def __init__(self, config: BrokerConfig, ctx: zmq.Context, log: Any) -> None:
        """Keys, or a loopback bind, or ``insecure`` said out loud: a reachable open bus is never an accident.
        Raises ConfigError (one line) for a bad key directory or a reachable bind without keys."""
        self.auth: BrokerAuth | None = None
        self.pins: dict[str, Any] | None = None
        """The learners' Ed25519 keys that sign runs and versions; None on an open bus."""
        host = split_endpoint(config.bind)[0]
        if config.keys:
            try:  # the pins first: a ZAP thread started before a failure would be left running
                self.pins = keys.pinned_learners(config.keys)
                self.auth = BrokerAuth(ctx, config.keys)
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
