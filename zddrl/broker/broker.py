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
from collections import defaultdict
from collections.abc import Sequence
from functools import partial
from typing import Any

import zmq
from loguru import logger

from zddrl import protocol as P
from zddrl.broker.auth import AUTH_COUNTERS, BrokerAuth, HandshakeCounter, user_of
from zddrl.broker.cadence import Cadence
from zddrl.broker.fleet import Fleet
from zddrl.broker.guard import Guard, revoked_reject
from zddrl.broker.health import HealthMonitor
from zddrl.broker.joining import Joining
from zddrl.broker.membership import Departures, Limits, Member, log_health_events
from zddrl.broker.publisher import Publisher
from zddrl.broker.report import BROKER_COUNTERS, RATES, broker_status, throughput
from zddrl.broker.routing import DATA_ROLES, FORWARD_BURST, Router, RunRoute
from zddrl.broker.sockets import open_sockets
from zddrl.broker.subtree import Subtrees
from zddrl.config import BrokerConfig, split_endpoint
from zddrl.keys import KeysError
from zddrl.logs import RateLimitedLog
from zddrl.transport.io import NOBLOCK, recv_frames, send_frames

POLL_TIMEOUT_S = 0.1
_STATUS_REFUSED = P.encode(P.Reject(reason="status: rate limited, ask less often"))


