"""A relay's session with its upstream broker: the client side of the bus, run inside the relay's own poll loop.

An actor host's ``transport.link.BrokerLink`` runs this conversation in a thread and hands whole parameter
versions to its owner; a relay needs the raw frames (to publish them on as they are, signatures and all) and
the credit in its own loop, so its link is this single-threaded record instead: three sockets the relay polls
with its own, and the session's state. Per session (one welcome from one broker of ``--upstream``):

    control  DEALER  hello (role relay), heartbeats, subtree reports; welcome, credit, snapshots, rejects
    params   SUB     the upstream's parameter versions, published on to the relay's actors
    push     PUSH    the relay's actors' trajectories, frames untouched, at most ``window`` unacknowledged

A session that goes silent for heartbeat interval x liveness ends; the next broker of the list (or the same one,
after a backoff: ``transport.fallback.Brokers``) gets a fresh hello. What was pushed and not acknowledged when
a session ends is counted in ``lost`` (it may or may not have been read upstream; nobody will say).
"""

from __future__ import annotations

import time
from typing import Any

import zmq

from zddrl import keys
from zddrl import protocol as P
from zddrl.transport.fallback import Brokers
from zddrl.transport.link import HEARTBEAT_INTERVAL_S, HEARTBEAT_LIVENESS, PARAMS_RCVHWM


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
        self.interval_s, self.liveness = HEARTBEAT_INTERVAL_S, HEARTBEAT_LIVENESS
        self.deadline = self.next_beat = self.reopen_at = 0.0

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

    def open(self, now: float) -> zmq.Socket:
        """Start a session with ``brokers.current``: a fresh DEALER and a hello on it."""
        self.control = self._socket(zmq.DEALER)
        self.control.connect(self.brokers.current)
        self.control.send_multipart(P.encode(self.hello), zmq.NOBLOCK)  # a fresh pipe: never full
        self.interval_s, self.liveness = HEARTBEAT_INTERVAL_S, HEARTBEAT_LIVENESS
        self.deadline = now + self.interval_s * self.liveness
        self.next_beat = now + self.interval_s
        return self.control

    def welcomed(self, welcome: P.Welcome, now: float) -> zmq.Socket:
        """A welcome: (re)open the data sockets on the host of the broker that sent it; returns the new SUB."""
        self._close_data()
        self._end_credit()  # a re-welcome is a new session for the credit too (the link's rule)
        self.welcome = welcome
        self.interval_s, self.liveness = welcome.heartbeat_interval_s, welcome.heartbeat_liveness
        self.beat_heard(now)
        self.next_beat = min(self.next_beat, now + self.interval_s)  # the upstream's schedule from now on
        host = self.brokers.host
        self.push = self._socket(zmq.PUSH)
        # No high-water mark: the relay's credit (its window) bounds what is queued here, and a send within the
        # window must never fail because the window grew with the fleet since this socket was made.
        self.push.setsockopt(zmq.SNDHWM, 0)
        self.push.connect(f"tcp://{host}:{welcome.ports['trajectories']}")
        self.sub = self._socket(zmq.SUB)
        self.sub.setsockopt(zmq.RCVHWM, PARAMS_RCVHWM)
        self.sub.setsockopt(zmq.MAXMSGSIZE, welcome.max_message_bytes + P.MAX_HEADER_BYTES + 4096)
        self.sub.setsockopt(zmq.SUBSCRIBE, P.PREAMBLE)
        self.sub.connect(f"tcp://{host}:{welcome.ports['params']}")
        self.sessions += 1
        return self.sub

    def heard_interval(self, interval_s: float, now: float) -> None:
        """The upstream's heartbeat set a new interval (its fleet grew or shrank; 0: unchanged)."""
        if interval_s > 0 and interval_s != self.interval_s:
            self.interval_s = interval_s
            self.beat_heard(now)
            self.next_beat = min(self.next_beat, now + interval_s)

    def beat_heard(self, now: float) -> None:
        """Anything from upstream: it is alive for another interval x liveness."""
        self.deadline = now + self.interval_s * self.liveness

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
        self._close_data()
        if self.control is not None:
            self.control.close(linger=linger_ms)
            self.control = None
        self._end_credit()
        self.welcome = None
        wait_s = self.brokers.next(served)
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
            "silent_s": round(max(0.0, time.monotonic() - (self.deadline - self.interval_s * self.liveness)), 3),
        }
