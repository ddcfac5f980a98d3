"""A relay's session with its upstream broker: the client side of the bus, run inside the relay's own poll loop.

An actor host's ``transport.link.BrokerLink`` runs this conversation in a thread and hands whole parameter
versions to its owner; a relay needs the raw frames (to publish them on as they are, signatures and all) and
the credit in its own loop, so its link is this single-threaded record instead: three sockets the relay polls
with its own, and the session's state. Per session (one welcome from one broker of ``--upstream``):

    control  DEALER  hello (role relay), heartbeats, subtree reports; welcome, credit, snapshots, rejects
    params   SUB     the upstream's parameter versions, published on to the relay's actors
    push     PUSH    the relay's actors' trajectories, frames untouched, at most ``window`` unacknowledged

A session ends as a client's does (``transport.session.Session``): silent for heartbeat interval x liveness, or,
with a list, its connection down for an interval (the control socket's monitor, ``transport.handshakes``, which also
says why a handshake failed), or at once when a passive broker of a standby pair sends it on; the next broker of the
list (or the same one, after a backoff: ``transport.fallback.Brokers``) gets a fresh hello. Within a session one
hello is in flight at a time. What was pushed and not acknowledged when a session ends is counted in ``lost`` (it may
or may not have been read upstream; nobody will say).
"""

from __future__ import annotations

import time
from typing import Any

import zmq
from loguru import logger

from zddrl import keys
from zddrl import protocol as P
from zddrl.transport.fallback import Brokers
from zddrl.transport.handshakes import HandshakeWatch
from zddrl.transport.link import PARAMS_RCVHWM
from zddrl.transport.session import HEARTBEAT_INTERVAL_S, HEARTBEAT_LIVENESS, Session


