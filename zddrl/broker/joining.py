"""Who may join the broker and what they are told: actors given ids (``assigned``), hellos judged (``refused``), the
member a hello makes put in the place of its peer id's earlier session (``admit``), a relay's actors judged as their
hellos would be (``relayed_refused``), and welcomes (``welcome``). The broker (broker.py) runs the conversation in
this order and starts a new run in between (``Broker.start_run``).
"""

from __future__ import annotations

import dataclasses
import time

from zddrl import protocol as P
from zddrl.broker.actor_ids import ActorIds, auto_id_refusal
from zddrl.broker.cadence import Cadence
from zddrl.broker.guard import Claims, Guard
from zddrl.broker.limits import Limits
from zddrl.broker.membership import Member, Membership, id_conflict
from zddrl.broker.run import CurrentRun
from zddrl.broker.shards import DATA_ROLES
from zddrl.broker.sockets import Replies
from zddrl.broker.standby import Standby
from zddrl.brokerconf import BrokerConfig
from zddrl.logs import RateLimitedLog

REFUSED_LEARNER = "a relay takes no learners or replays: connect them to the root broker"


class Joining:
    """The hello/welcome side of a broker. ``takes_learners`` is False at a relay: the data's end is at the root."""

    def __init__(
        self,
        config: BrokerConfig,
        membership: Membership,
        current: CurrentRun,
        guard: Guard,
        limits: Limits,
        cadence: Cadence,
        ports: dict[str, int],
        replies: Replies,
        counters: dict[str, int],
        ratelog: RateLimitedLog,
        claims: Claims,
        takes_learners: bool = True,
        standby: Standby | None = None,
    ) -> None:
        self.config = config
        self.membership = membership
        self.current = current
        self.guard = guard
        self.limits = limits
        self.cadence = cadence
        self.ports = {k: v for k, v in ports.items() if k != "control"}
        """The data ports every welcome names."""
        self.replies = replies
        self.counters = counters
        self._ratelog = ratelog
        self.claims = claims
        """Which key holds which peer id (closed bus; guard.py's rules)."""
        self.takes_learners = takes_learners
        self.actor_ids = ActorIds(membership, guard, claims)
        """The ids of actors that ask for one (``auto_id``)."""
        self.standby = standby
        """The standby pair this broker is one of (``broker.peer``); None: it always takes clients."""

    def assigned(self, identity: bytes, msg: P.Hello, user: str) -> P.Hello | None:
        """``msg`` with the peer id the broker assigns if it asks for one (``auto_id``: actor_ids.py), else ``msg``;
        None if it may not ask (answered with a final reject, counted as ``auto_id_refused``): not an actor, or this
        broker is a relay."""
        if not msg.auto_id:
            return msg
        why = auto_id_refusal(msg, self.takes_learners)
        if why:
            self._refuse(identity, msg, "auto_id_refused", why)
            return None
        if self.standby is not None and not self.standby.admits():  # cheap refusals first (a knock: voter rule)
            self._passive(identity, msg, self.standby)
            return None
        if self._over_rate(identity):  # refused() does not count this hello again
            return None
        return dataclasses.replace(msg, peer_id=self.actor_ids.assign(msg, user))

    def starts_run(self, msg: P.Hello) -> bool:
        """Whether ``msg`` (admitted) is a learner's announcement of a run other than the current one."""
        return msg.role == "learner" and bool(msg.run_id) and msg.run_id != self.current.run_id and msg.run is not None

    def refused(self, identity: bytes, msg: P.Hello, user: str) -> bool:
        """Whether the hello is refused (answered with a reject that says why, counted by reason): a learner at a
        relay, over its connection's hello rate, another key's role or peer id, a conflict (``hello_conflict``:
        ProtocolError, counted as malformed), a member cap, or a new run no pinned learner key signed. Every
        refusal is final but two: an id in another key's departure window, and an id whose holder's heartbeat is late
        (``id_conflict``); the client asks again later. A passive
        broker of a standby pair refuses every hello but a monitor's with a ``passive:`` reject (``hello_passive``):
        the client moves on to its peer."""
        if self.standby is not None and msg.role != "monitor" and not self.standby.admits():  # a knock: voter rule
            return self._passive(identity, msg, self.standby)
        if not self.takes_learners and msg.role in DATA_ROLES:
            return self._refuse(identity, msg, "learner_refused", REFUSED_LEARNER)
        if not msg.auto_id and self._over_rate(identity):  # an auto_id hello's rate was checked in assigned()
            return True
        old = self.membership.get(msg.peer_id)
        roster = self.membership.roster
        room = msg.role != "actor" or roster.room_for(msg.peer_id, msg.num_envs, msg.host)
        why = hello_conflict(msg, room, self.current.run_id)
        if why:
            self.replies.send(identity, P.Reject(reason=f"{P.REFUSED_PREFIX}{why}"))
            raise P.ProtocolError(why)
        counter, why = "auth_refused", self.guard.hello_refusal(msg, user, old)  # first: a stranger learns no more
        if not why:
            counter, (why, final) = "hello_id_in_use", id_conflict(old, msg, self.cadence.keeping_s(time.monotonic()))
            if why and not final:
                return self._refuse(identity, msg, counter, why, final=False)
        if not why:
            wait = self.guard.window_refusal(msg.peer_id, user, old, self.claims)
            if wait:
                return self._refuse(identity, msg, "auth_refused", wait, final=False)
        if not why:
            counter, why = "hello_over_cap", self._cap_refusal(msg, old, user)
        if not why and self.starts_run(msg):
            counter, why = "runs_refused", self.guard.run_refusal(msg, user)
            why = f"run spec {why}" if why else ""
        return bool(why) and self._refuse(identity, msg, counter, why)

    def _over_rate(self, identity: bytes) -> bool:
        """Whether a hello is over its connection's hello rate: dropped and counted (its link asks again)."""
        if self.limits.hello.allow(identity, time.monotonic()):
            return False
        self.counters["hello_limited"] += 1
        self._ratelog.warning("hello_limited", "dropped a hello: over the hello rate of its connection")
        return True

    def _passive(self, identity: bytes, msg: P.Hello, standby: Standby) -> bool:
        """Send the client to the peer: not a fault of the client, logged at info level (aggregated)."""
        self.counters["hello_passive"] += 1
        why = standby.refusal()
        self._ratelog.info("hello_passive", f"sent {msg.role} {msg.peer_id} to the peer broker: {why}")
        self.replies.send(identity, P.Reject(reason=why))
        return True

    def _refuse(self, identity: bytes, msg: P.Hello, counter: str, why: str, final: bool = True) -> bool:
        """Answer a refused hello: a final reject stops the client; another is only logged there (its next
        heartbeat, from no member, gets "send hello first" and it asks again)."""
        self.counters[counter] += 1
        self._ratelog.warning(counter, f"refused a hello of {msg.role} {msg.peer_id}: {why}")
        self.replies.send(identity, P.Reject(reason=f"{P.REFUSED_PREFIX}{why}" if final else why))
        return True

    def _cap_refusal(self, msg: P.Hello, old: Member | None, user: str) -> str:
        m = self.membership
        # shards and replays share one cap: every member on the learners socket
        return self.limits.cap_refusal(
            msg, old, len(m), m.count(*DATA_ROLES), m.roster, user, self.claims.of_key(user) if user else 0
        )

    def admit(self, identity: bytes, msg: P.Hello, user: str, fd: int = -1) -> Member:
        """The member an admitted hello makes, joined in place of its peer id's earlier session (a session of
        another process is recorded as departed: it is judged afresh). ``fd``: its control connection's file
        descriptor (closed bus), whose closing the broker watches for."""
        old = self.membership.get(msg.peer_id)
        member = member_of(msg, identity)
        member.user, member.conn_fd = user, fd
        if member.role == "replay":  # a replay service serves whatever run is current (re-welcomed at each new one)
            member.run_id = self.current.run_id
        if member.role in DATA_ROLES:  # on a closed bus a secret, kept across re-hellos of the same key
            member.data_id = self.guard.data_id(member, old)
        departure = ""
        if old is not None:
            # A learner's credit starts again from zero with every hello: a shard re-grants its window
            # after every welcome (it cannot tell a restarted broker, which holds no credit for it, from
            # this one). Keeping the old credit as well counted the window twice and broke the bound
            # on queued data that async runs rely on.
            member.counters = old.counters
            if (old.host, old.pid) != (msg.host, msg.pid):
                departure = f"replaced by pid {msg.pid} on {msg.host or '?'}"
        self.membership.admit(member, old, departure)
        return member

    def relayed_refused(self, relay: Member, hello: P.Hello, old: Member | None) -> bool:
        """Whether an actor a relay reports (as ``hello``) is refused by the checks of a direct hello, or because
        its id is a live direct member's or another key's (an id of another role, a direct member's departure
        window): counted (``relayed_refused``) and logged if so; the relay's next report asks again."""
        direct = old if old is not None and not old.relay else None  # another relay's actor moved: no conflict
        room = self.membership.roster.room_for(hello.peer_id, hello.num_envs, hello.host)
        why = hello_conflict(hello, room, self.current.run_id)
        why = why or self.guard.relayed_refusal(relay, hello.peer_id, direct, self.claims)
        why = why or id_conflict(direct, hello, self.cadence.keeping_s(time.monotonic()))[0]  # asked again anyway
        if not why and direct is not None and direct.user != relay.user:
            why = f"peer id {hello.peer_id!r} is held by a member that joined with another key"
        why = why or self._cap_refusal(hello, old, relay.user)
        if why:
            self.counters["relayed_refused"] += 1
            self._ratelog.warning(
                "relayed_refused", f"relay {relay.peer_id}: refused its actor {hello.peer_id!r}: {why}"
            )
        return bool(why)

    def welcome(self, peer_id: str) -> P.Welcome:
        """The welcome ``peer_id`` gets now: the current run (spec, seal and bus), the data ports, the heartbeat. On a
        closed bus a monitor's carries its own peer id and the heartbeat only: it reads status, and nothing else (on
        an open bus anyone may say hello as an actor and read the run)."""
        c, run = self.config, self.current
        member = self.membership.get(peer_id)
        if member is not None and member.role == "monitor" and self.guard.auth is not None:
            return P.Welcome(
                peer_id=peer_id,
                run_id="",
                run=None,
                ports={},
                heartbeat_interval_s=self.cadence.interval_s,
                heartbeat_liveness=c.heartbeat_liveness,
                max_message_bytes=c.max_message_bytes,
            )
        return P.Welcome(
            peer_id=peer_id,
            run_id=run.run_id,
            run=run.spec,
            ports=self.ports,
            heartbeat_interval_s=self.cadence.interval_s,
            heartbeat_liveness=c.heartbeat_liveness,
            max_message_bytes=c.max_message_bytes,
            run_signer=run.seal[0],
            run_signature=run.seal[1],
            data_identity=member.data_id if member is not None and self.guard.auth is not None else b"",
            bus=run.bus.to_wire() if run.run_id else None,
        )


