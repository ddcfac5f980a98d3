"""The broker's data path: trajectories in, learner shards out, credit both ways.

The broker reads the trajectories socket only while some learner shard has credit (``credit`` > 0) and sends
each message to the shard with the most credit left; each actor's credit goes back once a batch of its
trajectories was read. Every message read is forwarded or dropped with a reason (``dropped``), so
``received == forwarded + sum(dropped) + in_flight`` always holds. Kept apart from the control plane
(broker.py): this is the hot path, one call per trajectory.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from functools import lru_cache
from operator import attrgetter
from typing import Any, NamedTuple

import zmq

from zddrl import protocol as P
from zddrl.broker.auth import user_of
from zddrl.broker.guard import Guard
from zddrl.broker.membership import Departures, Member, trajectory_refusal
from zddrl.logs import RateLimitedLog
from zddrl.transport.io import NOBLOCK, recv_frames, send_frames

DROP_REASONS = ("malformed", "unknown_sender", "forged_sender", "unknown_run", "stale", "unknown_version", "no_route")
DATA_ROLES = ("learner", "replay")
"""The roles that take trajectories on the learners socket by credit: learner shards, and replay services (which
take a replay run's data in place of its learner, docs/protocol.md section 5.9)."""
FORWARD_BURST = 256
"""Trajectories forwarded per poll wake-up at most (keeps control traffic responsive)."""
_CREDIT = attrgetter("credit")


@lru_cache(maxsize=FORWARD_BURST)  # an actor's credit of n, encoded once per count
def _credit_frames(n: int) -> list[Any]:
    return P.encode(P.Credit(peer_id="broker", credit=n))


class RunRoute(NamedTuple):
    """What routing needs of the current run (the broker's, passed per burst)."""

    run_id: str
    latest: int
    """The newest published version."""
    staleness: int
    """The run's max_staleness (checked once, from the run spec in the learner's hello)."""
    credit_batch: int
    """An actor's credit goes back once this many of its trajectories were read (membership.credit_batch_of)."""


class Router:
    """Forwards trajectories to learner shards by credit; owns the shards' credit and the drop accounting."""

    def __init__(
        self,
        trajectories: zmq.Socket,
        learners: zmq.Socket,
        members: dict[str, Member],
        counters: dict[str, int],
        departures: Departures,
        guard: Guard,
        send_control: Callable[[bytes, Sequence[Any]], None],
        max_message_bytes: int,
        ratelog: RateLimitedLog,
    ) -> None:
        self.trajectories, self.learners = trajectories, learners
        self.members = members
        """The broker's members (read only here)."""
        self.counters = counters
        self.departures = departures
        self.guard = guard
        self.closed = guard.auth is not None
        self._send_control = send_control
        self.max_message_bytes = max_message_bytes
        self._ratelog = ratelog
        self.shards: dict[str, Member] = {}
        """The learner members, by peer id."""
        self.by_data_id: dict[bytes, Member] = {}
        """The same, by the identity of their data DEALER (``Member.data_id``)."""
        self.credit = 0
        """Sum of the shards' credit: the broker reads trajectories only while it is positive."""
        self.dropped: dict[str, int] = {r: 0 for r in DROP_REASONS}
        self.in_flight = 0
        self._decided = 0  # forwarded + dropped, one int: a failure can tell if its message was decided

    def add_shard(self, shard: Member) -> None:
        self.shards[shard.peer_id] = shard
        self.by_data_id[shard.data_id] = shard
        self.credit += shard.credit

    def remove_shard(self, shard: Member) -> None:
        """A shard left: its outstanding credit leaves the total with it."""
        if self.shards.pop(shard.peer_id, None) is not None:
            self.by_data_id.pop(shard.data_id, None)
            self.credit -= shard.credit

    def forward(self, run: RunRoute) -> None:
        """Forward up to FORWARD_BURST trajectories, then return the credit of each actor that has a
        batch of it due, in one message per actor (the rest goes back with the next heartbeats)."""
        due: dict[str, Member] = {}
        for _ in range(FORWARD_BURST):
            if self.credit <= 0:
                break
            try:
                frames = recv_frames(self.trajectories, NOBLOCK)
            except zmq.Again:
                break
            self.in_flight += 1
            self.counters["received"] += 1
            nbytes = sum(map(len, frames))
            self.counters["bytes_in"] += nbytes
            decided = self._decided
            actor = None
            user = user_of(frames[0]) if self.closed else ""
            try:
                actor = self._route(frames, nbytes, user, run)
            except Exception as exc:  # noqa: BLE001
                # Whatever happens, the message ends up forwarded or dropped with a reason (in_flight balances),
                # and the actor it can be attributed to gets its credit back.
                actor = self.joined_actor(P.claimed_peer_id(frames), user)
                if self._decided == decided:
                    self.drop(
                        "malformed",
                        actor,
                        f"dropped a trajectory: error while routing it ({type(exc).__name__}: {exc})",
                    )
            finally:
                self.in_flight -= 1
            if actor is not None:
                actor.unacked += 1
                if actor.unacked >= run.credit_batch:
                    due[actor.peer_id] = actor
        for actor in due.values():  # actor-side credit: what was read may be replaced
            self.return_credit(actor)

    def return_credit(self, actor: Member) -> None:
        """Send ``actor`` the credit of what was read from it since the last return."""
        if actor.unacked:
            self._send_control(actor.identity, _credit_frames(actor.unacked))
            actor.unacked = 0

    def _route(self, frames: Sequence[Any], nbytes: int, user: str, run: RunRoute) -> Member | None:
        """Forward ``frames`` (sent from the key ``user``) to the shard with the most credit, or drop them with a
        reason.

        Returns the sending actor (if it is a member) so that its credit can be returned."""
        try:  # full validation, but no arrays built: the broker forwards the frames untouched
            msg = P.validate_trajectory(frames, self.max_message_bytes)
        except P.ProtocolError as exc:
            # Charged to the actor it can be attributed to (P.claimed_peer_id: docs/protocol.md section 8), whose
            # credit comes back all the same: an actor whose messages fail (a client bug) must see its drops in
            # `zddrl status`, not stall on lost credit.
            actor = self.joined_actor(P.claimed_peer_id(frames), user)
            self.drop("malformed", actor, f"dropped a malformed trajectory: {exc}")
            return actor
        actor = self.joined_actor(msg["peer_id"])
        # The key an actor joined with, or left with lately: on a closed bus it must be this message's, and a key
        # revoked since is no one's. A forger gets no credit back (it stalls), and nothing reaches a learner.
        owner = actor.user if actor is not None else self.departures.left_with(msg["peer_id"])
        if self.closed and owner is not None and (owner != user or not self.guard.admitted(user)):
            self.drop("forged_sender", None, f"dropped a trajectory naming {msg['peer_id']!r} sent with key {user!r}")
            return None
        if actor is not None:
            actor.last_seen = time.monotonic()
        elif owner is None:
            # Learners keep per-actor figures, which made-up peer ids would grow without bound. An actor
            # the broker forgot (expired, broker restarted) is told to hello again at its next heartbeat.
            self.drop(
                "unknown_sender",
                None,
                f"dropped a trajectory from {msg['peer_id']!r}, which is not an actor that joined with hello",
            )
            return None
        # Otherwise an actor that left (bye or expiry) sent it before: it goes on, with no credit to return.
        # The staleness bound was read (and checked) once, from the run spec in the learner's hello.
        if actor is not None and actor.relay:  # what this broker read of the relay, beside what the relay reports
            relay = self.members.get(actor.relay)
            if relay is not None:
                relay.count(nbytes)
        reason, why = trajectory_refusal(msg, run.run_id, run.latest, run.staleness)
        if reason:
            self.drop(reason, actor, why)
            return actor
        self._deliver(frames, nbytes, actor, msg["env_steps"])
        return actor

    def _deliver(self, frames: Sequence[Any], nbytes: int, actor: Member | None, env_steps: int) -> None:
        """Send an admitted trajectory to the shard with the most credit, or drop it (``no_route``)."""
        while True:
            shard = max(self.shards.values(), key=_CREDIT, default=None)
            if shard is None or shard.credit <= 0:
                self.drop("no_route", actor, "dropped a trajectory: no learner shard can take it")
                return
            try:
                send_frames(self.learners, frames, prefix=shard.data_id)
            except zmq.ZMQError as exc:  # the shard went away between credit and send
                self._ratelog.warning(
                    "shard_gone", f"learner shard {shard.peer_id} unreachable ({exc}); its credit is withdrawn"
                )
                self.set_credit(shard, 0)
                continue
            self.set_credit(shard, shard.credit - 1)
            shard.count(nbytes)
            self.forwarded(nbytes, actor, env_steps)
            return

    def forwarded(self, nbytes: int, actor: Member | None, env_steps: int) -> None:
        """Count one trajectory sent on (to a shard, or upstream by a relay)."""
        self._decided += 1
        self.counters["forwarded"] += 1
        self.counters["bytes_out"] += nbytes
        if actor is not None:
            actor.count(nbytes, env_steps)

    def joined_actor(self, peer_id: str | None, user: str | None = None) -> Member | None:
        """The actor member ``peer_id`` (if ``user`` is given: only if it joined with that key)."""
        member = self.members.get(peer_id) if peer_id is not None else None
        if member is None or member.role != "actor" or (user is not None and member.user != user):
            return None
        return member

    def set_credit(self, shard: Member, credit: int) -> None:
        """Every change of a shard's credit goes through here, so the running total stays exact."""
        self.credit += credit - shard.credit
        shard.credit = credit

    def drop(self, reason: str, member: Member | None, text: str) -> None:
        self.dropped[reason] += 1
        self._decided += 1
        if member is not None:
            member.counters[f"dropped_{reason}"] += 1
        self._ratelog.warning(f"drop_{reason}", text)
