"""The broker's side of the health checks: onsets and ends logged (rate-limited per check), and a departed member's
warnings dropped with it."""

from __future__ import annotations

from collections.abc import Iterable

from zddrl.broker.health import HealthMonitor, HealthWarning
from zddrl.broker.membership import Listener, Member
from zddrl.logs import RateLimitedLog


class HealthOfMembers(Listener):
    """A member that departed for good takes its health warnings with it (and the log says they ended)."""

    def __init__(self, health: HealthMonitor, ratelog: RateLimitedLog) -> None:
        self.health, self.ratelog = health, ratelog

    def departed(self, member: Member, reason: str) -> None:
        self.health.forget(member.peer_id)
        log_health_events(self.ratelog, self.health.pop_events())


def log_health_events(log: RateLimitedLog, events: Iterable[tuple[bool, HealthWarning]]) -> None:
    """Onsets and ends, rate-limited per check: a thousand actors warned at once make one line and a count, not a
    thousand (their rows are in the status body). Keyed by check, not member: the log's keys are never forgotten,
    and peer ids come from peers."""
    for raised, w in events:
        if raised:
            log.warning(f"health/{w.check}", f"health: {w.member}: {w.check}: {w.message}")
        else:
            log.info(f"health-end/{w.check}", f"health: {w.member}: {w.check} cleared")