def hello_conflict(msg: P.Hello, fleet_has_room: bool, run_id: str) -> str:
    """Why the broker refuses ``msg`` as malformed (one line for the reject), or "": an unknown role, a field out
    of bounds (``P.hello_refusal``, its ``bus`` included), a full fleet message, a new run without a spec. A peer
    id another live process holds is no fault of the hello: ``id_conflict`` says it, and the broker counts it apart."""
    if msg.role not in P.ROLES:
        return f"hello with unknown role {msg.role!r}"
    refusal = P.hello_refusal(msg)
    if refusal:
        return f"hello: {refusal}"
    if msg.role == "actor" and not fleet_has_room:
        return (
            f"the fleet is full: its message would exceed {P.MAX_HEADER_BYTES} bytes with this actor "
            "(docs/protocol.md section 5.5)"
        )
    if msg.role == "learner" and msg.run_id and msg.run_id != run_id and msg.run is None:
        return "a learner hello for a new run must carry the run spec"
    return ""


def member_of(msg: P.Hello, identity: bytes) -> Member:
    """The member a hello makes (its counters are its own unless it replaces an earlier session)."""
    return Member(
        peer_id=msg.peer_id,
        role=msg.role,
        identity=identity,
        host=msg.host,
        pid=msg.pid,
        num_envs=msg.num_envs,
        run_id=msg.run_id,
    )
