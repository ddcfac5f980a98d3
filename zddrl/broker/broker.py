"""The broker: one public address; routes trajectories to learner shards and fans out parameters.

Sockets (all bound by the broker; clients learn the data ports from the welcome)::

    control       ROUTER  hello/welcome, heartbeats both ways, stats, status, parameter snapshots (publisher.py),
                          fleet messages to learner shards (fleet.py)
    trajectories  PULL    actors PUSH trajectory messages here
    learners      ROUTER  learner shards (DEALER, identity = peer id): credit in, trajectories out,
                          parameters in
    params        PUB     every parameter version, once verified (publisher.py), to every actor's SUB

Flow control is credit-based: a learner shard grants credit (how many more trajectories it can
take), the broker reads the trajectory socket only while some shard has credit and sends each
message to the shard with the most credit left. With no credit, the broker stops reading, the
socket queues fill to their high-water marks and actors block in ``send``: backpressure, never an
unbounded buffer, never a silent drop. Every message read is forwarded or dropped with a reason,
so ``received == forwarded + sum(dropped) + in_flight`` always holds.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, defaultdict
from collections.abc import Sequence
from functools import lru_cache, partial
from operator import attrgetter
from typing import Any

import zmq
from loguru import logger

from zddrl import keys
from zddrl import protocol as P
from zddrl.broker.auth import AUTH_COUNTERS, BrokerAuth, HandshakeCounter, is_loopback, user_of
from zddrl.broker.fleet import Fleet
from zddrl.broker.health import HealthMonitor
from zddrl.broker.membership import (
    LEFT_ACTORS_KEPT,
    Departures,
    Limits,
    Member,
    credit_batch_of,
    hello_conflict,
    log_health_events,
    member_of,
    staleness_of,
    trajectory_refusal,
)
from zddrl.broker.publisher import Publisher
from zddrl.broker.report import BROKER_COUNTERS, RATES, broker_status, throughput
from zddrl.broker.sockets import open_sockets
from zddrl.config import BrokerConfig, ConfigError, split_endpoint
from zddrl.keys import KeysError
from zddrl.logs import RateLimitedLog
from zddrl.transport import signatures as signing
from zddrl.transport.io import NOBLOCK, recv_frames, send_frames

DROP_REASONS = ("malformed", "unknown_sender", "forged_sender", "unknown_run", "stale", "unknown_version", "no_route")
POLL_TIMEOUT_S = 0.1
FORWARD_BURST = 256
"""Trajectories forwarded per poll wake-up at most (keeps control traffic responsive)."""
_CREDIT = attrgetter("credit")
REVOKED = "revoked:"
"""What an actor's peer id is bound to once its key is revoked: no user matches it."""
REVOKED_REASON = "this client's key was removed from the broker's key directory (revoked)"
_STATUS_REFUSED = P.encode(P.Reject(reason="status: rate limited, ask less often"))


@lru_cache(maxsize=FORWARD_BURST)  # an actor's credit of n, encoded once per count
def _credit_frames(n: int) -> list[Any]:
    return P.encode(P.Credit(peer_id="broker", credit=n))


