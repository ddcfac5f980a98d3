"""A learner's wait for the broker's welcome, and what it says when none comes.

The link (``BrokerLink``) keeps reconnecting on its own thread while the learner waits here in short slices, so
that a stop signal ends the wait at once instead of after the whole timeout, and a broker that never answers is
one line that says what to do, before anything of the run is written.
"""

from __future__ import annotations

import threading
import time

from zddrl import protocol as P
from zddrl.transport.link import BrokerLink, Refused

WELCOME_TIMEOUT_S = 60.0
WELCOME_POLL_S = 0.2
"""How often a learner waiting for its welcome looks at its stop event: a stop signal ends the wait this soon."""


class NotJoined(RuntimeError):
    """No broker welcomed the learner (none answered in time, or it was stopped first): no run was started and
    nothing was written to its run directory."""


def await_welcome(link: BrokerLink, stop: threading.Event, connect: str) -> P.Welcome:
    """The broker's welcome on ``link``; Refused, or NotJoined when none came within WELCOME_TIMEOUT_S or ``stop``
    was set first (``connect``: the learner's --connect, for the message)."""
    deadline = time.monotonic() + WELCOME_TIMEOUT_S
    welcome = None
    while welcome is None and not link.refused and not stop.is_set() and time.monotonic() < deadline:
        welcome = link.wait_welcome(min(WELCOME_POLL_S, max(0.0, deadline - time.monotonic())))
    if link.refused:
        raise Refused(link.refused)
    if welcome is not None:
        return welcome
    if stop.is_set():
        raise NotJoined(f"stopped before a broker answered at {connect}: no run was started")
    raise NotJoined(
        f"no broker answered at {connect} within {WELCOME_TIMEOUT_S:.0f} s: start `zddrl broker` there "
        "or fix --connect (no run was started)"
    )
