"""The closed bus on the broker's side: CURVE on its four sockets, ZAP against each role's allow-list.

pyzmq's ZAP authenticator (``zmq.auth.thread.ThreadAuthenticator``) answers libzmq's handshake requests in a
thread of its own; a client whose key is not allowed on a socket never gets a message to the broker's Python
code. Each socket has a ZAP domain, and each domain admits the roles that have business there::

    control       learner, actor, monitor, relay, replay   (hello, heartbeats, status; the hello's role is the key's)
    trajectories  actor, relay   (a relay pushes for the actors it reported: broker/subtree.py)
    learners      learner, replay   (a replay takes trajectories by credit; only a learner publishes)
    params        actor, relay

An admitted connection's messages carry the ZAP User-Id ``ROLE:NAME`` of its key (``user_of``); the broker
binds a member's peer id to that user at hello and checks it on every message after (broker.py), so a
role and a peer id come from the key, never from a header alone.

Handshakes that fail (no key, a wrong server key, a key not on the list) happen inside libzmq: socket
monitors count them (``HandshakeCounter``), so a stranger's attempts show in ``zddrl status``. The control
socket's monitor also reports connections that close, by file descriptor (``source_fd`` of a message names the
connection it came on): a killed client's peer id is free for its own key at once (guard.py, rule 2).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from typing import Any

import zmq
import zmq.auth.thread
from zmq.utils.monitor import recv_monitor_message

from zddrl.keys import KeysError, key_files, server_keys

DOMAINS = {
    "control": ("learner", "actor", "monitor", "relay", "replay"),
    "trajectories": ("actor", "relay"),
    "learners": ("learner", "replay"),
    "params": ("actor", "relay"),
}
"""ZAP domain (one per broker socket, named after it) -> the key roles admitted there."""
HANDSHAKE_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
LOOPBACK_NAMES = ("localhost",)
AUTH_COUNTERS = ("auth_refused", "zap_denied", "handshakes_ok", "handshakes_failed")
"""In every status body (0 on an open bus): hellos and messages refused for their key, connections ZAP refused,
CURVE handshakes that succeeded and failed."""


class _AllowList:
    """ZAP callback: a key is admitted on a domain if its role is one of the domain's. Counts refusals."""

    def __init__(self, allowed: dict[bytes, tuple[str, str]]) -> None:
        self.allowed = allowed
        """Swapped whole on a reload (one assignment: the ZAP thread sees the old map or the new one)."""
        self.denied = 0
        """Written by the ZAP thread only; the broker's loop reads it."""

    def callback(self, domain: str, key: bytes) -> bool:
        who = self.allowed.get(key)
        ok = who is not None and who[0] in DOMAINS.get(domain, ())
        if not ok:
            self.denied += 1
        return ok


class _Authenticator(zmq.auth.thread.ThreadAuthenticator):
    """pyzmq's authenticator, whose User-Id for a CURVE client is its ``ROLE:NAME`` rather than its key."""

    def __init__(self, ctx: zmq.Context, allow: _AllowList) -> None:
        super().__init__(ctx)
        self._allow = allow

    def curve_user_id(self, client_public_key: bytes) -> str:
        # A reload between the callback and here may have removed the key: an exception would end pyzmq's ZAP
        # thread (and every handshake after it), so the key's user is then one that Guard.admitted refuses.
        who = self._allow.allowed.get(zmq.utils.z85.encode(client_public_key))
        return f"{who[0]}:{who[1]}" if who is not None else "revoked:"


class BrokerAuth:
    """Starts the ZAP thread and makes each broker socket a CURVE server of its domain. ``close()`` stops it.

    The allow-lists are the key directory's public files, read again whenever they change (``refresh``): a key
    added is admitted from its next handshake, a key removed is revoked (its members are removed by the broker,
    and whatever its open connections send after is refused)."""

    def __init__(self, ctx: zmq.Context, root: str, name: str | None = None) -> None:
        self.root = root
        self.name = name
        """The broker's own pair in ``broker/`` (None: the only secret there)."""
        self.keys = server_keys(root, name)
        self._stamp = key_files(root)
        self.allow = _AllowList(self.keys.allowed)
        self.users = self._users()
        """``ROLE:NAME`` of every key allowed now."""
        self._auth = _Authenticator(ctx, self.allow)
        self._auth.start()
        for domain in DOMAINS:
            self._auth.configure_curve_callback(domain, credentials_provider=self.allow)

    def _users(self) -> frozenset[str]:
        return frozenset(f"{role}:{name}" for role, name in self.allow.allowed.values())

    def refresh(self) -> frozenset[str]:
        """Reread the allow-lists if a key file changed; returns the users revoked by that (usually none).
        A directory that no longer reads (a half-copied key) keeps the lists as they were, and raises KeysError
        for the caller to log."""
        stamp = key_files(self.root)
        if stamp == self._stamp:
            return frozenset()
        keys = server_keys(self.root, self.name)  # a failure is retried at the next look: the stamp stays the old one
        if keys.public != self.keys.public:
            raise KeysError("the broker's own key changed on disk: it takes effect at the next start only")
        self._stamp = stamp
        old = self.users
        self.allow.allowed = keys.allowed
        self.users = self._users()
        return old - self.users

    def serve(self, sock: zmq.Socket, domain: str) -> None:
        """Before bind: ``sock`` accepts only CURVE clients that ZAP admits on ``domain``."""
        sock.curve_server = True
        sock.curve_secretkey = self.keys.secret
        sock.curve_publickey = self.keys.public
        sock.zap_domain = domain.encode()

    def close(self) -> None:
        self._auth.stop()


def source_fd(frame: Any) -> int:
    """The file descriptor of the connection a received frame came on (-1: unknown, e.g. a frame built in a test)."""
    try:
        return int(frame.get(zmq.SRCFD))
    except (AttributeError, TypeError, zmq.ZMQError):
        return -1


def user_of(frame: zmq.Frame) -> str:
    """The ZAP User-Id of the connection a received frame came from ("" on a socket without ZAP)."""
    try:
        return str(frame.get("User-Id") or "")
    except zmq.ZMQError:  # no metadata: an unauthenticated socket
        return ""


class HandshakeCounter:
    """Socket monitors on the broker's sockets, counting handshakes that succeeded and that failed; the monitor of
    ``closes_of`` (the control socket, first of ``socks``) also reports the connections that close."""

    def __init__(self, socks: Iterable[zmq.Socket], closes_of: zmq.Socket | None = None) -> None:
        self.monitors = [
            sock.get_monitor_socket(HANDSHAKE_EVENTS | (zmq.EVENT_DISCONNECTED if sock is closes_of else 0))
            for sock in socks
        ]

    def drain(self, monitor: zmq.Socket, counters: dict[str, int]) -> list[int]:
        """Count the handshakes ``monitor`` reported; returns the file descriptors of connections that closed."""
        closed: list[int] = []
        while True:
            try:
                event: Any = recv_monitor_message(monitor, zmq.NOBLOCK)
            except zmq.Again:
                return closed
            if event["event"] == zmq.EVENT_DISCONNECTED:
                closed.append(int(event["value"]))
            elif event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                counters["handshakes_ok"] += 1
            else:
                counters["handshakes_failed"] += 1

    def close(self) -> None:
        for monitor in self.monitors:
            monitor.close(linger=0)


def is_loopback(host: str) -> bool:
    """Whether a bind host is reachable from this machine only (127.0.0.0/8, ::1, localhost)."""
    host = host.strip("[]")
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # an interface name, a hostname or "*": reachable from outside
        return False
