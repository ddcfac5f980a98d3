"""The closed bus on the broker's side: CURVE on its four sockets, ZAP against each role's allow-list.

The broker's ZAP handler (broker/zap.py) answers libzmq's handshake requests in a thread of its own; a client
whose key is not allowed on a socket never gets a message to the broker's Python code. Each socket has a ZAP
domain, and each domain admits the roles that have business there::

    control       learner, actor, monitor, relay, replay   (hello, heartbeats, status; the hello's role is the key's)
    trajectories  actor, relay   (a relay pushes for the actors it reported: broker/subtree.py)
    learners      learner, replay   (a replay takes trajectories by credit; only a learner publishes)
    params        actor, relay

An admitted connection's messages carry the ZAP User-Id ``ROLE:NAME`` of its key (``user_of``); the broker
binds a member's peer id to that user at hello and checks it on every message after (broker.py), so a
role and a peer id come from the key, never from a header alone.

Handshakes that fail (no key, a wrong server key, a key not on the list) happen inside libzmq: socket
monitors count them (``HandshakeCounter``), so a stranger's attempts show in ``zddrl status``, and they are
logged per peer address, aggregated per interval (``zap.RefusedHandshakes``). The control socket's monitor also
reports connections that close, by file descriptor (``source_fd`` of a message names the connection it came
on): a killed client's peer id is free for its own key at once (guard.py, rule 2).
"""

from __future__ import annotations

import ipaddress
import os
import socket
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import zmq
from zmq.utils import z85

from zddrl.broker.zap import UNKNOWN_ADDRESS, Reason, RefusedHandshakes, ZapHandler
from zddrl.keys import KeysError, key_files, server_keys
from zddrl.transport.handshakes import stop_monitor

if TYPE_CHECKING:
    from zddrl.logs import RateLimitedLog

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
CONNECTION_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
"""What the control socket's monitor also reports: each connection opened and closed, by descriptor (the peer
address of a failed handshake; a connection that closed, for guard.py's rule 2)."""
LOOPBACK_NAMES = ("localhost",)
AUTH_COUNTERS = ("auth_refused", "zap_denied", "handshakes_ok", "handshakes_failed")
"""In every status body (0 on an open bus): hellos and messages refused for their key, connections ZAP refused,
CURVE handshakes that succeeded and failed."""


class _AllowList:
    """The ZAP handler's judge: a key is admitted on a domain if its role is one of the domain's. Counts refusals."""

    def __init__(self, allowed: dict[bytes, tuple[str, str]]) -> None:
        self.denied = 0
        """Written by the ZAP thread only; the broker's loop reads it."""
        self._lists: tuple[dict[bytes, tuple[str, str]], dict[bytes, tuple[str, str]]] = ({}, {})
        self.allowed = allowed

    @property
    def allowed(self) -> dict[bytes, tuple[str, str]]:
        """Z85 public key -> (role, name) of every key allowed now."""
        return self._lists[0]

    @allowed.setter
    def allowed(self, allowed: dict[bytes, tuple[str, str]]) -> None:
        # The ZAP thread looks keys up raw, as libzmq hands them over: no Z85 per handshake. Both maps are swapped
        # in one assignment, so the thread sees the old pair or the new one.
        by_raw = {z85.decode(key): (role, f"{role}:{name}") for key, (role, name) in allowed.items()}
        self._lists = (allowed, by_raw)

    def judge(self, domain: bytes, key: bytes) -> tuple[str, Reason | None]:
        """(the ZAP User-Id ``ROLE:NAME``, None) if ``key`` (raw, 32 bytes) is admitted on ``domain``, else ("",
        why not)."""
        who = self._lists[1].get(key)
        if who is None:
            return "", ("unlisted", key.hex())  # Z85 only if a log line names it
        role, user = who
        if role not in _DOMAIN_ROLES.get(domain, ()):
            return "", ("role", role, domain.decode("ascii", "replace"))
        return user, None


_DOMAIN_ROLES = {domain.encode(): frozenset(roles) for domain, roles in DOMAINS.items()}
_REFUSED: weakref.WeakKeyDictionary[zmq.Context, RefusedHandshakes] = weakref.WeakKeyDictionary()
"""The refused-handshake log of each context's ZAP handler, for the socket monitors of that context's sockets."""


