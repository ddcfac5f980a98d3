"""Liveness on the broker's side: its heartbeat to every direct member, at the interval the fleet's size asks for
(cadence.Cadence), and the removal of members silent for longer than ``liveness`` intervals.

The broker's loop calls ``beat`` after socket handling at every iteration (it sends when due) and ``tick`` on its
periodic tick: the zguide's order (heartbeats and purging after all socket activity).
"""

from __future__ import annotations

from typing import Any

from zddrl import protocol as P
from zddrl.broker.cadence import Cadence
from zddrl.broker.health import HealthMonitor
from zddrl.broker.membership import Membership
from zddrl.broker.run import CurrentRun
from zddrl.broker.sockets import Replies


class Liveness:
    """``beat(now)`` sends the broker's heartbeat when due; ``tick(now)`` fits the interval to the fleet and expires
    the silent."""

    def __init__(
        self,
        cadence: Cadence,
        membership: Membership,
        current: CurrentRun,
        replies: Replies,
        health: HealthMonitor,
        log: Any,
    ) -> None:
        self.cadence = cadence
        self.membership = membership
        self.current = current
        self.replies = replies
        self.health = health
        self.log = log
        self.next_beat = 0.0
        """Monotonic time of the broker's next heartbeat."""

    def beat(self, now: float) -> None:
        """Every member's heartbeat, if one is due."""
        if now < self.next_beat:
            return
        # One message for every member, encoded once: the pass over 1,024 members took 20-30 ms when each was
        # encoded and sent with send_multipart (zddrl bench fleet), and it stalls forwarding meanwhile.
        interval_s = self.cadence.interval_s
        beat = P.Heartbeat(peer_id="broker", policy_version=self.current.policy_version, interval_s=interval_s)
        frames = P.encode(beat)
        for member in self.membership.by_identity.values():  # a relayed actor's relay gets the one beat
            self.replies.send_frames(member.identity, frames)
        self.next_beat = now + interval_s

    def tick(self, now: float) -> None:
        """The heartbeat interval for the members joined now (a relayed actor's relay beats for it), then expiry."""
        direct = len(self.membership.by_identity)
        cadence = self.cadence
        if cadence.fit(direct, now):
            self.log.info(
                f"heartbeat interval {cadence.interval_s:g} s for {direct} members "
                f"(broker.heartbeat_rate {cadence.rate:g}/s)"
            )
            self.next_beat = now  # they learn it from the next beat
        # What an actor sent before it left counts as its own for as long as it could have been silent.
        self.membership.departures.grace_s = cadence.expiry_s(now)
        self.health.report_interval_s = max(1.0, cadence.interval_s)  # actors report at most once a second
        for member in self.membership.silent(now, cadence.expiry_s(now)):
            silent = f"silent for {now - member.last_seen:.1f} s"
            self.log.warning(f"{member.role} {member.peer_id} expired: {silent}")
            self.membership.remove(member, f"expired: {silent}")
