"""A relay's side of the broker loop: what goes up to its upstream broker and what comes down.

A relay is a ``Broker`` whose config names an upstream (``zddrl broker --upstream tcp://ROOT:PORT``): a broker whose
learner is another broker.

Actors join a relay exactly as they join a root broker (same protocol, same welcome, same credit). The relay:

* takes its run from its upstream's welcome (the run spec and its signature, passed on untouched, and the run's
  ``bus``, which it reads) and welcomes its actors into it; it takes no learners;
* forwards each admitted trajectory upstream on one PUSH, frames untouched (peer id, run id and version are the
  actor's), with credit end to end: it holds ``window`` unacknowledged at most, and reads its actors' socket only
  while it has credit left, so a learner that stops reading stops the root, the root stops acknowledging, the
  relay stops reading, and its actors block in their own window. Every trajectory read is forwarded or dropped
  with a reason: ``received == forwarded + dropped + in_flight`` holds here as at any broker;
* subscribes to its upstream's parameter versions, checks them as its own learners' would be checked
  (``publisher.Publisher``: every hash, and the signature against its pinned learner keys on a closed bus), and
  publishes and caches them for its actors (a late joiner gets the newest version from the relay);
* reports its subtree upstream (subtree messages: its actors, before each is welcomed, and its counters), so
  that the root's fleet message and ``zddrl status`` count the relay's actors (broker/subtree.py).

Its side of the loop, made here:

* ``UpstreamOutlet``, the relay's data outlet (routing.Outlet): each admitted trajectory goes up on the session's
  PUSH, frames untouched, while the relay holds credit: ``window`` unacknowledged at most, within a session of its
  own run. A learner that stops reading stops the root, the root stops acknowledging, the relay stops reading.
* ``Upstream``, the session's messages (its sockets and state are ``uplink.Uplink``): the run from the upstream's
  welcome (its signature checked against the relay's pins, passed on untouched), parameter versions (checked as a
  learner's would be, then published to the relay's actors), credit, and the subtree reports that go up (a
  membership listener: each actor before it is welcomed, and one that leaves).

The broker (broker.py) makes both when its config names an upstream, and calls ``Upstream.serve`` once per loop
iteration after its own sockets.
"""

from __future__ import annotations

import os
import socket
import time
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import zmq
from loguru import logger

from zddrl import protocol as P
from zddrl.broker.guard import Guard
from zddrl.broker.health import HealthMonitor
from zddrl.broker.membership import Listener, Member, Membership
from zddrl.broker.publisher import Publish
from zddrl.broker.roster import Roster
from zddrl.broker.routing import FORWARD_BURST, Router
from zddrl.broker.run import CurrentRun
from zddrl.broker.uplink import Uplink
from zddrl.logs import RateLimitedLog
from zddrl.protocol.rules import RunBus, run_bus
from zddrl.transport import signatures as signing
from zddrl.transport.io import NOBLOCK, recv_frames, send_frames
from zddrl.transport.link import BYE_LINGER_MS
from zddrl.transport.session import SILENT

WINDOW_PER_ACTOR_WINDOWS = 2
"""The automatic upstream window is this many times the sum of the relay's actors' windows."""

StartRun = Callable[[str, dict, tuple[str, bytes], RunBus], None]
"""Broker.start_run: the broker adopts a run (its id, spec, seal, and what the bus must know of it)."""


def relay_hello(control: int | str) -> P.Hello:
    """The relay's hello to its upstream: its peer id names its host and control port (a local bus's relay: a
    digest of its control endpoint, the same at each restart)."""
    host = socket.gethostname()
    tag = control if isinstance(control, int) else f"ipc{zlib.crc32(control.encode()):08x}"
    return P.Hello(role="relay", peer_id=f"relay-{host}-{tag}", host=host, pid=os.getpid())


class RelayRefused(RuntimeError):
    """The upstream broker refused the relay's hello (the message says why); retrying would not help."""


class UpstreamOutlet:
    """The relay's outlet (routing.Outlet): trajectories up on the session's PUSH, within the window's credit."""

    def __init__(self, uplink: Uplink, fixed_window: int, roster: Roster, current: CurrentRun) -> None:
        self.uplink = uplink
        self.fixed_window = fixed_window
        """BrokerConfig.upstream_window; 0: WINDOW_PER_ACTOR_WINDOWS x the actors' windows."""
        self.roster = roster
        self.current = current
        self.credit = 0
        """Trajectories the relay may push now (``refresh`` sets it once per loop iteration, each push takes one)."""

    @property
    def window(self) -> int:
        """Trajectories the relay may have pushed upstream and not had acknowledged."""
        auto = WINDOW_PER_ACTOR_WINDOWS * self.current.bus.max_in_flight * max(1, len(self.roster))
        return self.fixed_window or auto

    def refresh(self) -> None:
        """Credit only within a session of this relay's run: what is pushed to another run is dropped upstream."""
        up, run_id = self.uplink, self.current.run_id
        live = up.push is not None and up.welcome is not None and bool(run_id) and up.welcome.run_id == run_id
        self.credit = max(0, self.window - up.in_flight) if live else 0

    def deliver(self, frames: Sequence[Any], nbytes: int) -> str:
        up = self.uplink
        if up.push is None or self.credit <= 0:
            return "dropped a trajectory: no upstream session with credit"
        try:
            send_frames(up.push, frames, NOBLOCK)
        except zmq.ZMQError as exc:  # no high-water mark on this socket: not expected, but never lost silently
            return f"dropped a trajectory: the upstream socket refused it ({exc})"
        up.sent += 1
        self.credit -= 1
        return ""


