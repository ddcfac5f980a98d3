"""Who joins the broker and what it is told: hellos judged (``_hello_refused``), members made and replaced
(``_on_hello``), runs started (``_start_run``), welcomes (``_welcome``).

A part of ``Broker`` (broker.py), apart because it is its own conversation: the class is mixed into ``Broker``,
whose ``__init__`` and ``bind`` make every attribute declared here. A relay (relay.py) overrides
``_hello_refused`` and ``_joined``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import zmq

from zddrl import protocol as P
from zddrl.broker.auth import BrokerAuth
from zddrl.broker.cadence import Cadence
from zddrl.broker.fleet import Fleet
from zddrl.broker.guard import Guard
from zddrl.broker.health import HealthMonitor
from zddrl.broker.membership import (
    Departures,
    Limits,
    Member,
    credit_batch_of,
    hello_conflict,
    id_conflict,
    member_of,
    staleness_of,
)
from zddrl.broker.publisher import Publisher
from zddrl.broker.routing import DATA_ROLES, Router
from zddrl.broker.subtree import Subtrees
from zddrl.config import BrokerConfig
from zddrl.logs import RateLimitedLog


class Joining:
    """The hello/welcome side of ``Broker``: every attribute below is the broker's (see broker.py)."""

    config: BrokerConfig
    control: zmq.Socket
    ports: dict[str, int]
    members: dict[str, Member]
    by_identity: dict[bytes, Member]
    counters: dict[str, int]
    run_id: str
    run_spec: dict | None
    run_seal: tuple[str, bytes]
    policy_version: int
    auth: BrokerAuth | None
    guard: Guard
    router: Router
    publisher: Publisher
    fleet: Fleet
    subtrees: Subtrees
    health: HealthMonitor
    departures: Departures
    limits: Limits
    cadence: Cadence
    log: Any
    _ratelog: RateLimitedLog
    _staleness: int
    _credit_batch: int
    _send: Callable[[zmq.Socket, bytes, P.Message], None]
    _send_fleet: Callable[[Member], None]
    _forget: Callable[[Member], None]

    def _on_hello(self, identity: bytes, msg: P.Hello, user: str) -> None:
        if self._hello_refused(identity, msg, user):
            return
        if msg.role == "learner" and msg.run_id and msg.run_id != self.run_id and msg.run is not None:
            self.run_seal = (msg.run_signer, msg.run_signature)
            self._start_run(msg.run_id, msg.run, staleness_of(msg.run), credit_batch_of(msg.run))
        old = self.members.get(msg.peer_id)
        kept = self.subtrees.detach(old, msg, user)  # a relay's new session keeps its subtree
        if old is not None:
            self._forget(old)
            if (old.host, old.pid) != (msg.host, msg.pid):  # another process took the id: judge it afresh
                self.departures.record(old, f"replaced by pid {msg.pid} on {msg.host or '?'}")
                self.health.forget(msg.peer_id)
        member = member_of(msg, identity)
        member.user = user
        if member.role == "replay":  # a replay service serves whatever run is current (re-welcomed at each new one)
            member.run_id = self.run_id
        if member.role in DATA_ROLES:  # on a closed bus a secret, kept across re-hellos of the same key
            member.data_id = self.guard.data_id(member, old)
        if old is not None:
            # A learner's credit starts again from zero with every hello: a shard re-grants its window
            # after every welcome (it cannot tell a restarted broker, which holds no credit for it, from
            # this one). Keeping the old credit as well counted the window twice and broke the bound
            # on queued data that async runs rely on.
            member.counters = old.counters
        self.members[msg.peer_id] = member
        self.by_identity[identity] = member
        self.subtrees.attach(member, kept)
        if member.role in DATA_ROLES:
            self.router.add_shard(member)
        elif member.role == "actor":
            self.fleet.joined(member.peer_id, member.num_envs, member.host)
        self.log.info(f"{msg.role} {msg.peer_id} joined from {msg.host or '?'} (pid {msg.pid}, {msg.num_envs} envs)")
        self._joined(member)
        self._send(self.control, identity, self._welcome(msg.peer_id))
        if msg.role in ("actor", "relay"):
            self.publisher.on_join(member)
        elif msg.role == "learner" and member.run_id == self.run_id:
            self._send_fleet(member)  # the last announced one; a change pending follows within FLEET_COALESCE_S

    def _joined(self, member: Member) -> None:
        """``member`` joined, its welcome goes next (a relay reports its actor upstream first)."""

    def _hello_refused(self, identity: bytes, msg: P.Hello, user: str) -> bool:
        """Whether the hello is refused (answered with a reject that says why, counted by reason): over its
        connection's hello rate, another key's role or peer id, a conflict (``hello_conflict``), a member cap,
        or a new run no pinned learner key signed."""
        if not self.limits.hello.allow(identity, time.monotonic()):  # dropped: its link asks again at its heartbeat
            self.counters["hello_limited"] += 1
            self._ratelog.warning("hello_limited", "dropped a hello: over the hello rate of its connection")
            return True
        old = self.members.get(msg.peer_id)
        guard = self.guard
        room = msg.role != "actor" or self.fleet.room_for(msg.peer_id, msg.num_envs, msg.host)
        why = hello_conflict(msg, room, self.run_id)
        if why:
            self._send(self.control, identity, P.Reject(reason=f"{P.REFUSED_PREFIX}{why}"))
            raise P.ProtocolError(why)
        counter, why = "auth_refused", guard.hello_refusal(msg, user, old)  # first: a stranger learns nothing more
        if not why:
            counter, why = "hello_id_in_use", id_conflict(old, msg, self.config.heartbeat_interval_s)
        if not why:
            counter = "hello_over_cap"
            why = self.limits.cap_refusal(msg, old, len(self.members), len(self.router.shards), self.fleet)
        if not why and msg.role == "learner" and msg.run_id and msg.run_id != self.run_id and msg.run is not None:
            counter, why = "runs_refused", guard.run_refusal(msg, user)
            why = f"run spec {why}" if why else ""
        if why:
            self.counters[counter] += 1
            self._ratelog.warning(counter, f"refused a hello of {msg.role} {msg.peer_id}: {why}")
            self._send(self.control, identity, P.Reject(reason=f"{P.REFUSED_PREFIX}{why}"))
        return bool(why)

    def _start_run(self, run_id: str, run: dict, staleness: int, credit_batch: int) -> None:
        self.log.info(f"run {run_id!r} starts (previous: {self.run_id or 'none'})")
        self.run_id, self.run_spec = run_id, run
        self.publisher.new_run()
        self.policy_version = -1
        self._staleness, self._credit_batch = staleness, credit_batch
        self.health.start_run(staleness, run_id)
        for shard in self.router.shards.values():  # an old run's learner must never be fed the new run's data
            if shard.role == "replay":  # it follows the run, from zero credit (it grants again once re-welcomed)
                shard.run_id = run_id
                self.router.set_credit(shard, 0)
            elif shard.run_id != run_id:
                self.router.set_credit(shard, 0)
        for member in self.members.values():  # actors and replays waiting without a run (or on an old one) get it
            if member.role in ("actor", "relay", "replay") and not member.relay:
                self._send(self.control, member.identity, self._welcome(member.peer_id))

    def _welcome(self, peer_id: str) -> P.Welcome:
        c = self.config
        member = self.members.get(peer_id)
        return P.Welcome(
            peer_id=peer_id,
            run_id=self.run_id,
            run=self.run_spec,
            ports={k: v for k, v in self.ports.items() if k != "control"},
            heartbeat_interval_s=self.cadence.interval_s,
            heartbeat_liveness=c.heartbeat_liveness,
            max_message_bytes=c.max_message_bytes,
            run_signer=self.run_seal[0],
            run_signature=self.run_seal[1],
            data_identity=member.data_id if member is not None and self.auth is not None else b"",
        )