class Uplink:
    """Sockets and state of the relay's current upstream session (``control`` None: between sessions)."""

    def __init__(
        self, connect: str, hello: P.Hello, ctx: zmq.Context, credentials: keys.Credentials | None = None
    ) -> None:
        self.brokers = Brokers(connect)
        self.hello = hello
        self.ctx = ctx
        self.credentials = credentials
        self.control: zmq.Socket | None = None
        self.sub: zmq.Socket | None = None
        self.push: zmq.Socket | None = None
        self.welcome: P.Welcome | None = None
        """The current session's welcome (None before it, and between sessions)."""
        self.sent = 0
        """Trajectories pushed upstream in this session..."""
        self.acked = 0
        """...and how many of them the upstream returned credit for."""
        self.lost = 0
        """Pushed and never acknowledged when a session ended (every session)."""
        self.acked_before = 0
        """Acknowledged in the sessions that ended: ``acked_total`` = this + ``acked``."""
        self.sessions = 0
        self.session: Session | None = None
        """The deadlines and the hello of the current session (None between sessions)."""
        self.schedule = (HEARTBEAT_INTERVAL_S, HEARTBEAT_LIVENESS)
        """The heartbeat interval and liveness of the last session: the next one starts on them."""
        self.reopen_at = 0.0
        role, key = (credentials.client.role, credentials.client.name) if credentials else ("relay", "")
        self.handshakes = HandshakeWatch(role, key, logger.bind(role="relay"))
        """The control socket's monitor: why a handshake failed, and whether the connection is up."""
        self.hellos = 0
        """Hellos sent upstream, every session."""

    @property
    def acked_total(self) -> int:
        """Acknowledged by the upstream, every session: sent == acked_total + in_flight + lost, over all sessions."""
        return self.acked_before + self.acked

    @property
    def in_flight(self) -> int:
        """Pushed upstream and not yet acknowledged (credit returned) in this session."""
        return self.sent - self.acked

    def _socket(self, kind: int) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if self.credentials is not None:
            self.credentials.apply(sock)
        return sock

    @property
    def monitor(self) -> zmq.Socket | None:
        return self.handshakes.monitor

    def open(self, now: float) -> tuple[zmq.Socket, zmq.Socket]:
        """Start a session with ``brokers.current``: a fresh DEALER and a hello on it. Returns the sockets to poll:
        the DEALER and its monitor."""
        self.control = self._socket(zmq.DEALER)
        monitor = self.handshakes.watch(self.control)
        self.control.connect(self.brokers.current)
        self.control.send_multipart(P.encode(self.hello), zmq.NOBLOCK)  # a fresh pipe: never full
        self.hellos += 1
        self.session = Session(
            now, fallback=len(self.brokers) > 1, interval_s=self.schedule[0], liveness=self.schedule[1]
        )
        return self.control, monitor

    def watch(self, now: float) -> None:
        """The monitor reported: failed handshakes are logged, and the session learns if the connection is up."""
        if self.session is not None:
            self.session.connection(self.handshakes.drain(self.brokers.current), now)

    def rehello(self, now: float) -> bool:
        """A reject asks for a hello: send one unless one is on its way (``Session.wants_hello``); True if sent."""
        if self.session is None or not self.session.wants_hello(now):
            return False
        self.hellos += 1
        return self.send(self.hello)

    def welcomed(self, welcome: P.Welcome, now: float) -> zmq.Socket:
        """A welcome: (re)open the data sockets of the broker that sent it (``Brokers.endpoint``); returns the SUB."""
        self._close_data()
        self._end_credit()  # a re-welcome is a new session for the credit too (the link's rule)
        self.welcome = welcome
        if self.session is not None:
            self.session.welcomed(welcome, now)  # the upstream's schedule from now on
        self.push = self._socket(zmq.PUSH)
        # No high-water mark: the relay's credit (its window) bounds what is queued here, and a send within the
        # window must never fail because the window grew with the fleet since this socket was made.
        self.push.setsockopt(zmq.SNDHWM, 0)
        self.push.connect(self.brokers.endpoint("trajectories", welcome.ports))
        self.sub = self._socket(zmq.SUB)
        self.sub.setsockopt(zmq.RCVHWM, PARAMS_RCVHWM)
        self.sub.setsockopt(zmq.MAXMSGSIZE, welcome.max_message_bytes + P.MAX_HEADER_BYTES + 4096)
        self.sub.setsockopt(zmq.SUBSCRIBE, P.PREAMBLE)
        self.sub.connect(self.brokers.endpoint("params", welcome.ports))
        self.sessions += 1
        return self.sub

    def heard_interval(self, interval_s: float, now: float) -> None:
        """The upstream's heartbeat set a new interval (its fleet grew or shrank; 0: unchanged)."""
        if self.session is not None:
            self.session.retimed(interval_s, now)

    def beat_heard(self, now: float) -> None:
        """Anything from upstream: it is alive for another interval x liveness."""
        if self.session is not None:
            self.session.heard(now)

    def beat_due(self, now: float) -> bool:
        """A heartbeat (and the subtree report with it) is due now."""
        return self.session is not None and self.session.beat_due(now)

    def ended(self, now: float) -> str:
        """Why the session's upstream counts as gone ("" while it does not: ``Session.ended``)."""
        return self.session.ended(now) if self.session is not None else ""

    def credit(self, n: int) -> None:
        self.acked = min(self.sent, self.acked + n)

    def send(self, msg: P.Message) -> bool:
        """Queue a control message upstream, never blocking (a periodic one that cannot go now goes next time)."""
        if self.control is None:
            return False
        try:
            self.control.send_multipart(P.encode(msg), zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False

    def close(self, now: float, linger_ms: int = 0) -> float:
        """End the session (silent upstream, or shutting down: ``linger_ms`` lets a last bye leave); returns the
        seconds to wait before the next."""
        served = self.welcome is not None
        answered = self.session is not None and bool(self.session.sent_away)  # a passive standby sent us on
        if self.session is not None:
            self.schedule = (self.session.interval_s, self.session.liveness)
        self._close_data()
        if self.control is not None:
            self.handshakes.stop(self.control)
            self.control.close(linger=linger_ms)
            self.control = None
        self.session = None
        self._end_credit()
        self.welcome = None
        wait_s = self.brokers.next(served, answered)
        self.reopen_at = now + wait_s
        return wait_s

    def _end_credit(self) -> None:
        self.lost += self.in_flight
        self.acked_before += self.acked
        self.sent = self.acked = 0

    def _close_data(self) -> None:
        for name in ("sub", "push"):
            sock = getattr(self, name)
            if sock is not None:
                sock.close(linger=0)
                setattr(self, name, None)

    def status(self) -> dict[str, Any]:
        return {
            "connect": self.brokers.current,
            "welcomed": self.welcome is not None,
            "run_id": self.welcome.run_id if self.welcome is not None else "",
            "in_flight": self.in_flight,
            "sent": self.sent,
            "acked": self.acked,
            "acked_total": self.acked_total,
            "lost": self.lost,
            "sessions": self.sessions,
            "silent_s": round(self._silent_s(time.monotonic()), 3),
        }

    def _silent_s(self, now: float) -> float:
        """Seconds since the upstream was last heard in this session (0 between sessions)."""
        s = self.session
        return max(0.0, now - (s.deadline - s.interval_s * s.liveness)) if s is not None else 0.0
