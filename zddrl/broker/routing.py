"""The broker's data path: trajectories in, an outlet out, credit both ways.

``Router`` reads the trajectories socket only while its outlet has credit, checks each message (sender, run,
version) and hands what it admits to the outlet: the learner shards by credit at a root broker (shards.Shards), the
upstream at a relay (upstream.UpstreamOutlet). Each actor's credit goes back once a batch of its trajectories was
read. Every message read is forwarded or dropped with a reason (``dropped``), so ``received == forwarded +
sum(dropped) + in_flight`` always holds. Kept apart from the control plane (broker.py): this is the hot path, one
call per trajectory.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from functools import lru_cache
from typing import Any, Protocol

import zmq

from zddrl import protocol as P
from zddrl.broker.auth import user_of
from zddrl.broker.guard import Guard
from zddrl.broker.membership import Member, Membership
from zddrl.broker.run import CurrentRun
from zddrl.broker.sockets import BrokerSockets, Replies
from zddrl.logs import RateLimitedLog
from zddrl.transport.io import NOBLOCK, recv_frames

DROP_REASONS = ("malformed", "unknown_sender", "forged_sender", "unknown_run", "stale", "unknown_version", "no_route")
FORWARD_BURST = 256
"""Trajectories forwarded per poll wake-up at most (keeps control traffic responsive)."""


@lru_cache(maxsize=FORWARD_BURST)  # an actor's credit of n, encoded once per count
def _credit_frames(n: int) -> list[Any]:
    return P.encode(P.Credit(peer_id="broker", credit=n))


class Outlet(Protocol):
    """Where the router sends what it admitted: the learner shards (shards.Shards) or a relay's upstream."""

    credit: int
    """Trajectories it can take now: the broker reads its trajectories socket only while this is positive."""

    def deliver(self, frames: Sequence[Any], nbytes: int) -> str:
        """Send ``frames`` (``nbytes`` in all) on: "" once sent, else why not (the router drops it: ``no_route``)."""
        ...


