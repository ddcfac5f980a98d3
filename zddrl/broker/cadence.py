"""The broker's heartbeat interval, which grows with its fleet so that the control plane's cost stays bounded.

Each direct member sends a heartbeat every interval (an actor its stats too) and the broker sends each one a beat:
about three messages per member per interval, and each costs the broker's Python loop 50-100 us (waking up,
receiving, decoding, handling; `zddrl bench fleet`). At a fixed 1 s that is ~16 % of a core for 1,024 actors and
grows linearly with the fleet. So the interval is ``base_s`` while the members fit ``rate`` heartbeats a second,
and doubles (2, 4, 8 ... x ``base_s``) as the fleet passes each multiple of it: the cost stays near ``rate``
members' worth whatever the fleet's size, and what it costs is time to notice a dead member (interval x liveness).
Members learn a new interval from the broker's next heartbeat (``Heartbeat.interval_s``, docs/protocol.md 5.2);
until all have, expiry allows the longer of the old and the new one.

Pure bookkeeping: no sockets, no members; the broker calls ``fit`` on its periodic tick.
"""

from __future__ import annotations

from zddrl.protocol import MAX_HEARTBEAT_INTERVAL_S

SHRINK_MARGIN = 0.75
"""The interval comes down only once the fleet fits the shorter one with this margin: a fleet that hovers around
a boundary does not make every member change its interval at every tick."""


class Cadence:
    """``interval_s``: the heartbeat interval now; ``fit(members, now)`` on the broker's tick; ``expiry_s(now)``:
    how long a member may be silent before it is expired."""

    def __init__(self, base_s: float, liveness: int, rate: float) -> None:
        self.base_s, self.liveness, self.rate = base_s, liveness, rate
        self.interval_s = base_s
        self._was_s = base_s
        """The interval before the last change, which members may keep until they hear the new one..."""
        self._was_until = 0.0
        """...until this time (monotonic)."""

    def wanted(self, members: int) -> float:
        """The shortest interval ``base_s x 2**k`` at which ``members`` heartbeats fit ``rate`` per second."""
        interval = self.base_s
        if self.rate > 0:
            while members > self.rate * interval and interval * 2 <= MAX_HEARTBEAT_INTERVAL_S:
                interval *= 2
        return interval

    def fit(self, members: int, now: float) -> bool:
        """Set the interval for ``members`` direct members; True if it changed (tell them: send a beat now)."""
        want = self.wanted(members)
        if want < self.interval_s and members > SHRINK_MARGIN * self.rate * want:
            want = min(want * 2, self.interval_s)  # near the boundary: one step wider than the fleet needs
        if want == self.interval_s:
            return False
        if want < self.interval_s:  # members beat at the old, longer interval until the next beat tells them
            self._was_s, self._was_until = self.interval_s, now + self.interval_s * self.liveness
        self.interval_s = want
        return True

    def keeping_s(self, now: float) -> float:
        """The longest interval a member may still be beating at: the old one, after the interval came down, until
        every member has heard of the new one (membership.id_conflict judges silence against it)."""
        return self._was_s if now < self._was_until and self._was_s > self.interval_s else self.interval_s

    def expiry_s(self, now: float) -> float:
        """Seconds of silence after which a member is expired: ``liveness`` intervals of the longest one it may
        still be keeping, and after the interval came down one new interval more (a member that beat at the old
        interval just before hearing the new one beats next a new interval later)."""
        keeping = self.keeping_s(now)
        return keeping * self.liveness + (self.interval_s if keeping > self.interval_s else 0.0)
