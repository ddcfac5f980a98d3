"""One control session of a client with a broker: when to beat, when to say hello again, when the broker is gone.

A session starts with a hello on a fresh control DEALER (``BrokerLink`` and a relay's ``Uplink`` both keep one) and
ends when the broker counts as gone (docs/protocol.md section 5.2):

* silent for heartbeat interval x liveness: the only sign when its host vanished or the network parted;
* with a fallback list, its connection down (closed, refused, or its handshake failed) for one heartbeat interval
  without coming back: the socket monitor (``transport.handshakes``) sees a killed broker's kernel close the
  connection at once. A broker restarted in place within that interval keeps its clients.

Hellos: one in flight at a time. A broker that lost us (restarted, or expired us) rejects every message we had
queued for it with "send hello first"; only the first such reject is answered with a hello, the rest answer
messages sent before that hello. A hello unanswered for an interval was lost (it went to a dying broker, or the
broker's hello limit dropped it): the next reject gets another.

A passive broker of a standby pair (``broker.peer``) answers the hello with a ``passive:`` reject: the session ends
at once (``passive``) and the client moves on to the next broker of its list.
"""

from __future__ import annotations

from zddrl import protocol as P

HEARTBEAT_INTERVAL_S = 1.0
"""Until the welcome says otherwise."""
HEARTBEAT_LIVENESS = 3
SILENT = "silent"
"""``Session.ended`` when the broker was silent for interval x liveness."""
PASSIVE = "it is a passive standby"
"""Start of ``Session.ended`` when the broker sent us to its peer (``Session.passive``)."""


class Session:
    """The deadlines and the hello of one session; every method takes the monotonic time ``now``.

    Usage (a client's loop)::

        session = Session(now, fallback=len(brokers) > 1)   # the hello has just gone out
        while not session.ended(now):
            ...  # on a welcome: session.welcomed(msg, now); on any message: session.heard(now)
            if reject.rehello and session.wants_hello(now): send(hello)
            if session.beat_due(now): send(heartbeat)
    """

    def __init__(
        self,
        now: float,
        *,
        fallback: bool,
        interval_s: float = HEARTBEAT_INTERVAL_S,
        liveness: int = HEARTBEAT_LIVENESS,
    ) -> None:
        self.fallback = fallback
        """The client has other brokers to go to: a connection down for an interval ends the session."""
        self.interval_s, self.liveness = interval_s, liveness
        """Until a welcome says otherwise: the last session's schedule (the brokers of a list share one), else
        the defaults. With the defaults, a client that lost a broker on 0.2 s heartbeats would wait 1 s on each dead
        broker of its list before trying the next."""
        self.deadline = now + self.interval_s * self.liveness
        self.next_beat = now + self.interval_s
        self.welcomed_once = False
        self.hello_at: float | None = now
        """When the hello in flight went out; None while none is (the last one was answered)."""
        self.down_since: float | None = None
        """Since when the connection has been down, per the socket monitor; None while it is up."""
        self.sent_away = ""
        """The reason of a passive broker's reject, once one came: the session is over."""

    def heard(self, now: float) -> None:
        """Anything from the broker on control: it is alive for another interval x liveness. (Not a sign that the
        connection is up: what was read may have come before it closed; only the monitor tells.)"""
        self.deadline = now + self.interval_s * self.liveness

    def welcomed(self, msg: P.Welcome, now: float) -> None:
        """A welcome: the broker's heartbeat schedule from now on, and the hello answered."""
        self.welcomed_once = True
        self.hello_at = None
        self.interval_s, self.liveness = msg.heartbeat_interval_s, msg.heartbeat_liveness
        self.heard(now)
        # Beat on the broker's schedule at once: on the default 1 s, a broker configured with interval x liveness
        # under 1 s would expire a healthy member.
        self.next_beat = min(self.next_beat, now + self.interval_s)

    def retimed(self, interval_s: float, now: float) -> None:
        """A broker heartbeat's interval (its fleet grew or shrank; 0: unchanged)."""
        if interval_s > 0 and interval_s != self.interval_s:
            self.interval_s = interval_s
            self.heard(now)
            self.next_beat = min(self.next_beat, now + interval_s)

    def wants_hello(self, now: float) -> bool:
        """A reject asks for a hello: True (send it; it counts as on its way from now) unless one already is."""
        if self.hello_at is not None and now - self.hello_at < self.interval_s:
            return False
        self.hello_at = now
        return True

    def beat_due(self, now: float) -> bool:
        """True when a heartbeat is due now (the next one is then one interval away)."""
        if now < self.next_beat:
            return False
        self.next_beat = now + self.interval_s
        return True

    def connection(self, up: bool | None, now: float) -> None:
        """What the socket monitor said of the connection (None: nothing new)."""
        if up:
            self.down_since = None
        elif up is not None and self.down_since is None:
            self.down_since = now

    def passive(self, reason: str) -> None:
        """The broker is the passive one of a standby pair (a ``passive:`` reject): it will not take us."""
        self.sent_away = reason

    def ended(self, now: float) -> str:
        """Why the broker counts as gone ("" while it does not), for the log line that moves on: starts with
        ``PASSIVE`` when a passive broker sent us to its peer."""
        if self.sent_away:
            return f"{PASSIVE}: {self.sent_away}"
        if now > self.deadline:
            return SILENT
        if self.fallback and self.down_since is not None and now - self.down_since >= self.interval_s:
            return f"no connection to it for {now - self.down_since:.1f} s"
        return ""