class Router:
    """Reads, checks and forwards trajectories to its outlet; owns the drop accounting and the actors' credit."""

    def __init__(
        self,
        sockets: BrokerSockets,
        outlet: Outlet,
        membership: Membership,
        run: CurrentRun,
        guard: Guard,
        replies: Replies,
        counters: dict[str, int],
        max_message_bytes: int,
        ratelog: RateLimitedLog,
    ) -> None:
        self.sockets = sockets
        """Trajectories in on its trajectories socket."""
        self.outlet = outlet
        self.membership = membership
        self.run = run
        self.guard = guard
        self.closed = guard.auth is not None
        self.replies = replies
        """The control socket: actors' credit goes back on it."""
        self.counters = counters
        self.max_message_bytes = max_message_bytes
        self._ratelog = ratelog
        self.dropped: dict[str, int] = {r: 0 for r in DROP_REASONS}
        self.in_flight = 0
        self._decided = 0  # forwarded + dropped, one int: a failure can tell if its message was decided

    def forward(self) -> None:
        """Forward up to FORWARD_BURST trajectories, then return the credit of each actor that has a
        batch of it due, in one message per actor (the rest goes back with the next heartbeats)."""
        due: dict[str, Member] = {}
        batch = self.run.credit_batch
        for _ in range(FORWARD_BURST):
            if self.outlet.credit <= 0:
                break
            try:
                frames = recv_frames(self.sockets.trajectories, NOBLOCK)
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
                actor = self._route(frames, nbytes, user)
            except Exception as exc:  # noqa: BLE001
                # Whatever happens, the message ends up forwarded or dropped with a reason (in_flight balances),
                # and the actor it can be attributed to gets its credit back.
                actor = self.membership.joined_actor(P.claimed_peer_id(frames), user)
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
                if actor.unacked >= batch:
                    due[actor.peer_id] = actor
        for actor in due.values():  # actor-side credit: what was read may be replaced
            self.return_credit(actor)

    def return_credit(self, actor: Member) -> None:
        """Send ``actor`` the credit of what was read from it since the last return."""
        if actor.unacked:
            self.replies.send_frames(actor.identity, _credit_frames(actor.unacked))
            actor.unacked = 0

    def _route(self, frames: Sequence[Any], nbytes: int, user: str) -> Member | None:
        """Forward ``frames`` (sent from the key ``user``) to the outlet, or drop them with a reason.

        Returns the sending actor (if it is a member) so that its credit can be returned."""
        try:  # full validation, but no arrays built: the broker forwards the frames untouched
            msg = P.validate_trajectory(frames, self.max_message_bytes)
        except P.ProtocolError as exc:
            # Charged to the actor it can be attributed to (P.claimed_peer_id: docs/protocol.md section 8), whose
            # credit comes back all the same: an actor whose messages fail (a client bug) must see its drops in
            # `zddrl status`, not stall on lost credit.
            actor = self.membership.joined_actor(P.claimed_peer_id(frames), user)
            self.drop("malformed", actor, f"dropped a malformed trajectory: {exc}")
            return actor
        actor = self.membership.joined_actor(msg["peer_id"])
        # The key an actor joined with, or left with lately: on a closed bus it must be this message's, and a key
        # revoked since is no one's. A forger gets no credit back (it stalls), and nothing reaches a learner.
        owner = actor.user if actor is not None else self.membership.departures.left_with(msg["peer_id"])
        if self.closed and owner is not None and (owner != user or not self.guard.admitted(user)):
            self.drop("forged_sender", None, f"dropped a trajectory naming {msg['peer_id']!r} sent with key {user!r}")
            return None
        if actor is not None:
            actor.last_seen = time.monotonic()
        elif owner is None:
            # Learners keep per-actor figures, which made-up peer ids would grow without bound. An actor
            # the broker forgot (expired, broker restarted) is told to hello again at its next heartbeat.
            self.drop("unknown_sender", None, self._unknown_sender(msg["peer_id"]))
            return None
        # Otherwise an actor that left (bye or expiry) sent it before: it goes on, with no credit to return.
        if actor is not None and actor.relay:  # what this broker read of the relay, beside what the relay reports
            relay = self.membership.get(actor.relay)
            if relay is not None:
                relay.count(nbytes)
        run = self.run
        reason, why = trajectory_refusal(msg, run.run_id, run.policy_version, run.staleness)
        if reason:
            self.drop(reason, actor, why)
            return actor
        why = run.bus.arrays.refusal(msg["arrays"])  # the run's declared arrays (docs/protocol.md section 7.1)
        if why:
            self.drop("malformed", actor, f"dropped a malformed trajectory of {msg['peer_id']}: {why}")
            return actor
        why = self.outlet.deliver(frames, nbytes)
        if why:
            self.drop("no_route", actor, why)
        else:
            self._forwarded(nbytes, actor, msg["env_steps"])
        return actor

    def _unknown_sender(self, peer_id: str) -> str:
        """The log line for a trajectory of ``peer_id``, which no joined actor has: what became of that actor, as far
        as the last departures tell."""
        for row in self.membership.departures.rows(time.monotonic()):
            if row["member"] == peer_id and row["role"] == "actor":
                went = "expired" if row["reason"].startswith("expired") else "left"
                return (
                    f"dropped a trajectory from {peer_id!r}: that actor {went} {row['ago_s']:.0f} s ago "
                    f"({row['reason'].splitlines()[0]}) and has not said hello since; it must, and its link does once "
                    "the broker rejects its next heartbeat"
                )
        return (
            f"dropped a trajectory from {peer_id!r}, which is not an actor that joined with hello (or one that expired "
            "or left a while ago, or joined before this broker restarted: it must say hello again, which its link "
            "does once the broker rejects its next heartbeat)"
        )

    def _forwarded(self, nbytes: int, actor: Member | None, env_steps: int) -> None:
        self._decided += 1
        self.counters["forwarded"] += 1
        self.counters["bytes_out"] += nbytes
        if actor is not None:
            actor.count(nbytes, env_steps)

    def drop(self, reason: str, member: Member | None, text: str) -> None:
        self.dropped[reason] += 1
        self._decided += 1
        if member is not None:
            member.counters[f"dropped_{reason}"] += 1
        self._ratelog.warning(f"drop_{reason}", text)

    def accounted(self) -> bool:
        """received == forwarded + dropped + in_flight: every trajectory read is accounted for."""
        c = self.counters
        return c["received"] == c["forwarded"] + sum(self.dropped.values()) + self.in_flight


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
