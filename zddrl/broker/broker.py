"""The broker: one public address; routes trajectories to learner shards and fans out parameters.

Sockets (all bound by the broker; clients learn the data ports from the welcome)::

    control       ROUTER  hello/welcome, heartbeats both ways, stats, status, parameter snapshots (publisher.py),
                          fleet messages to learner shards (roster.py)
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

A broker whose config names an upstream is a relay (upstream.py): its outlet is the upstream instead of learner
shards, and its run and versions come from there (upstream.py).
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import zmq
from loguru import logger

from zddrl import keys
from zddrl import protocol as P
from zddrl.broker.auth import AUTH_COUNTERS, BrokerAuth, source_fd, user_of
from zddrl.broker.cadence import Cadence
from zddrl.broker.guard import Claims, Guard, revoked_reject
from zddrl.broker.health import HealthMonitor
from zddrl.broker.health_events import HealthOfMembers, log_health_events
from zddrl.broker.joining import Joining
from zddrl.broker.limits import Limits, UnreadReplies
from zddrl.broker.liveness import Liveness
from zddrl.broker.membership import Member, Membership
from zddrl.broker.memory import MemoryBudget, SocketResets, limit_bytes
from zddrl.broker.publisher import Publisher
from zddrl.broker.report import BROKER_COUNTERS, StatusReport
from zddrl.broker.routing import FORWARD_BURST, Outlet, Router
from zddrl.broker.run import CurrentRun
from zddrl.broker.shards import Shards
from zddrl.broker.sockets import MAX_FRAMES, BrokerSockets, Replies, drained
from zddrl.broker.standby import standby_of
from zddrl.broker.subtree import Subtrees
from zddrl.broker.uplink import Uplink
from zddrl.broker.upstream import Upstream, UpstreamOutlet, relay_hello
from zddrl.brokerconf import SOCKET_NAMES, BrokerConfig, is_ipc, split_endpoint
from zddrl.keys import KeysError
from zddrl.logs import RateLimitedLog
from zddrl.protocol.rules import RunBus, run_bus
from zddrl.transport.io import NOBLOCK, recv_frames

POLL_TIMEOUT_S = 0.1
_STATUS_REFUSED = P.encode(P.Reject(reason="status: rate limited, ask less often"))
_UNKNOWN_PEER = P.encode(P.Reject(reason="unknown peer: send hello first", rehello=True))
Handler = Callable[[bytes, Sequence[Any], str], None]


class Broker:
    """Run with ``Broker(config).bind()`` then ``run(stop_event)``; ``close()`` in a finally.

    Its parts, each with one responsibility: ``membership`` (who is joined, the roster of actors and the departures;
    it tells the others of every join and leave), ``joining`` (hellos judged, members admitted, welcomes),
    ``router`` (the data path) with its outlet (``shards``, or a relay's ``upstream.outlet``), ``publisher``
    (parameter versions), ``subtrees`` (the relays below), ``upstream`` (a relay's side; None at a root), ``guard``
    (the closed bus) and ``health``; ``current`` is the run. The broker runs the loop, hands each socket's messages
    to them (``handle_control``, ``handle_learner``: one message each, as the loop does), adopts runs
    (``start_run``) and versions (``publish``), and keeps liveness and status.

    ``credentials``: a relay's client keys towards its upstream on a closed bus (docs/security.md); ``key``: the name
    of the broker's own pair in ``KEYS/broker/`` (``--key``; needed when it holds several secrets)."""

    router: Router
    """The data path (made by ``bind``, with the sockets)."""

    def __init__(
        self,
        config: BrokerConfig,
        context: zmq.Context | None = None,
        credentials: keys.Credentials | None = None,
        key: str | None = None,
    ) -> None:
        self.config = config
        self.key = key
        # A context holds one ZAP handler at a fixed inproc address, and a closed one is unbound asynchronously:
        # a keyed broker gets a context of its own (two in one process, or one after another, never clash).
        self._own_ctx = context is None and bool(config.keys)
        self.ctx = zmq.Context() if self._own_ctx else (context or zmq.Context.instance())
        self.credentials = credentials
        self.log = logger.bind(role="relay" if config.upstream else "broker")
        self.counters: dict[str, int] = defaultdict(int, dict.fromkeys((*BROKER_COUNTERS, *AUTH_COUNTERS), 0))
        self.ports: dict[str, int] = {}
        self.ratelog = RateLimitedLog()
        self.health = HealthMonitor()
        self.cadence = Cadence(config.heartbeat_interval_s, config.heartbeat_liveness, config.heartbeat_rate)
        """The heartbeat interval, grown with the fleet (broker/cadence.py)."""
        self.membership = Membership(self.counters, grace_s=self.cadence.expiry_s(0.0))
        self.current = CurrentRun()
        self.limits = Limits()
        """Rates per connection and member caps on the public control port (limits.py)."""
        self.unread = UnreadReplies(drained)
        """Status replies that connections hold unread, bounded in bytes (limits.py)."""
        self.memory = MemoryBudget(limit_bytes(config.memory_limit_mib))
        """The resident set, and when to reset the sockets (memory.py)."""
        self.auth: BrokerAuth | None = None
        """CURVE and ZAP on every socket (``config.keys``); None on an open bus."""
        self.poller = zmq.Poller()
        self.upstream: Upstream | None = None
        """A relay's side of the loop (``config.upstream``); None at a root broker."""
        self.standby = standby_of(config, self.membership.members.__len__)  # broker.peer (standby.py)
        self._next_tick = 0.0

    @property
    def members(self) -> dict[str, Member]:
        """Every member by peer id (``membership.members``; read it, change members through ``membership``)."""
        return self.membership.members

    # ---------------------------------------------------------------- setup
    def bind(self) -> dict[str, int]:
        """Create and bind every socket (``sockets.BrokerSockets``, their one owner, which every part that uses a
        socket holds) and the parts that use them; returns the ports."""
        c = self.config
        guard = self.guard = Guard(c, self.ctx, self.log, self.key)
        self.auth = guard.auth
        sockets = self.sockets = BrokerSockets(self.ctx, c, self.auth, self.poller, self.counters)
        self.ports = sockets.ports
        self.replies = Replies(sockets, "control", self.counters)
        roster = self.membership.roster
        self.shards = Shards(
            sockets, self.replies, self.current, roster, guard, self.publish, self.counters, self.ratelog
        )
        relay = self._relay_outlet() if c.upstream else None
        outlet: Outlet = self.shards if relay is None else relay
        self.router = Router(
            sockets, outlet, self.membership, self.current, guard, self.replies, self.counters,
            c.max_message_bytes, self.ratelog,
        )  # fmt: skip
        self.publisher = Publisher(
            sockets.publish, self.replies.send_frames, self.counters, self.ratelog, c.heartbeat_interval_s, guard.pins
        )
        self.claims = Claims(self.membership)
        """Which key holds which peer id, on a closed bus (guard.py)."""
        self.joining = Joining(
            c, self.membership, self.current, guard, self.limits, self.cadence, self.ports, self.replies,
            self.counters, self.ratelog, self.claims, takes_learners=relay is None, standby=self.standby,
        )  # fmt: skip
        self.subtrees = Subtrees(self.membership, self.joining.relayed_refused)
        self.liveness = Liveness(self.cadence, self.membership, self.current, self.replies, self.health, self.log)
        self.resets = SocketResets(
            self.memory, sockets, self._connections_closed, self.counters, self.ratelog, self.log
        )
        for listener in (self.shards, self.subtrees, self.claims, HealthOfMembers(self.health, self.ratelog)):
            self.membership.listen(listener)
        if relay is not None:
            self.upstream = self._upstream(relay)
            self.membership.listen(self.upstream)
            self.log.info(f"relay {relay.uplink.hello.peer_id}: upstream {c.upstream}")
        self.report = StatusReport(
            counters=self.counters, current=self.current, membership=self.membership, router=self.router,
            subtrees=self.subtrees, health=self.health, cadence=self.cadence, memory=self.memory, unread=self.unread,
            ports=self.ports, auth=self.auth, upstream=self.upstream, standby=self.standby,
        )  # fmt: skip
        closed = "closed (CURVE, keys from " + c.keys + ")" if self.auth is not None else "open (no keys)"
        if is_ipc(c.bind):  # the directory's owner-only mode closes it to other local users (docs/security.md)
            closed = closed.replace("open (no keys)", "local (ipc, owner-only directory; no keys)")
            self.log.info(
                f"broker bound on {c.bind} (and its siblings {', '.join(SOCKET_NAMES[1:])}); the bus is {closed}"
            )
        else:
            self.log.info(f"broker bound on {split_endpoint(c.bind)[0]}: {self.ports}; the bus is {closed}")
        return dict(self.ports)

    def _connections_closed(self) -> None:
        """A memory reset closed every control connection: each key may take its ids back at once, and the
        connections' unread replies went with them."""
        for member in self.membership.members.values():
            if member.conn_fd >= 0:
                self.claims.connection_closed(member.conn_fd)
            member.conn_fd = -1  # the descriptor may be reused by another connection: never read it again
        self.unread.clear()

    def _relay_outlet(self) -> UpstreamOutlet:
        """A relay's outlet, on a session with its upstream (opened by the loop: ``Upstream.serve``)."""
        c = self.config
        uplink = Uplink(c.upstream, relay_hello(self.ports.get("control") or c.bind), self.ctx, self.credentials)
        return UpstreamOutlet(uplink, c.upstream_window, self.membership.roster, self.current)

    def _upstream(self, outlet: UpstreamOutlet) -> Upstream:
        return Upstream(
            outlet.uplink,
            outlet,
            poller=self.poller,
            current=self.current,
            membership=self.membership,
            router=self.router,
            health=self.health,
            guard=self.guard,
            start_run=self.start_run,
            publish=self.publish,
            counters=self.counters,
            ratelog=self.ratelog,
            max_message_bytes=self.config.max_message_bytes,
        )

    def close(self) -> None:
        # Runs in the CLI's finally, also after a bind() that failed half-way: must not hide that error.
        if self.standby is not None:
            self.standby.close()
        if self.upstream is not None:
            self.upstream.close()
        sockets = getattr(self, "sockets", None)
        if sockets is not None:
            sockets.close()
        guard = getattr(self, "guard", None)
        if guard is not None:
            guard.close()
        if self._own_ctx:
            self.ctx.term()

    # ---------------------------------------------------------------- main loop
    def run(self, stop: threading.Event) -> None:
        """Serve until ``stop`` is set. Never raises on bad input: drops, counts and logs it."""
        roster, sockets = self.membership.roster, self.sockets
        while not stop.is_set():
            sockets.poll("trajectories", self.router.outlet.credit > 0)
            timeout_s = POLL_TIMEOUT_S
            if roster.changed:  # wake up when the fleet announcement is due
                timeout_s = min(timeout_s, max(0.0, roster.next_at - time.monotonic()))
            events = dict(self.poller.poll(int(timeout_s * 1000)))
            if sockets.control in events:
                self._drain(sockets.control, "control", self._on_control)
            if sockets.learners in events:
                self._drain(sockets.learners, "learner", self._on_learner)
            if self.upstream is not None:
                self.upstream.serve(events, time.monotonic())
            if sockets.trajectories in events or (
                self.router.outlet.credit > 0 and "trajectories" not in sockets.polled
            ):
                self.router.forward()  # credit that just came: forward now, not after one more poll
            if sockets.handshakes is not None:
                for monitor in sockets.handshakes.monitors:
                    if monitor in events:
                        self._drain_monitor(monitor)
            now = time.monotonic()
            if roster.changed and now >= roster.next_at:
                self.shards.announce(now)
            if now >= self._next_tick:
                self._tick(now)
                self._next_tick = now + self.config.heartbeat_interval_s
            if now >= self.memory.next_at:
                self.resets.check(now)
            self.liveness.beat(now)

    def _tick(self, now: float) -> None:
        """Every ``heartbeat_interval_s``, whatever the fleet's heartbeat interval: credit left pending, liveness,
        unread replies, health, logs, rates, keys."""
        for member in self.membership.members.values():
            self.router.return_credit(member)  # what a batch left pending: no actor waits longer than this for it
        self.liveness.tick(now)
        self.unread.sweep(now)
        self.health.evaluate(now)
        log_health_events(self.ratelog, self.health.pop_events())
        self.ratelog.flush()
        self.report.sample(now)
        if self.standby is not None:
            self.standby.tick(now)  # state changes on the loop: never between a hello and its admission
        if self.auth is not None:
            self.counters["zap_denied"] = self.guard.zap_denied()
            self.auth.check_alive(self.ratelog)  # a dead ZAP handler admits no one: said every log interval
            self._refresh_keys()

    def _drain_monitor(self, monitor: zmq.Socket) -> None:
        """Handshakes counted; control connections that closed told to the claims (their members' ids)."""
        if self.sockets.handshakes is None:
            return
        for fd in self.sockets.handshakes.drain(monitor, self.counters):
            self.claims.connection_closed(fd)

    def _drain(self, sock: zmq.Socket, what: str, handler: Handler) -> None:
        most = MAX_FRAMES["control" if what == "control" else "learners"]
        for _ in range(FORWARD_BURST):
            try:
                frames = recv_frames(sock, NOBLOCK)
            except zmq.Again:
                return
            if len(frames) > most:  # malformed, and dropped before anything looks at it: its memory goes back at once
                self.counters[f"{what}_malformed"] += 1
                self.counters[f"{what}_too_many_frames"] += 1
                why = f"dropped a {what} message of {len(frames)} frames (at most {most} on this socket)"
                self.ratelog.warning(f"{what}_too_many_frames", why)
                continue
            self._guarded(what, self._routed, handler, frames, user_of(frames[0]) if self.auth is not None else "")

    @staticmethod
    def _routed(handler: Handler, frames: Sequence[Any], user: str) -> None:
        identity, body = P.split_routed(frames)
        handler(identity, body, user)

    def _guarded(self, what: str, handler: Callable[..., None], *args: Any) -> None:
        # Each socket has its own counters: bad credit on the learner socket is not control traffic.
        try:
            handler(*args)
        except P.ProtocolError as exc:
            self.counters[f"{what}_malformed"] += 1
            self.ratelog.warning(f"{what}_malformed", f"dropped a malformed {what} message: {exc}")
        except Exception as exc:  # noqa: BLE001
            # Bad input must never stop the broker, whatever it raises: count, log (rate-limited), serve on.
            self.counters[f"{what}_errors"] += 1
            self.ratelog.warning(
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
    def handle_control(self, identity: bytes, frames: Sequence[Any], user: str = "") -> None:
        """One message of the control socket, as the loop handles it: ``identity`` the ROUTER's identity frame,
        ``frames`` the message, ``user`` its connection's ZAP User-Id ("" on an open bus). Bad input is counted
        (``control_malformed``, ``control_errors``) and dropped, never raised."""
        self._guarded("control", self._on_control, identity, frames, user)

    def _on_control(self, identity: bytes, frames: Sequence[Any], user: str) -> None:
        if self.auth is not None and not self.guard.admitted(user):  # revoked since admitted
            self.counters["auth_refused"] += 1
            self.replies.send(identity, revoked_reject())
            return
        msg = self._decode(frames)
        member = self.membership.of_identity(identity)
        if member is not None and member.user != user:  # a routing id a member used, from another key
            self.counters["auth_refused"] += 1
            member = None
        if member is not None:
            member.last_seen = time.monotonic()
        if isinstance(msg, P.Hello):
            self._on_hello(identity, msg, user, source_fd(frames[0]) if self.sockets.handshakes is not None else -1)
        elif isinstance(msg, P.StatusRequest):
            self._on_status(identity, msg.page, user, source_fd(frames[0]))
        elif member is None:
            self.reply_unjoined(identity, user, source_fd(frames[0]), _UNKNOWN_PEER, time.monotonic())
        elif self.standby is not None and not self.standby.active and member.role != "monitor":  # stepped down
            self.membership.remove(member, "sent to the peer broker: this one is passive")
            self.replies.send(identity, P.Reject(reason=self.standby.refusal()))
        else:
            self._on_member(member, msg)

    def _on_member(self, member: Member, msg: P.Message) -> None:
        """A control message of a joined member."""
        if isinstance(msg, P.Heartbeat):
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
                self.ratelog.warning("stats_truncated", truncated)
            self.health.observe(member.peer_id, member.role, member.stats, time.monotonic())
            log_health_events(self.ratelog, self.health.pop_events())
        elif isinstance(msg, P.Bye):
            if msg.reason.startswith(P.CRASH_PREFIX):
                self.log.error(
                    f"{member.role} {member.peer_id} on {member.host or '?'} (pid {member.pid}) {msg.reason}"
                )
            else:
                self.log.info(f"{member.role} {member.peer_id} left: {msg.reason or 'bye'}")
            self.membership.remove(member, msg.reason or "bye")
        else:
            raise P.ProtocolError(f"{msg.KIND} is not a control message")

    def _on_hello(self, identity: bytes, msg: P.Hello, user: str, fd: int = -1) -> None:
        if self.sockets.handshakes is not None:  # closed bus: connections that closed before this hello come first
            self._drain_monitor(self.sockets.handshakes.monitors[0])
        joining = self.joining
        assigned = joining.assigned(identity, msg, user)  # an actor that asks for a peer id (auto_id) gets one here
        if assigned is None or joining.refused(identity, assigned, user):
            return
        msg = assigned
        if joining.starts_run(msg):
            self.start_run(msg.run_id, msg.run or {}, (msg.run_signer, msg.run_signature), run_bus(msg.bus))
        member = joining.admit(identity, msg, user, fd)  # a relay reports an actor upstream here, before its welcome
        self.log.info(f"{msg.role} {msg.peer_id} joined from {msg.host or '?'} (pid {msg.pid}, {msg.num_envs} envs)")
        self.replies.send(identity, joining.welcome(msg.peer_id))
        if msg.role in ("actor", "relay"):
            self.publisher.on_join(member)
        elif msg.role == "learner" and member.run_id == self.current.run_id:
            self.shards.send_fleet(member)

    def start_run(self, run_id: str, spec: dict[str, Any], seal: tuple[str, bytes], bus: RunBus) -> None:
        """Adopt a new run (a learner's hello, or a relay's upstream's welcome): versions start again, no shard of
        another run gets its data, and every actor, relay and replay waiting without it (or on an old one) is
        welcomed into it."""
        self.log.info(f"run {run_id!r} starts (previous: {self.current.run_id or 'none'})")
        self.current.start(run_id, spec, seal, bus)
        self.publisher.new_run()
        self.health.start_run(bus.staleness, run_id)
        self.shards.follow_run(run_id)
        for member in self.membership.members.values():
            if member.role in ("actor", "relay", "replay") and not member.relay:
                self.replies.send(member.identity, self.joining.welcome(member.peer_id))

    # ---------------------------------------------------------------- learner socket
    def handle_learner(self, identity: bytes, frames: Sequence[Any], user: str = "") -> None:
        """One message of the learners socket, as the loop handles it (as ``handle_control``; counted as
        ``learner_malformed``, ``learner_errors``)."""
        self._guarded("learner", self._on_learner, identity, frames, user)

    def _on_learner(self, identity: bytes, frames: Sequence[Any], user: str) -> None:
        self.shards.on_message(identity, self._decode(frames), frames, user)

    def publish(self, msg: P.Parameters | P.ParamChunk, frames: Sequence[Any]) -> bool:
        """One message of a version (a learner's, or a relay's upstream's), published once checked
        (Publisher.add); True if it completed a version, now the run's newest."""
        if not self.publisher.add(msg, frames, self.current.run_id):
            return False
        self.current.policy_version = self.publisher.version
        self.health.published(self.current.policy_version, self.publisher.cache.param_hash)
        return True

    # ---------------------------------------------------------------- keys
    def _refresh_keys(self) -> None:
        """Keys added to or removed from the directory take effect now; a revoked key's members are removed and
        told so, and whatever its open connections still send is refused."""
        try:
            revoked = self.guard.refresh()
        except KeysError as exc:
            self.ratelog.warning("keys", f"key directory {self.config.keys}: {exc}; the allow-lists stay as they were")
            return
        if revoked:
            self.log.warning(f"keys revoked: {', '.join(sorted(revoked))}; their members are removed")
        for member in [m for m in self.membership.members.values() if m.user in revoked]:
            self.membership.remove(member, "its key was revoked")
            self.replies.send(member.identity, revoked_reject())

    # ---------------------------------------------------------------- status
    def status(self, page: int = 1) -> dict[str, Any]:
        """The status body (docs/protocol.md section 9), ``page`` of its member rows."""
        return self.report.body(page)

    def _on_status(self, identity: bytes, page: int, user: str, fd: int) -> None:
        """The status body, within the rates of limits.Limits; over them, a tiny reject. Either goes out only if
        the connection's unread replies leave room (``reply_unjoined``)."""
        now = time.monotonic()
        frames = P.encode(P.Status(body=self.status(page))) if self.limits.status.allow(identity, now) else None
        if frames is None or not self.limits.status_bytes(sum(map(len, frames)), now):
            frames = _STATUS_REFUSED
        if self.reply_unjoined(identity, user, fd, frames, now) and frames is _STATUS_REFUSED:
            self.counters["status_refused"] += 1
            self.ratelog.warning("status_refused", "refused a status request: over the status rate")

    def reply_unjoined(self, identity: bytes, user: str, fd: int, frames: Sequence[Any], now: float) -> bool:
        """Send ``frames`` to a connection that has not joined (a status reply, a "send hello first") if what the
        connections hold unread leaves room (limits.UnreadReplies); else drop it, counted (``replies_unread``): one
        that did not read its last replies would not read this one either. True if it went out."""
        if self.unread.admit(fd, identity, user, sum(map(len, frames)), now):
            self.replies.send_frames(identity, frames)
            return True
        self.counters["replies_unread"] += 1
        self.ratelog.warning("replies_unread", f"dropped a reply to a connection that does not read: {self.unread}")
        return False
