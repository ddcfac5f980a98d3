"""The learner shards as the broker serves them: the members on the learners socket (learner shards and replay
services), the credit they grant, the versions they publish, and the fleet messages they get.

At a root broker ``Shards`` is the router's outlet (routing.Outlet): each admitted trajectory goes to the shard
with the most credit left. It follows membership (a listener), so a shard that leaves takes its credit with it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from operator import attrgetter
from typing import Any

import zmq

from zddrl import protocol as P
from zddrl.broker.guard import Guard
from zddrl.broker.membership import Listener, Member
from zddrl.broker.publisher import Publish
from zddrl.broker.roster import Roster
from zddrl.broker.run import CurrentRun
from zddrl.broker.sockets import BrokerSockets, Replies
from zddrl.logs import RateLimitedLog
from zddrl.transport.io import send_frames

DATA_ROLES = ("learner", "replay")
"""The roles that take trajectories on the learners socket by credit: learner shards, and replay services (which
take a replay run's data in place of its learner, docs/protocol.md section 5.9)."""
MAX_CREDIT = 1 << 20
"""Most credit one message may grant."""
_CREDIT = attrgetter("credit")


class Shards(Listener):
    """``on_message`` for each message of the learners socket; ``deliver`` (the outlet); ``announce`` the fleet."""

    def __init__(
        self,
        sockets: BrokerSockets,
        control: Replies,
        current: CurrentRun,
        roster: Roster,
        guard: Guard,
        publish: Publish,
        counters: dict[str, int],
        ratelog: RateLimitedLog,
    ) -> None:
        self.sockets = sockets
        """Trajectories out on its learners socket."""
        self.replies = Replies(sockets, "learners", counters)
        """Rejects on the learners socket."""
        self.control = control
        """Fleet messages, on the control socket."""
        self.current = current
        self.roster = roster
        self.guard = guard
        self.publish = publish
        self.counters = counters
        self._ratelog = ratelog
        self.shards: dict[str, Member] = {}
        """The learner (and replay) members, by peer id."""
        self.by_data_id: dict[bytes, Member] = {}
        """The same, by the identity of their data DEALER (``Member.data_id``)."""
        self.credit = 0
        """Sum of the shards' credit: the broker reads trajectories only while it is positive."""

    # ---------------------------------------------------------------- membership's events
    def joined(self, member: Member) -> None:
        if member.role in DATA_ROLES:
            self.shards[member.peer_id] = member
            self.by_data_id[member.data_id] = member
            self.credit += member.credit

    def left(self, member: Member) -> None:
        """A shard left: its outstanding credit leaves the total with it."""
        if self.shards.get(member.peer_id) is member:
            del self.shards[member.peer_id]
            self.by_data_id.pop(member.data_id, None)
            self.credit -= member.credit

    # ---------------------------------------------------------------- the learners socket
    def on_message(self, identity: bytes, msg: P.Message, frames: Sequence[Any], user: str) -> None:
        """One decoded message of the learners socket from ``identity`` (its data DEALER's: a secret of its welcome
        on a closed bus) and the key ``user``: credit, or a version's message (ProtocolError for anything else)."""
        member = self.by_data_id.get(identity)
        if member is not None and member.user != user:  # the identity of a learner, taken by another key
            self.counters["auth_refused"] += 1
            member = None
        if member is None:
            self.replies.send(identity, P.Reject(reason="unknown learner: send hello first", rehello=True))
            return
        member.last_seen = time.monotonic()
        if isinstance(msg, P.Credit):
            if msg.credit <= 0 or msg.credit > MAX_CREDIT:
                raise P.ProtocolError(f"credit must be in 1..2**20, got {msg.credit}")
            if member.run_id == self.current.run_id:  # credit of another run's learner is not for this run's data
                self.set_credit(member, member.credit + msg.credit)
            else:
                self.counters["credit_other_run"] += 1
        elif isinstance(msg, (P.Parameters, P.ParamChunk)) and member.role == "replay":
            raise P.ProtocolError(f"a replay service publishes no parameters ({member.peer_id} sent {msg.KIND})")
        elif isinstance(msg, (P.Parameters, P.ParamChunk)):
            why = self.guard.params_refusal(msg, user, self.current.seal[0]) if isinstance(msg, P.Parameters) else ""
            if why:  # its chunks find no head to join: counted as orphans by the publisher
                self.counters["params_signature"] += 1
                self._ratelog.warning("params_signature", f"dropped a parameter version of {member.peer_id}: {why}")
            elif self.publish(msg, frames):
                member.policy_version = self.current.policy_version
        else:
            raise P.ProtocolError(f"{msg.KIND} is not a learner-socket message")

    # ---------------------------------------------------------------- credit and the outlet
    def set_credit(self, shard: Member, credit: int) -> None:
        """Every change of a shard's credit goes through here, so the running total stays exact."""
        self.credit += credit - shard.credit
        shard.credit = credit

    def follow_run(self, run_id: str) -> None:
        """A new run: an old run's learner must never be fed the new run's data; a replay service follows the run,
        from zero credit (it grants again once re-welcomed)."""
        for shard in self.shards.values():
            if shard.role == "replay":
                shard.run_id = run_id
                self.set_credit(shard, 0)
            elif shard.run_id != run_id:
                self.set_credit(shard, 0)

    def deliver(self, frames: Sequence[Any], nbytes: int) -> str:
        """Send an admitted trajectory to the shard with the most credit; "" once sent."""
        while True:
            shard = max(self.shards.values(), key=_CREDIT, default=None)
            if shard is None or shard.credit <= 0:
                return "dropped a trajectory: no learner shard can take it"
            try:
                send_frames(self.sockets.learners, frames, prefix=shard.data_id)
            except zmq.ZMQError as exc:  # the shard went away between credit and send
                self._ratelog.warning(
                    "shard_gone", f"learner shard {shard.peer_id} unreachable ({exc}); its credit is withdrawn"
                )
                self.set_credit(shard, 0)
                continue
            self.set_credit(shard, shard.credit - 1)
            shard.count(nbytes)
            return ""

    # ---------------------------------------------------------------- the fleet
    def announce(self, now: float) -> None:
        """At loop level, at most once per FLEET_COALESCE_S: every learner of the run that has not got the
        current fleet gets it (nothing goes out if the map came back to what was announced)."""
        self.roster.announce(now)
        for shard in self.shards.values():
            if shard.run_id == self.current.run_id and shard.fleet_seq != self.roster.seq:
                self.send_fleet(shard)

    def send_fleet(self, shard: Member) -> None:
        """The last announced fleet to ``shard`` (after its welcome; a change pending follows within
        FLEET_COALESCE_S)."""
        self.control.send_frames(shard.identity, self.roster.frames(self.current.run_id))
        shard.fleet_seq = self.roster.seq
        self.counters["fleet_sent"] += 1
