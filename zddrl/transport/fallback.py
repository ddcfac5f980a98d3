"""Which broker a client talks to next: one endpoint, or a fallback list tried round robin.

``BrokerLink`` holds one ``Brokers``; when its session with the current broker ends (silent for heartbeat
interval x liveness, or, with a list, its connection down for an interval: ``transport.session``) it calls
``next(served)`` and waits what that returns. With one broker this is the reconnect backoff of docs/protocol.md
section 5.2; with several, moving on within a pass over the list is immediate and the same capped backoff comes
between full passes. A pass in which a passive broker of a standby pair answered (it sent us to its peer) waits
RECONNECT_INITIAL_S only: its peer is about to take over, or is there and unreachable from here for now.
"""

from __future__ import annotations

from zddrl.config import socket_endpoint, split_endpoints
from zddrl.transport.session import PASSIVE

RECONNECT_INITIAL_S = 0.25
RECONNECT_MAX_S = 8.0


class Brokers:
    """``current`` is the endpoint to try now; ``next(served) -> wait_s`` moves on after a session ended.

    Usage (the link thread)::

        brokers = Brokers("tcp://a:5555,tcp://b:5555")
        while running:
            served = talk_to(brokers.current)   # True if that broker welcomed us
            time.sleep(brokers.next(served))
    """

    def __init__(self, connect: str) -> None:
        self.endpoints = split_endpoints(connect)
        self.at = 0
        self.pass_start = 0
        """Where the current pass over the list began: the broker that welcomed us last (at first, the first)."""
        self.pass_served = False
        """Whether a broker of the current pass welcomed us."""
        self.backoff = RECONNECT_INITIAL_S

    def __len__(self) -> int:
        return len(self.endpoints)

    @property
    def current(self) -> str:
        return self.endpoints[self.at]

    def endpoint(self, name: str, ports: dict[str, int]) -> str:
        """Where the socket ``name`` of ``current`` is, its welcome having named ``ports``: that port on its host,
        or on a local bus the file ``name`` beside its control endpoint (config.socket_endpoint)."""
        return socket_endpoint(self.current, name, ports)

    def next(self, served: bool, answered: bool = False) -> float:
        """The session with ``current`` ended (``served``: it had welcomed us; ``answered``: it is a passive standby
        that sent us on): move to the next broker and return the seconds to wait before trying it. Within a pass: 0.
        After a full pass (with one broker: every time): RECONNECT_INITIAL_S if a broker of the pass welcomed us or
        answered as passive, else twice the last wait, up to RECONNECT_MAX_S."""
        if served:
            self.pass_start, self.pass_served = self.at, True
        elif answered:
            self.pass_served = True
        self.at = (self.at + 1) % len(self.endpoints)
        if self.at != self.pass_start:
            return 0.0
        self.backoff = RECONNECT_INITIAL_S if self.pass_served else min(self.backoff * 2, RECONNECT_MAX_S)
        self.pass_served = False
        return self.backoff

    def moving(self, silent: str, wait_s: float, why: str = "") -> str:
        """The log line for leaving the silent broker ``silent`` for ``current`` after ``wait_s``; ``why``: what more
        is known of its silence (its connection closed, its handshake refused), if anything."""
        state = "silent"
        if why.startswith(PASSIVE):  # it answered: not silent, only not the one to talk to
            state, why = PASSIVE.removeprefix("it "), why.removeprefix(f"{PASSIVE}: ")
        why = f" ({why})" if why else ""
        if len(self.endpoints) == 1:
            return f"broker at {silent} {state}; reconnecting in {wait_s:.2f} s{why}"
        later = f" in {wait_s:.2f} s" if wait_s else ""
        return f"broker at {silent} {state}; moving to the broker at {self.current}{later}{why}"
