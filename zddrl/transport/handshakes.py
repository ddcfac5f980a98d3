"""A client's watch on its control connection: refused handshakes, which are otherwise only silence, and the
connection lost and regained, which the transport knows long before heartbeats expire.

``BrokerLink`` (and a relay's ``Uplink``) open one socket monitor per control session, keys or not: a client
without keys that reaches a closed bus fails its handshake just as a refused key does. ``drain`` reads the
monitor, says at once (then once per HANDSHAKE_LOG_EVERY_S) why a handshake failed and what to check, and
returns whether the connection is up or down now, which a client with a fallback list uses to move on early
(``transport.session``). ``refusal`` words a failed handshake for any client, `zddrl status` included.
"""

from __future__ import annotations

import time
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
CONNECTION_DOWN = zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED
"""The connection closed (the broker's process died: its kernel closed the socket), or a connect was refused."""
WATCHED = HANDSHAKE_FAILED | CONNECTION_DOWN | zmq.EVENT_HANDSHAKE_SUCCEEDED
HANDSHAKE_LOG_EVERY_S = 30.0
"""A refused handshake is retried by ZeroMQ (or by the next session): say so at once, then once per this long."""


def stop_monitor(sock: zmq.Socket, monitor: zmq.Socket) -> None:
    """Stop ``sock``'s monitor and close ``monitor``, its reading socket, in the one order that cannot wedge the
    process. libzmq's I/O thread sends each event with a blocking send, holding ``sock``'s monitor lock: closed
    first, ``monitor`` would leave the next event waiting forever, and every socket of the context with it (a
    listener that never closes keeps its port); left full, it would make ``disable_monitor`` wait for that lock
    forever. So: read what is queued, stop the monitor, then close it."""
    while True:
        try:
            monitor.recv(zmq.NOBLOCK)
        except zmq.Again:
            break
    sock.disable_monitor()
    monitor.close(linger=0)


def refusal(event: int, broker: str, role: str, key: str) -> str:
    """Why the handshake with ``broker`` failed (monitor ``event``) and what to check; ``key`` is this client's key
    name, "" for a client without keys."""
    if not key:
        return (
            f"the broker at {broker} refused the handshake: it wants keys (a closed bus) and this {role} has none: "
            f"give --keys (a key directory with a key of role {role} and the broker's public key; docs/security.md)"
        )
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        why = f"refused our key: is the {role} key {key!r} in the broker's key directory (or revoked)?"
    elif event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        why = "does not speak CURVE: is it an open bus (started without --keys)?"
    else:
        why = "could not complete the CURVE handshake: is the broker key in our key directory (broker/) this broker's?"
    return f"the handshake with the broker at {broker} failed: it {why} (docs/security.md)"


class HandshakeWatch:
    """The socket monitor of one control socket at a time; ``failures`` goes on across sessions. ``role`` and
    ``key`` (this client's key name, "" without keys) word what to check when a handshake fails."""

    def __init__(self, role: str, key: str, log: Any) -> None:
        self.role, self.key, self.log = role, key, log
        self.failures = 0
        self.refused = ""
        """What the last failed handshake means (``refusal``), until one succeeds."""
        self.monitor: zmq.Socket | None = None
        self._logged: float | None = None

    def watch(self, control: zmq.Socket) -> zmq.Socket:
        """Start watching ``control``; returns the monitor socket to poll."""
        self.monitor = control.get_monitor_socket(WATCHED)
        return self.monitor

    def drain(self, broker: str) -> bool | None:
        """Read what the monitor reported; True if the connection to ``broker`` is up now (a handshake succeeded
        last), False if it is down (closed, refused, or its handshake failed), None if nothing changed."""
        assert self.monitor is not None
        up: bool | None = None
        while True:
            try:
                event = recv_monitor_message(self.monitor, zmq.NOBLOCK)["event"]
            except zmq.Again:
                return up
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                up, self.refused = True, ""
            elif event & CONNECTION_DOWN:
                up = False
            elif event & HANDSHAKE_FAILED:
                up = False
                self._failed(event, broker)

    def _failed(self, event: int, broker: str) -> None:
        self.failures += 1
        self.refused = refusal(event, broker, self.role, self.key)
        now = time.monotonic()
        if self._logged is None or now - self._logged >= HANDSHAKE_LOG_EVERY_S:
            self._logged = now
            self.log.error(f"{self.refused} (failed handshakes so far: {self.failures})")

    def stop(self, control: zmq.Socket) -> None:
        """Stop watching ``control`` (before it is closed); nothing when not watching."""
        if self.monitor is not None:
            stop_monitor(control, self.monitor)
            self.monitor = None