class Broker:
    """Run with ``Broker(config).bind()`` then ``run(stop_event)``; ``close()`` in a finally."""

    publisher: Publisher
    """The parameter side: verifies, publishes and keeps versions, sends snapshots (made by ``bind``)."""

    def __init__(self, config: BrokerConfig, context: zmq.Context | None = None) -> None:
        self.config = config
        # A context holds one ZAP handler at a fixed inproc address, and a closed one is unbound asynchronously:
        # a keyed broker gets a context of its own (two in one process, or one after another, never clash).
        self._own_ctx = context is None and bool(config.keys)
        self.ctx = zmq.Context() if self._own_ctx else (context or zmq.Context.instance())
        self.log = logger.bind(role="broker")
        self.members: dict[str, Member] = {}
        self.by_identity: dict[bytes, Member] = {}
        self.shards: dict[str, Member] = {}
        """The learner members, by peer id (their data identity)."""
        self.credit = 0
        """Sum of the shards' credit: the broker reads trajectories only while it is positive."""
        self.rates: dict[str, float] = dict.fromkeys(RATES, 0.0)
        self._rate_mark: tuple[float, int, int, int, int] | None = None
        self.run_id = ""
        self.run_spec: dict | None = None
        self.run_seal: tuple[str, bytes] = ("", b"")
        """(signer, signature) of the run spec, from its learner's hello: every welcome passes them on."""
        self.pins: dict[str, Any] | None = None
        """Closed bus: the learners' Ed25519 keys that sign runs and versions (read by ``bind``)."""
        self.policy_version = -1
        """The newest published version of the run (the publisher's; read per trajectory, so kept here too)."""
        self.counters: dict[str, int] = defaultdict(int, dict.fromkeys((*BROKER_COUNTERS, *AUTH_COUNTERS), 0))
        self.dropped: dict[str, int] = {r: 0 for r in DROP_REASONS}
        self.in_flight = 0
        self._decided = 0  # forwarded + dropped, one int: a failure can tell if its message was decided
        self.started = time.monotonic()
        self.ports: dict[str, int] = {}
        self._ratelog = RateLimitedLog()
        self.health = HealthMonitor()
        # What an actor sent before it left counts as its own for as long as it could have been silent.
        self.departures = Departures(config.heartbeat_interval_s * config.heartbeat_liveness)
        self._next_beat = 0.0
        self._poll_traj = False
        self._staleness = 0
        self._credit_batch = 1
        """An actor's credit goes back once this many of its trajectories were read (membership.credit_batch_of)."""
        self.fleet = Fleet()
        """The joined actors, as fleet messages announce them to the learner shards of the run."""
        self.auth: BrokerAuth | None = None
        """CURVE and ZAP on every socket (``config.keys``); None on an open bus."""
        self.handshakes: HandshakeCounter | None = None
        self._actor_users: OrderedDict[str, str] = OrderedDict()
        """Closed bus: actor peer id -> the user it joined as, of members and of the last LEFT_ACTORS_KEPT that
        left (their trajectories still in flight count as theirs): a trajectory's header must name its key's."""
        self.limits = Limits()
        """Rates per connection and member caps on the public control port (membership.Limits)."""

    # ---------------------------------------------------------------- setup
    def bind(self) -> dict[str, int]:
        """Create and bind every socket (``sockets.open_sockets``); returns the bound ports."""
        c = self.config
        self._secure()
        s = open_sockets(self.ctx, c, self.auth)
        self.control, self.trajectories, self.learners, self.params = s.control, s.trajectories, s.learners, s.params
        self.ports = s.ports
        self.publisher = Publisher(
            self.params,
            partial(self._send_frames, self.control),
            self.counters,
            self._ratelog,
            c.heartbeat_interval_s,
            self.pins,
        )
        self.poller = zmq.Poller()
        self.poller.register(self.control, zmq.POLLIN)
        self.poller.register(self.learners, zmq.POLLIN)
        if self.auth is not None:
            self.handshakes = HandshakeCounter(s[:4])
            for monitor in self.handshakes.monitors:
                self.poller.register(monitor, zmq.POLLIN)
        closed = "closed (CURVE, keys from " + c.keys + ")" if self.auth is not None else "open (no keys)"
        self.log.info(f"broker bound on {split_endpoint(c.bind)[0]}: {self.ports}; the bus is {closed}")
        return dict(self.ports)

    def _refresh_keys(self) -> None:
        """Keys added to or removed from the directory take effect now; a revoked key's members are removed and
        whatever its open connections still send is refused."""
        assert self.auth is not None
        try:
            revoked = self.auth.refresh()
        except KeysError as exc:
            self._ratelog.warning("keys", f"key directory {self.config.keys}: {exc}; the allow-lists stay as they were")
            return
        if not revoked:
            return
        self.log.warning(f"keys revoked: {', '.join(sorted(revoked))}; their members are removed")
        for member in [m for m in self.members.values() if m.user in revoked]:
            self._remove(member, "its key was revoked")
            self._send(self.control, member.identity, P.Reject(reason=f"{P.REFUSED_PREFIX}{REVOKED_REASON}"))
        for peer_id, user in self._actor_users.items():
            if user in revoked:
                self._actor_users[peer_id] = REVOKED

    def _secure(self) -> None:
        """Keys, or a loopback bind, or ``insecure`` said out loud: a reachable open bus is never an accident."""
        c = self.config
        host = split_endpoint(c.bind)[0]
        if c.keys:
            try:
                self.auth = BrokerAuth(self.ctx, c.keys)
                self.pins = keys.pinned_learners(c.keys)
            except KeysError as exc:
                raise ConfigError(f"broker --keys: {exc}") from None
        elif not is_loopback(host):
            if not c.insecure:
                raise ConfigError(
                    f"broker: binding {host} without keys would let anyone who reaches it join, inject, read and "
                    "exhaust the bus; make keys (zddrl keys new broker NAME, docs/security.md) and pass --keys DIR, "
                    "or bind 127.0.0.1, or pass --insecure"
                )
            self.log.warning(
                f"INSECURE: bound on {host} with no keys: anyone who can reach these ports can join as any role, "
                "push trajectories, publish parameters and read everything (docs/security.md)"
            )

    def close(self) -> None:
        # Runs in the CLI's finally, also after a bind() that failed half-way: must not hide that error.
        if self.handshakes is not None:
            self.handshakes.close()
        for name in ("control", "trajectories", "learners", "params"):
            sock = getattr(self, name, None)
            if sock is not None:
                sock.close(linger=0)
        if self.auth is not None:
            self.auth.close()
        if self._own_ctx:
            self.ctx.term()

    # ---------------------------------------------------------------- main loop
    def run(self, stop: threading.Event) -> None:
        """Serve until ``stop`` is set. Never raises on bad input: drops, counts and logs it."""
        while not stop.is_set():
            self._update_trajectory_polling()
            timeout_s = POLL_TIMEOUT_S
            if self.fleet.changed:  # wake up when the fleet announcement is due
                timeout_s = min(timeout_s, max(0.0, self.fleet.next_at - time.monotonic()))
            events = dict(self.poller.poll(int(timeout_s * 1000)))
            if self.control in events:
                self._drain(self.control, self._on_control)
            if self.learners in events:
                self._drain(self.learners, self._on_learner)
            if self.trajectories in events or (self.credit > 0 and not self._poll_traj):
                self._forward_trajectories()  # credit that just came: forward now, not after one more poll
            if self.handshakes is not None:
                for monitor in self.handshakes.monitors:
                    if monitor in events:
                        self.handshakes.drain(monitor, self.counters)
            now = time.monotonic()
            if self.fleet.changed and now >= self.fleet.next_at:
                self._announce_fleet(now)
            if now >= self._next_beat:
                self._send_heartbeats()
                self._purge_expired(now)
                self.health.evaluate(now)
                self._log_health()
                self._ratelog.flush()
                self._sample_rates(now)
                if self.auth is not None:
                    self.counters["zap_denied"] = sum(self.auth.allow.denied.values())
                    self._refresh_keys()
                self._next_beat = now + self.config.heartbeat_interval_s

    def _update_trajectory_polling(self) -> None:
        want = self.credit > 0
        if want != self._poll_traj:
            if want:
                self.poller.register(self.trajectories, zmq.POLLIN)
            else:
                self.poller.unregister(self.trajectories)
            self._poll_traj = want

    def _drain(self, sock: zmq.Socket, handler) -> None:
        # Each socket has its own counters: bad credit on the learner socket is not control traffic.
        what = "control" if sock is self.control else "learner"
        for _ in range(FORWARD_BURST):
            try:
                frames = recv_frames(sock, NOBLOCK)
            except zmq.Again:
                return
            try:
                identity, body = P.split_routed(frames)
                handler(identity, body, user_of(frames[0]) if self.auth is not None else "")
            except P.ProtocolError as exc:
                self.counters[f"{what}_malformed"] += 1
                self._ratelog.warning(f"{what}_malformed", f"dropped a malformed {what} message: {exc}")
            except Exception as exc:  # noqa: BLE001
                # Bad input must never stop the broker, whatever it raises: count, log (rate-limited), serve on.
                self.counters[f"{what}_errors"] += 1
                self._ratelog.warning(
                    f"{what}_error", f"error handling a {what} message ({type(exc).__name__}: {exc}); message dropped"
                )

    def _decode(self, frames: Sequence[Any]) -> P.Message:
        """``P.decode`` that raises nothing but ProtocolError. An unexpected exception in decode once stopped
        the broker (a header with str and bytes keys); this guard keeps the next slip a malformed message."""
        try:
            return P.decode(frames, self.config.max_message_bytes)
        except P.ProtocolError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise P.ProtocolError(f"undecodable message ({type(exc).__name__}: {exc})") from None

    # ---------------------------------------------------------------- trajectories
    def _forward_trajectories(self) -> None:
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
            user = user_of(frames[0]) if self.auth is not None else ""
            try:
                actor = self._route_trajectory(frames, nbytes, user)
            except Exception as exc:  # noqa: BLE001
                # Whatever happens, the message ends up forwarded or dropped with a reason (in_flight balances),
                # and the actor it can be attributed to gets its credit back.
                actor = self._joined_actor(P.claimed_peer_id(frames), user)
                if self._decided == decided:
                    self._drop(
                        "malformed",
                        actor,
                        f"dropped a trajectory: error while routing it ({type(exc).__name__}: {exc})",
                    )
            finally:
                self.in_flight -= 1
            if actor is not None:
                actor.unacked += 1
                if actor.unacked >= self._credit_batch:
                    due[actor.peer_id] = actor
        for actor in due.values():  # actor-side credit: what was read may be replaced
            self._return_credit(actor)

    def _return_credit(self, actor: Member) -> None:
        if actor.unacked:
            self._send_frames(self.control, actor.identity, _credit_frames(actor.unacked))
            actor.unacked = 0

    def _route_trajectory(self, frames: Sequence[Any], nbytes: int, user: str) -> Member | None:
        """Forward ``frames`` (sent from the key ``user``) to the shard with the most credit, or drop them with a
        reason.

        Returns the sending actor (if it is a member) so that its credit can be returned."""
        try:  # full validation, but no arrays built: the broker forwards the frames untouched
            msg = P.validate_trajectory(frames, self.config.max_message_bytes)
        except P.ProtocolError as exc:
            # Charged to the actor it can be attributed to (P.claimed_peer_id: docs/protocol.md section 8), whose
            # credit comes back all the same: an actor whose messages fail (a client bug) must see its drops in
            # `zddrl status`, not stall on lost credit.
            actor = self._joined_actor(P.claimed_peer_id(frames), user)
            self._drop("malformed", actor, f"dropped a malformed trajectory: {exc}")
            return actor
        if self.auth is not None and self._actor_users.get(msg["peer_id"], user) != user:
            # Another actor key's peer id: no credit goes back (a forger stalls), nothing reaches a learner.
            self._drop(
                "forged_sender",
                None,
                f"dropped a trajectory naming {msg['peer_id']!r} sent with the key {user!r}, not the one it joined",
            )
            return None
        actor = self._joined_actor(msg["peer_id"])
        if actor is not None:
            actor.last_seen = time.monotonic()
        elif not self.departures.actor_left_lately(msg["peer_id"]):
            # Learners keep per-actor figures, which made-up peer ids would grow without bound. An actor
            # the broker forgot (expired, broker restarted) is told to hello again at its next heartbeat.
            self._drop(
                "unknown_sender",
                None,
                f"dropped a trajectory from {msg['peer_id']!r}, which is not an actor that joined with hello",
            )
            return None
        # Otherwise an actor that left (bye or expiry) sent it before: it goes on, with no credit to return.
        # The staleness bound was read (and checked) once, from the run spec in the learner's hello.
        reason, why = trajectory_refusal(msg, self.run_id, self.policy_version, self._staleness)
        if reason:
            self._drop(reason, actor, why)
            return actor
        while True:
            shard = max(self.shards.values(), key=_CREDIT, default=None)
            if shard is None or shard.credit <= 0:
                self._drop("no_route", actor, "dropped a trajectory: no learner shard can take it")
                return actor
            try:
                send_frames(self.learners, frames, prefix=shard.peer_id.encode())
            except zmq.ZMQError as exc:  # the shard went away between credit and send
                self._ratelog.warning(
                    "shard_gone", f"learner shard {shard.peer_id} unreachable ({exc}); its credit is withdrawn"
                )
                self._set_credit(shard, 0)
                continue
            self._set_credit(shard, shard.credit - 1)
            self._decided += 1
            shard.count(nbytes)
            self.counters["forwarded"] += 1
            self.counters["bytes_out"] += nbytes
            if actor is not None:
                actor.count(nbytes, msg["env_steps"])
            return actor

    def _joined_actor(self, peer_id: str | None, user: str | None = None) -> Member | None:
        """The actor member ``peer_id`` (if ``user`` is given: only if it joined with that key)."""
        member = self.members.get(peer_id) if peer_id is not None else None
        if member is None or member.role != "actor" or (user is not None and member.user != user):
            return None
        return member

    def _set_credit(self, shard: Member, credit: int) -> None:
        """Every change of a shard's credit goes through here, so the running total stays exact."""
        self.credit += credit - shard.credit
        shard.credit = credit

    def _drop(self, reason: str, member: Member | None, text: str) -> None:
        self.dropped[reason] += 1
        self._decided += 1
        if member is not None:
            member.counters[f"dropped_{reason}"] += 1
        self._ratelog.warning(f"drop_{reason}", text)

    # ---------------------------------------------------------------- control socket
    def _on_control(self, identity: bytes, frames: Sequence[Any], user: str) -> None:
        if self.auth is not None and user not in self.auth.users:  # revoked since its connection was admitted
            self.counters["auth_refused"] += 1
            self._send(self.control, identity, P.Reject(reason=f"{P.REFUSED_PREFIX}{REVOKED_REASON}"))
            return
        msg = self._decode(frames)
        member = self.by_identity.get(identity)
        if member is not None and member.user != user:  # a routing id a member used, from another key
            self.counters["auth_refused"] += 1
            member = None
        if member is not None:
            member.last_seen = time.monotonic()
        if isinstance(msg, P.Hello):
            self._on_hello(identity, msg, user)
        elif isinstance(msg, P.StatusRequest):
            self._on_status(identity, msg.page)
        elif member is None:
            self._send(self.control, identity, P.Reject(reason="unknown peer: send hello first", rehello=True))
        elif isinstance(msg, P.Heartbeat):
            if member.role != "learner":  # a learner's row shows the version it published, not what its link holds
                member.policy_version = msg.policy_version
                self.publisher.on_heartbeat(member)
        elif isinstance(msg, P.ParamsRequest):
            self.publisher.on_request(member, msg.policy_version)
        elif isinstance(msg, P.Stats):  # keyed by the sender's identity: msg.peer_id cannot speak for others
            truncated = member.take_stats(msg.stats)
            if truncated:
                self.counters["stats_truncated"] += 1
                self._ratelog.warning("stats_truncated", truncated)
            self.health.observe(member.peer_id, member.role, member.stats, time.monotonic())
            self._log_health()
        elif isinstance(msg, P.Bye):
            if msg.reason.startswith(P.CRASH_PREFIX):
                self.log.error(
                    f"{member.role} {member.peer_id} on {member.host or '?'} (pid {member.pid}) {msg.reason}"
                )
            else:
                self.log.info(f"{member.role} {member.peer_id} left: {msg.reason or 'bye'}")
            self._remove(member, msg.reason or "bye")
        else:
            raise P.ProtocolError(f"{msg.KIND} is not a control message")

    def _on_hello(self, identity: bytes, msg: P.Hello, user: str) -> None:
        if not self.limits.hello.allow(identity, time.monotonic()):  # dropped: its link asks again at its heartbeat
            self.counters["hello_limited"] += 1
            self._ratelog.warning("hello_limited", "dropped a hello: over the hello rate of its connection")
            return
        # A refused hello gets a reject that says why (a client would otherwise wait for a welcome forever).
        room = msg.role != "actor" or self.fleet.room_for(msg.peer_id, msg.num_envs, msg.host)
        why = self._key_refusal(msg, user) or hello_conflict(
            msg, self.members.get(msg.peer_id), room, self.run_id, self.config.heartbeat_interval_s
        )
        if why:
            self._send(self.control, identity, P.Reject(reason=f"{P.REFUSED_PREFIX}{why}"))
            raise P.ProtocolError(why)
        cap = self.limits.cap_refusal(
            msg, self.members.get(msg.peer_id), len(self.members), len(self.shards), self.fleet
        )
        if cap:
            self.counters["hello_over_cap"] += 1
            self._ratelog.warning("hello_over_cap", f"refused a hello of {msg.role} {msg.peer_id}: {cap}")
            self._send(self.control, identity, P.Reject(reason=f"{P.REFUSED_PREFIX}{cap}"))
            return
        if msg.role == "learner" and msg.run_id and msg.run_id != self.run_id and msg.run is not None:
            if not self._run_signed(identity, msg):
                return
            self.run_seal = (msg.run_signer, msg.run_signature)
            self._start_run(msg.run_id, msg.run, staleness_of(msg.run), credit_batch_of(msg.run))
        old = self.members.get(msg.peer_id)
        if old is not None:
            self._forget(old)
            if (old.host, old.pid) != (msg.host, msg.pid):  # another process took the id: judge it afresh
                self.departures.record(old, f"replaced by pid {msg.pid} on {msg.host or '?'}")
                self.health.forget(msg.peer_id)
        member = member_of(msg, identity)
        member.user = user
        if old is not None:
            # A learner's credit starts again from zero with every hello: a shard re-grants its window
            # after every welcome (it cannot tell a restarted broker, which holds no credit for it, from
            # this one). Keeping the old credit as well counted the window twice and broke the bound
            # on queued data that async modes rely on.
            member.counters = old.counters
        self.members[msg.peer_id] = member
        self.by_identity[identity] = member
        if member.role == "learner":
            self.shards[member.peer_id] = member
            self.credit += member.credit
        elif member.role == "actor":
            self.fleet.joined(member.peer_id, member.num_envs, member.host)
            self._note_actor_user(member)
        self.log.info(f"{msg.role} {msg.peer_id} joined from {msg.host or '?'} (pid {msg.pid}, {msg.num_envs} envs)")
        self._send(self.control, identity, self._welcome(msg.peer_id))
        if msg.role == "actor":
            self.publisher.on_join(member)
        elif msg.role == "learner" and member.run_id == self.run_id:
            self._send_fleet(member)  # the last announced one; a change pending follows within FLEET_COALESCE_S

    def _key_refusal(self, msg: P.Hello, user: str) -> str:
        """Closed bus: why this key may not say this hello (its role is the key's; a peer id held by a live
        member is taken over by the same key only), or ""."""
        if self.auth is None:
            return ""
        why = ""
        role = user.partition(":")[0]
        if role != msg.role:
            why = f"the key {user!r} is a {role} key: it may not join as {msg.role}"
        else:
            old = self.members.get(msg.peer_id)
            if old is not None and old.user != user:
                why = f"peer id {msg.peer_id!r} is held by a member that joined with another key"
        if why:
            self.counters["auth_refused"] += 1
        return why

    def _note_actor_user(self, member: Member) -> None:
        if self.auth is None:
            return
        users = self._actor_users
        users[member.peer_id] = member.user
        users.move_to_end(member.peer_id)
        if len(users) > LEFT_ACTORS_KEPT + len(self.fleet.actors):  # forget the oldest that is not a member
            for peer_id in users:
                if peer_id not in self.members:
                    del users[peer_id]
                    break

    def _run_signed(self, identity: bytes, msg: P.Hello) -> bool:
        """With keys, a new run is adopted only if a pinned learner key signed it; else its learner is refused."""
        why = (
            ""
            if self.pins is None
            else signing.run_refusal(msg.run_id, msg.run, msg.run_signer, msg.run_signature, self.pins)
        )
        if why:
            self.counters["runs_refused"] += 1
            self._ratelog.warning("runs_refused", f"refused run {msg.run_id!r} of {msg.peer_id!r}: run spec {why}")
            self._send(self.control, identity, P.Reject(reason=f"{P.REFUSED_PREFIX}run spec {why}"))
        return not why

    def _start_run(self, run_id: str, run: dict, staleness: int, credit_batch: int) -> None:
        self.log.info(f"run {run_id!r} starts (previous: {self.run_id or 'none'})")
        self.run_id, self.run_spec = run_id, run
        self.publisher.new_run()
        self.policy_version = -1
        self._staleness, self._credit_batch = staleness, credit_batch
        self.health.start_run(staleness, run_id)
        for shard in self.shards.values():  # an old run's learner must never be fed the new run's data
            if shard.run_id != run_id:
                self._set_credit(shard, 0)
        for member in self.members.values():  # actors waiting without a run (or on an old one) get it now
            if member.role == "actor":
                self._send(self.control, member.identity, self._welcome(member.peer_id))

    def _welcome(self, peer_id: str) -> P.Welcome:
        c = self.config
        return P.Welcome(
            peer_id=peer_id,
            run_id=self.run_id,
            run=self.run_spec,
            ports={k: v for k, v in self.ports.items() if k != "control"},
            heartbeat_interval_s=c.heartbeat_interval_s,
            heartbeat_liveness=c.heartbeat_liveness,
            max_message_bytes=c.max_message_bytes,
            run_signer=self.run_seal[0],
            run_signature=self.run_seal[1],
        )

    # ---------------------------------------------------------------- learner socket
    def _on_learner(self, identity: bytes, frames: Sequence[Any], user: str) -> None:
        # Shards' data DEALERs use their peer id as ZeroMQ identity (their control link does not).
        member = self.members.get(identity.decode("utf-8", "replace"))
        msg = self._decode(frames)  # a ProtocolError is counted as learner_malformed by _drain
        if member is not None and member.user != user:  # the identity of a learner, taken by another key
            self.counters["auth_refused"] += 1
            member = None
        if member is None or member.role != "learner":
            self._send(self.learners, identity, P.Reject(reason="unknown learner: send hello first", rehello=True))
            return
        member.last_seen = time.monotonic()
        if isinstance(msg, P.Credit):
            if msg.credit <= 0 or msg.credit > 1 << 20:
                raise P.ProtocolError(f"credit must be in 1..2**20, got {msg.credit}")
            if member.run_id == self.run_id:  # credit of another run's learner is not for this run's data
                self._set_credit(member, member.credit + msg.credit)
            else:
                self.counters["credit_other_run"] += 1
        elif isinstance(msg, (P.Parameters, P.ParamChunk)):
            if self.publisher.add(msg, frames, self.run_id):  # a whole, verified version went out
                self.policy_version = member.policy_version = self.publisher.version
                self.health.published(self.policy_version, self.publisher.cache.param_hash)
        else:
            raise P.ProtocolError(f"{msg.KIND} is not a learner-socket message")

    # ---------------------------------------------------------------- fleet
    def _announce_fleet(self, now: float) -> None:
        """At loop level, at most once per FLEET_COALESCE_S: every learner of the run that has not got the
        current fleet gets it (nothing goes out if the map came back to what was announced)."""
        self.fleet.announce(now)
        for shard in self.shards.values():
            if shard.run_id == self.run_id and shard.fleet_seq != self.fleet.seq:
                self._send_fleet(shard)

    def _send_fleet(self, shard: Member) -> None:
        self._send_frames(self.control, shard.identity, self.fleet.frames(self.run_id))
        shard.fleet_seq = self.fleet.seq
        self.counters["fleet_sent"] += 1

    # ---------------------------------------------------------------- liveness
    def _send_heartbeats(self) -> None:
        for member in list(self.members.values()):
            self._return_credit(member)  # what a batch left pending: no actor waits longer than a beat for it
            self._send(self.control, member.identity, P.Heartbeat(peer_id="broker", policy_version=self.policy_version))

    def _purge_expired(self, now: float) -> None:
        limit = self.config.heartbeat_interval_s * self.config.heartbeat_liveness
        for member in list(self.members.values()):
            if now - member.last_seen > limit:
                silent = f"silent for {now - member.last_seen:.1f} s"
                self.log.warning(f"{member.role} {member.peer_id} expired: {silent}")
                self._remove(member, f"expired: {silent}")

    def _remove(self, member: Member, reason: str) -> None:
        """The member left (bye) or expired: not a re-hello, which only replaces its session."""
        self._forget(member)
        self.counters["expired_or_left"] += 1
        self.departures.record(member, reason)
        self.health.forget(member.peer_id)
        self._log_health()

    def _log_health(self) -> None:
        log_health_events(self._ratelog, self.health.pop_events())

    def _forget(self, member: Member) -> None:
        """Drop every index of ``member``; a shard's outstanding credit leaves the total with it."""
        self.members.pop(member.peer_id, None)
        self.by_identity.pop(member.identity, None)
        if self.shards.pop(member.peer_id, None) is not None:
            self.credit -= member.credit
        if member.role == "actor":
            self.fleet.left(member.peer_id)

    def _send(self, sock: zmq.Socket, identity: bytes, msg: P.Message) -> None:
        self._send_frames(sock, identity, P.encode(msg))

    def _send_frames(self, sock: zmq.Socket, identity: bytes, frames: Sequence[Any]) -> None:
        try:
            sock.send_multipart([identity, *frames], zmq.NOBLOCK, copy=False)
        except zmq.ZMQError:  # peer gone or its queue is full: it will reconnect or re-ask
            self.counters["control_unroutable"] += 1

    # ---------------------------------------------------------------- status
    def _sample_rates(self, now: float) -> None:
        """Throughput over the last heartbeat interval, for `zddrl status`."""
        self._rate_mark, rates = throughput(self._rate_mark, self.counters, now)
        self.rates = rates or self.rates

    def status(self, page: int = 1) -> dict[str, Any]:
        return broker_status(self, page)

    def _on_status(self, identity: bytes, page: int) -> None:
        """The status body, within the rates of membership.Limits; over them, a tiny reject: what a peer that never
        reads its replies can make the broker hold is bounded by the rates and the control socket's HWM."""
        now = time.monotonic()
        frames = P.encode(P.Status(body=self.status(page))) if self.limits.status.allow(identity, now) else None
        if frames is not None and self.limits.status_bytes(sum(map(len, frames)), now):
            self._send_frames(self.control, identity, frames)
            return
        self.counters["status_refused"] += 1
        self._ratelog.warning("status_refused", "refused a status request: over the status rate")
        self._send_frames(self.control, identity, _STATUS_REFUSED)