class Upstream(Listener):
    """The relay's upstream session inside its broker's loop (``serve``), and its reports (``accounting``)."""

    def __init__(
        self,
        uplink: Uplink,
        outlet: UpstreamOutlet,
        *,
        poller: zmq.Poller,
        current: CurrentRun,
        membership: Membership,
        router: Router,
        health: HealthMonitor,
        guard: Guard,
        start_run: StartRun,
        publish: Publish,
        counters: dict[str, int],
        ratelog: RateLimitedLog,
        max_message_bytes: int,
    ) -> None:
        self.uplink, self.outlet = uplink, outlet
        self.poller = poller
        self.current = current
        self.membership = membership
        self.router = router
        self.health = health
        self.guard = guard
        self.start_run = start_run
        self.publish = publish
        self.counters = counters
        self._ratelog = ratelog
        self.max_message_bytes = max_message_bytes
        self.log = logger.bind(role="relay")
        self._subtree_seq = 0

    # ---------------------------------------------------------------- the loop
    def serve(self, events: dict, now: float) -> None:
        """After the broker's own sockets: open a session when due, read what came down, beat and report, end a
        silent session; then the outlet's credit for this iteration."""
        up = self.uplink
        if up.control is None:
            if now >= up.reopen_at:
                for sock in up.open(now):
                    self.poller.register(sock, zmq.POLLIN)
        else:
            if up.monitor is not None and up.monitor in events:
                up.watch(now)
            if up.control in events:
                self._drain(up.control, now)
            if up.sub is not None and up.sub in events:
                self._drain(up.sub, now)
            if up.control is not None and up.beat_due(now):
                up.send(P.Heartbeat(peer_id=up.hello.peer_id, policy_version=self.current.policy_version))
                self.report(full=True)
            cause = up.ended(now) if up.control is not None else ""
            if cause:
                self._end_session(now, cause)
        self.outlet.refresh()

    def _drain(self, sock: zmq.Socket, now: float) -> None:
        for _ in range(FORWARD_BURST):
            if self.uplink.control is None:
                return  # the session ended (a refusal) while draining
            try:
                frames = recv_frames(sock, NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = P.decode(frames, self.max_message_bytes)
            except Exception as exc:  # noqa: BLE001 - whatever decode raises, the message is malformed
                self.counters["upstream_malformed"] += 1
                self._ratelog.warning("upstream_malformed", f"dropped a malformed message from upstream: {exc}")
                continue
            if sock is self.uplink.control:
                self.uplink.beat_heard(now)
            try:
                self._on_message(msg, frames, now)
            except RelayRefused:
                raise
            except Exception as exc:  # noqa: BLE001
                # Whatever the upstream sends (a welcome without a port, say), the relay keeps serving its actors.
                self.counters["upstream_errors"] += 1
                self._ratelog.warning(
                    "upstream_error", f"error handling a {msg.KIND} from upstream ({type(exc).__name__}: {exc})"
                )

    def _on_message(self, msg: P.Message, frames: Sequence[Any], now: float) -> None:
        up = self.uplink
        if isinstance(msg, (P.Parameters, P.ParamChunk)):
            self._on_params(msg, frames)
        elif isinstance(msg, P.Credit):
            if 0 < msg.credit <= 1 << 20:
                up.credit(msg.credit)
            else:
                self.counters["upstream_malformed"] += 1
        elif isinstance(msg, P.Welcome):
            self._on_welcome(msg, now)
        elif isinstance(msg, P.Heartbeat):
            up.heard_interval(msg.interval_s, now)
        elif isinstance(msg, P.Reject):
            if msg.reason.startswith(P.PASSIVE_PREFIX) and up.session is not None:  # on to the next broker at once
                up.session.passive(msg.reason)
            elif msg.reason.startswith(P.REFUSED_PREFIX):
                raise RelayRefused(f"the upstream broker at {up.brokers.current} refused this relay: {msg.reason}")
            elif not msg.rehello:
                self.log.warning(f"upstream rejected us: {msg.reason}")
            elif up.rehello(now):  # the first reject of a burst; the others answer what was sent before that hello
                self.log.warning(
                    f"the upstream broker at {up.brokers.current} does not know this relay (it restarted, or expired "
                    "it): saying hello again"
                )
        # any message keeps the session alive (beat_heard); fleet and status messages are not for a relay

    def _on_welcome(self, welcome: P.Welcome, now: float) -> None:
        """A session starts: the data sockets on the welcoming broker's host, and its run if it is a new one (and
        signed by a pinned learner key when the relay has keys). The run's ``bus`` is what the relay needs of it."""
        up = self.uplink
        if up.sub is not None:
            self.poller.unregister(up.sub)
        self.poller.register(up.welcomed(welcome, now), zmq.POLLIN)
        at = f" at {up.brokers.current}" if len(up.brokers) > 1 else ""
        self.log.info(f"welcomed by the upstream broker{at}: run {welcome.run_id or '(none yet)'}")
        if welcome.run_id and welcome.run is not None and welcome.run_id != self.current.run_id:
            why = ""
            if self.guard.pins is not None:
                why = signing.run_refusal(
                    welcome.run_id, welcome.run, welcome.run_signer, welcome.run_signature, self.guard.pins
                )
            if why:
                self.counters["runs_refused"] += 1
                self.log.error(f"upstream run {welcome.run_id!r} refused: {why}")
            else:
                seal = (welcome.run_signer, welcome.run_signature)
                self.start_run(welcome.run_id, welcome.run, seal, run_bus(welcome.bus))
        self.report(full=True)

    def _on_params(self, msg: P.Parameters | P.ParamChunk, frames: Sequence[Any]) -> None:
        """A version's message from upstream: published on to the actors once checked (Broker.publish), as a learner's
        would be; on a closed bus its head must be signed by the run's learner."""
        if self.guard.auth is not None and isinstance(msg, P.Parameters) and msg.signer != self.current.seal[0]:
            self.counters["params_signature"] += 1
            self._ratelog.warning(
                "params_signature", f"dropped version {msg.policy_version}: signed by {msg.signer!r}, not the run's"
            )
            return
        if msg.run_id == self.current.run_id and msg.policy_version <= self.current.policy_version:
            # A snapshot of what the PUB brought already (the upstream sends one after each hello): not news.
            self.counters["upstream_params_held"] += 1
            return
        self.publish(msg, frames)

    def _end_session(self, now: float, cause: str) -> None:
        """The upstream is gone (``cause``: ``Session.ended``): close the session, say when and where next."""
        up = self.uplink
        for sock in (up.control, up.sub, up.monitor):
            if sock is not None:
                self.poller.unregister(sock)
        silent = up.brokers.current
        refused = up.handshakes.refused
        wait_s = up.close(now)
        why = refused or ("" if cause == SILENT else cause)
        self.log.warning("upstream " + up.brokers.moving(silent, wait_s, why))

    # ---------------------------------------------------------------- reports
    def joined(self, member: Member) -> None:
        """An actor joined directly: upstream learns of it before it can send anything (it is welcomed next)."""
        if member.role == "actor" and not member.relay:
            self.report(full=False, actors={member.peer_id: _entry(member)})

    def left(self, member: Member) -> None:
        if member.role == "actor":
            self.report(full=False, left=[member.peer_id])

    def report(self, full: bool, actors: dict[str, dict] | None = None, left: Sequence[str] = ()) -> None:
        """A subtree message upstream (only within a session: the full report after the next welcome catches up)."""
        up = self.uplink
        if up.welcome is None:
            return
        versions: dict[str, int] = {}
        if full:
            joined = [m for m in self.membership.members.values() if m.role == "actor"]
            actors = {m.peer_id: _entry(m) for m in joined}
            versions = {m.peer_id: m.policy_version for m in joined}
        self._subtree_seq += 1
        msg = P.Subtree(
            peer_id=up.hello.peer_id,
            seq=self._subtree_seq,
            full=full,
            actors=actors or {},
            left=list(left),
            counters=self.accounting(),
            versions=versions,
        )
        up.send(msg)

    def accounting(self) -> dict[str, int]:
        """The relay's trajectory counters, as its subtree reports carry them."""
        r, c, up = self.router, self.counters, self.uplink
        return {
            "received": c["received"],
            "forwarded": c["forwarded"],
            "in_flight": r.in_flight,
            **{f"dropped_{k}": v for k, v in r.dropped.items()},
            "upstream_acked": up.acked_total,
            "upstream_in_flight": up.in_flight,
            "upstream_lost": up.lost,
            "window": self.outlet.window,
            "health_warnings": sum(self.health.counts().values()),
        }

    def status(self) -> dict[str, Any]:
        return {**self.uplink.status(), "peer_id": self.uplink.hello.peer_id, "window": self.outlet.window}

    def close(self) -> None:
        """A bye upstream, given a moment to leave, then the session's sockets."""
        up = self.uplink
        if up.control is not None:
            up.send(P.Bye(peer_id=up.hello.peer_id, reason="relay stopping"))
            up.close(time.monotonic(), linger_ms=BYE_LINGER_MS)


def _entry(member: Member) -> dict[str, Any]:
    return {"num_envs": member.num_envs, "host": member.host, "pid": member.pid}