class BrokerAuth:
    """Starts the ZAP handler and makes each broker socket a CURVE server of its domain. ``close()`` stops it.

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
        self.refused = RefusedHandshakes()
        """Refused handshakes by peer address, logged once per interval."""
        self._zap = ZapHandler(ctx, self.allow, self.refused)
        _REFUSED[ctx] = self.refused

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

    def alive(self) -> bool:
        """Whether the ZAP handler's thread runs: dead, it fails closed and the broker admits no one."""
        return self._zap.alive()

    def check_alive(self, ratelog: RateLimitedLog) -> None:
        """Every tick: while the ZAP handler is dead, an error line once per log interval (it does not come back;
        the broker must be restarted)."""
        if not self.alive():
            why = "the broker's ZAP handler is dead: no client can complete a handshake; restart the broker"
            ratelog.log("zap_dead", why, "ERROR")

    def close(self) -> None:
        self._zap.stop()


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
    """Socket monitors on the broker's sockets, counting handshakes that succeeded and that failed, and noting the
    failures libzmq makes before ZAP in ``refused`` (by default the log of the ZAP handler serving the sockets'
    context); the monitor of ``closes_of`` (the control socket, first of ``socks``) also reports the connections
    that open and close.

    A monitor event names no peer, but a connection's file descriptor: on the control socket, where a client
    without keys or with a wrong broker key first knocks, the address is read from the descriptor when the
    connection's ``ACCEPTED`` is drained, unless the connection closed before (its descriptor may be another
    connection's by now: the address is not guessed). A failure before ZAP is followed at once by its connection's
    ``DISCONNECTED`` (libzmq signals both from one call on the context's one I/O thread), which names the
    descriptor. Failures at ZAP are noted by the ZAP handler, which gets the address with the request."""

    def __init__(
        self, socks: Iterable[zmq.Socket], closes_of: zmq.Socket | None = None, refused: RefusedHandshakes | None = None
    ) -> None:
        socks = list(socks)
        self._socks = socks
        self.refused = refused if refused is not None or not socks else _REFUSED.get(socks[0].context)
        self.monitors: list[zmq.Socket] = []
        try:
            for sock in socks:
                self.monitors.append(
                    sock.get_monitor_socket(HANDSHAKE_EVENTS | (CONNECTION_EVENTS if sock is closes_of else 0))
                )
        except zmq.ZMQError:  # the monitors made so far are stopped, not left to the garbage collector's close
            self.close()
            raise
        self._closes = self.monitors[socks.index(closes_of)] if closes_of in socks else None
        self._names = {m: sock.getsockopt_string(zmq.ZAP_DOMAIN) or "?" for m, sock in zip(self.monitors, socks)}
        self._peers: dict[int, str] = {}
        """Descriptor -> peer address of the control connections still open, as far as known."""
        self._failed: Reason | None = None
        """A control connection's failure before ZAP, waiting for its DISCONNECTED."""

    def drain(self, monitor: zmq.Socket, counters: dict[str, int]) -> list[int]:
        """Count the handshakes ``monitor`` reported; returns the file descriptors of connections that closed
        (``closes_of``'s only)."""
        batch: list[tuple[int, int]] = []
        while True:
            try:
                head = monitor.recv_multipart(zmq.NOBLOCK)[0]  # event id (16 bits) and value (32 bits), both LE
            except zmq.Again:
                break
            batch.append((int.from_bytes(head[:2], "little"), int.from_bytes(head[2:6], "little")))
        last_close = {value: i for i, (event, value) in enumerate(batch) if event == zmq.EVENT_DISCONNECTED}
        closed = []
        for i, (event, value) in enumerate(batch):
            if event == zmq.EVENT_ACCEPTED:
                self._peers[value] = UNKNOWN_ADDRESS if last_close.get(value, -1) > i else peer_address(value)
            elif event == zmq.EVENT_DISCONNECTED:
                address = self._peers.pop(value, UNKNOWN_ADDRESS)
                if self._failed is not None:
                    self._note(address, self._failed)
                    self._failed = None
                closed.append(value)
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                counters["handshakes_ok"] += 1
            elif event & HANDSHAKE_EVENTS:
                counters["handshakes_failed"] += 1
                if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:  # ZAP's refusals are noted by the ZAP handler
                    continue
                if monitor is self._closes:  # its DISCONNECTED, next, says which connection it was
                    self._failed = _failure(event, value, self._names[monitor])
                else:
                    self._note(UNKNOWN_ADDRESS, _failure(event, value, self._names[monitor]))
        return closed if monitor is self._closes else []

    def _note(self, address: str, reason: Reason) -> None:
        if self.refused is not None:
            self.refused.note(address, reason)

    def close(self) -> None:
        """Stop the monitors (before their sockets close): closed in any other order, a monitor can wedge the
        broker's I/O thread for good (``stop_monitor``; a memory reset once found its control port still taken)."""
        for sock, monitor in zip(self._socks, self.monitors):
            stop_monitor(sock, monitor)
        self.monitors = []


def _failure(event: int, value: int, socket_name: str) -> Reason:
    if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
        return ("closed", socket_name)
    if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
        return ("no-curve", socket_name)
    if value == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
        return ("server-key", socket_name)
    return ("protocol", socket_name, f"0x{value:x}")


def peer_address(fd: int) -> str:
    """The peer address of the connected socket ``fd`` (a descriptor libzmq owns: read through a duplicate)."""
    try:
        dup = os.dup(fd)
    except OSError:  # closed already
        return UNKNOWN_ADDRESS
    try:
        sock = socket.socket(fileno=dup)
    except OSError:  # not a socket (any more)
        os.close(dup)
        return UNKNOWN_ADDRESS
    try:
        peer = sock.getpeername()
    except OSError:
        return UNKNOWN_ADDRESS
    finally:
        sock.close()
    return str(peer[0]) if isinstance(peer, tuple) else str(peer) or "a local socket"


def is_loopback(host: str) -> bool:
    """Whether a bind host is reachable from this machine only (127.0.0.0/8, ::1, localhost)."""
    host = host.strip("[]")
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # an interface name, a hostname or "*": reachable from outside
        return False