class Broker(Joining):
    """Run with ``Broker(config).bind()`` then ``run(stop_event)``; ``close()`` in a finally."""

    publisher: Publisher
    """The parameter side: verifies, publishes and keeps versions, sends snapshots (made by ``bind``)."""
    guard: Guard
    """The closed bus's checks (made by ``bind``, where a bad key directory is a ConfigError)."""
    router: Router
    """The data path: trajectories to shards by credit, and its accounting (made by ``bind``)."""
    ROUTER: type[Router] = Router
    """The data path's class: a relay's sends upstream instead (relay.UpstreamRouter)."""

    def __init__(self, config: BrokerConfig, context: zmq.Context | None = None) -> None:
        self.config = config
        # A context holds one ZAP handler at a fixed inproc address, and a closed one is unbound asynchronously:
        # a keyed broker gets a context of its own (two in one process, or one after another, never clash).
        self._own_ctx = context is None and bool(config.keys)
        self.ctx = zmq.Context() if self._own_ctx else (context or zmq.Context.instance())
        self.log = logger.bind(role="broker")
        self.members: dict[str, Member] = {}
        self.by_identity: dict[bytes, Member] = {}
        self.rates: dict[str, float] = dict.fromkeys(RATES, 0.0)
        self._rate_mark: tuple[float, int, int, int, int] | None = None
        self.run_id = ""
        self.run_spec: dict | None = None
        self.run_seal: tuple[str, bytes] = ("", b"")
        """(signer, signature) of the run spec, from its learner's hello: every welcome passes them on."""
        self.policy_version = -1
        """The newest published version of the run (the publisher's; read per trajectory, so kept here too)."""
        self.counters: dict[str, int] = defaultdict(int, dict.fromkeys((*BROKER_COUNTERS, *AUTH_COUNTERS), 0))
        self.started = time.monotonic()
        self.ports: dict[str, int] = {}
        self._ratelog = RateLimitedLog()
        self.health = HealthMonitor()
        # What an actor sent before it left counts as its own for as long as it could have been silent.
        self.cadence = Cadence(config.heartbeat_interval_s, config.heartbeat_liveness, config.heartbeat_rate)
        """The heartbeat interval, grown with the fleet (broker/cadence.py)."""
        self.departures = Departures(self.cadence.expiry_s(0.0))
        self._next_tick = 0.0
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
        self.limits = Limits()
        """Rates per connection and member caps on the public control port (membership.Limits)."""
        self.subtrees = Subtrees(self)
        """The relays below this broker and their actors (broker/subtree.py)."""

    # ---------------------------------------------------------------- setup
    def bind(self) -> dict[str, int]:
        """Create and bind every socket (``sockets.open_sockets``); returns the bound ports."""
        c = self.config
        guard = self.guard = Guard(c, self.ctx, self.log)
        self.auth = guard.auth
        s = open_sockets(self.ctx, c, self.auth)
        self.control, self.trajectories, self.learners, self.params = s.control, s.trajectories, s.learners, s.params
        self.ports = s.ports
        send_control = partial(self._send_frames, self.control)
        self.router = self.ROUTER(
            self.trajectories,
            self.learners,
            self.members,
            self.counters,
            self.departures,
            guard,
            send_control,
            c.max_message_bytes,
            self._ratelog,
        )
        self.publisher = Publisher(
            self.params, send_control, self.counters, self._ratelog, c.heartbeat_interval_s, guard.pins
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
        told so, and whatever its open connections still send is refused."""
        try:
            revoked = self.guard.refresh()
        except KeysError as exc:
            self._ratelog.warning("keys", f"key directory {self.config.keys}: {exc}; the allow-lists stay as they were")
            return
        if revoked:
            self.log.warning(f"keys revoked: {', '.join(sorted(revoked))}; their members are removed")
        for member in [m for m in self.members.values() if m.user in revoked]:
            self._remove(member, "its key was revoked")
            self._send(self.control, member.identity, revoked_reject())

    def close(self) -> None:
        # Runs in the CLI's finally, also after a bind() that failed half-way: must not hide that error.
        if self.handshakes is not None:
            self.handshakes.close()
        for name in ("control", "trajectories", "learners", "params"):
            sock = getattr(self, name, None)
            if sock is not None:
                sock.close(linger=0)
        guard = getattr(self, "guard", None)
        if guard is not None:
            guard.close()
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
            self._serve_upstream(events)
            if self.trajectories in events or (self.router.credit > 0 and not self._poll_traj):
                # credit that just came: forward now, not after one more poll
                self.router.forward(RunRoute(self.run_id, self.policy_version, self._staleness, self._credit_batch))
            if self.handshakes is not None:
                for monitor in self.handshakes.monitors:
                    if monitor in events:
                        self.handshakes.drain(monitor, self.counters)
            now = time.monotonic()
            if self.fleet.changed and now >= self.fleet.next_at:
                self._announce_fleet(now)
            if now >= self._next_tick:
                self._tick(now)
                self._next_tick = now + self.config.heartbeat_interval_s
            if now >= self._next_beat:
                self._send_heartbeats()
                self._next_beat = now + self.cadence.interval_s

    def _tick(self, now: float) -> None:
        """Every ``heartbeat_interval_s``, whatever the fleet's heartbeat interval: credit left pending, liveness,
        health, logs, rates, keys."""
        for member in self.members.values():
            self.router.return_credit(member)  # what a batch left pending: no actor waits longer than this for it
        self._fit_cadence(now)
        self._purge_expired(now)
        self.health.evaluate(now)
        self._log_health()
        self._ratelog.flush()
        self._sample_rates(now)
        if self.auth is not None:
            self.counters["zap_denied"] = self.guard.zap_denied()
            self._refresh_keys()

    def _serve_upstream(self, events: dict) -> None:
        """A relay's link to its upstream broker (relay.Relay); a root broker has none."""

    def _update_trajectory_polling(self) -> None:
        want = self.router.credit > 0
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

    # ---------------------------------------------------------------- control socket
    def _on_control(self, identity: bytes, frames: Sequence[Any], user: str) -> None:
        if self.auth is not None and not self.guard.admitted(user):  # revoked since admitted
            self.counters["auth_refused"] += 1
            self._send(self.control, identity, revoked_reject())
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
        elif isinstance(msg, P.Subtree):
            self.subtrees.report(member, msg)
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

    # ---------------------------------------------------------------- learner socket
    def _on_learner(self, identity: bytes, frames: Sequence[Any], user: str) -> None:
        # Shards' data DEALERs use the identity of their welcome (their control link does not).
        member = self.router.by_data_id.get(identity)
        msg = self._decode(frames)  # a ProtocolError is counted as learner_malformed by _drain
        if member is not None and member.user != user:  # the identity of a learner, taken by another key
            self.counters["auth_refused"] += 1
            member = None
        if member is None or member.role not in DATA_ROLES:
            self._send(self.learners, identity, P.Reject(reason="unknown learner: send hello first", rehello=True))
            return
        member.last_seen = time.monotonic()
        if isinstance(msg, P.Credit):
            if msg.credit <= 0 or msg.credit > 1 << 20:
                raise P.ProtocolError(f"credit must be in 1..2**20, got {msg.credit}")
            if member.run_id == self.run_id:  # credit of another run's learner is not for this run's data
                self.router.set_credit(member, member.credit + msg.credit)
            else:
                self.counters["credit_other_run"] += 1
        elif isinstance(msg, (P.Parameters, P.ParamChunk)) and member.role == "replay":
            raise P.ProtocolError(f"a replay service publishes no parameters ({member.peer_id} sent {msg.KIND})")
        elif isinstance(msg, (P.Parameters, P.ParamChunk)):
            why = self.guard.params_refusal(msg, user, self.run_seal[0]) if isinstance(msg, P.Parameters) else ""
            if why:  # its chunks find no head to join: counted as orphans by the publisher
                self.counters["params_signature"] += 1
                self._ratelog.warning("params_signature", f"dropped a parameter version of {member.peer_id}: {why}")
            elif self.publisher.add(msg, frames, self.run_id):  # a whole, verified version went out
                self.policy_version = member.policy_version = self.publisher.version
                self.health.published(self.policy_version, self.publisher.cache.param_hash)
        else:
            raise P.ProtocolError(f"{msg.KIND} is not a learner-socket message")

    # ---------------------------------------------------------------- fleet
    def _announce_fleet(self, now: float) -> None:
        """At loop level, at most once per FLEET_COALESCE_S: every learner of the run that has not got the
        current fleet gets it (nothing goes out if the map came back to what was announced)."""
        self.fleet.announce(now)
        for shard in self.router.shards.values():
            if shard.run_id == self.run_id and shard.fleet_seq != self.fleet.seq:
                self._send_fleet(shard)

    def _send_fleet(self, shard: Member) -> None:
        self._send_frames(self.control, shard.identity, self.fleet.frames(self.run_id))
        shard.fleet_seq = self.fleet.seq
        self.counters["fleet_sent"] += 1

    # ---------------------------------------------------------------- liveness
    def _fit_cadence(self, now: float) -> None:
        """The heartbeat interval for the members joined now (a relayed actor's relay beats for it)."""
        if self.cadence.fit(len(self.by_identity), now):
            self.log.info(
                f"heartbeat interval {self.cadence.interval_s:g} s for {len(self.by_identity)} members "
                f"(broker.heartbeat_rate {self.config.heartbeat_rate:g}/s)"
            )
            self._next_beat = now  # they learn it from the next beat
        self.departures.grace_s = self.cadence.expiry_s(now)
        self.health.report_interval_s = max(1.0, self.cadence.interval_s)  # actors report at most once a second

    def _send_heartbeats(self) -> None:
        # One message for every member, encoded once: the pass over 1,024 members took 20-30 ms when each was
        # encoded and sent with send_multipart (zddrl bench fleet), and it stalls forwarding meanwhile.
        beat = P.Heartbeat(peer_id="broker", policy_version=self.policy_version, interval_s=self.cadence.interval_s)
        frames = P.encode(beat)
        for member in self.by_identity.values():  # a relayed actor's relay gets the one beat
            self._send_frames(self.control, member.identity, frames)

    def _purge_expired(self, now: float) -> None:
        limit = self.cadence.expiry_s(now)
        for member in list(self.members.values()):
            if now - member.last_seen > limit and not member.relay:  # relayed ones go with their relay
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
        if self.by_identity.get(member.identity) is member:  # a relayed actor's identity is its relay's
            del self.by_identity[member.identity]
        self.router.remove_shard(member)
        if member.role == "actor":
            self.fleet.left(member.peer_id)
        self.subtrees.forget(member)

    def _send(self, sock: zmq.Socket, identity: bytes, msg: P.Message) -> None:
        self._send_frames(sock, identity, P.encode(msg))

    def _send_frames(self, sock: zmq.Socket, identity: bytes, frames: Sequence[Any]) -> None:
        try:  # io.send_frames: ~1.3 us a message where send_multipart takes ~8.5 (bench fleet's heartbeat pass)
            send_frames(sock, frames, NOBLOCK, prefix=identity)
        except zmq.ZMQError:  # peer gone or its queue is full: it will reconnect or re-ask
            self.counters["control_unroutable"] += 1

    # ---------------------------------------------------------------- status
    def _sample_rates(self, now: float) -> None:
        """Throughput over the last heartbeat interval, for `zddrl status`."""
        self._rate_mark, rates = throughput(self._rate_mark, self.counters, now)
        self.rates = rates or self.rates

    def status(self, page: int = 1) -> dict[str, Any]:
        return broker_status(self, page)

    def upstream_status(self) -> dict[str, Any] | None:
        """A relay's upstream session (relay.Relay); None at a root broker."""
        return None

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
