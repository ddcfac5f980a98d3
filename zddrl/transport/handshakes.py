"""A closed-bus client's watch on its CURVE handshakes: a key the broker refuses is otherwise only silence.

``BrokerLink`` opens one per control session when it has credentials; ``drain`` counts the failures the socket
monitor reports and says once per HANDSHAKE_LOG_EVERY_S which key failed and what to check.
"""

from __future__ import annotations

import time
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
HANDSHAKE_LOG_EVERY_S = 30.0
"""A refused CURVE handshake is retried by ZeroMQ every reconnect interval: say so once per this many seconds."""


class HandshakeWatch:
    """Counts the failed handshakes of one control socket (``failures`` goes on across sessions)."""

    def __init__(self, role: str, name: str, log: Any) -> None:
        self.role, self.name, self.log = role, name, log
        self.failures = 0
        self.monitor: zmq.Socket | None = None
        self._logged = 0.0

    def watch(self, control: zmq.Socket) -> zmq.Socket:
        """Start watching ``control``; returns the monitor socket to poll."""
        self.monitor = control.get_monitor_socket(HANDSHAKE_FAILED)
        return self.monitor

    def drain(self, broker: str) -> None:
        assert self.monitor is not None
        while True:
            try:
                event = recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            self.failures += 1
            now = time.monotonic()
            if now - self._logged >= HANDSHAKE_LOG_EVERY_S:
                self._logged = now
                why = "refused our key" if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH else "failed"
                self.log.error(
                    f"the CURVE handshake with the broker at {broker} {why} ({self.failures} so far): is the "
                    f"{self.role} key {self.name!r} in the broker's key directory, and is the broker key in ours "
                    "this broker's? (docs/security.md)"
                )

    def stop(self, control: zmq.Socket) -> None:
        if self.monitor is not None:
            control.disable_monitor()
            self.monitor.close(linger=0)
            self.monitor = None
