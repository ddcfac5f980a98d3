"""The broker's four sockets, made and bound in one place and held by one owner (``BrokerSockets``), the one-line
error of a port that cannot be bound, and ``Replies``, the way out of a ROUTER socket.

Every part of the broker that uses a socket holds the owner and reads the socket from it when it uses it: a memory
reset (broker/memory.py) closes and binds the sockets again inside the owner, and no part holds an old one.

Ports: control at the bind port, the trajectories, learners and params sockets at the next three unless the
profile or the CLI sets them (docs/protocol.md section 1). On the local bus (``ipc://DIR/control``) the four are
the files ``control``, ``trajectories``, ``learners`` and ``params`` in DIR, and no port is bound (``ports`` is
empty, and so is the welcome's map: clients find the files beside the control endpoint, brokerconf.socket_endpoint).

Each socket takes frames no bigger than its messages need (``frame_caps``: libzmq drops the connection of a peer
that sends a bigger one before it buffers it), and the broker drops a message of more frames than the protocol
allows on that socket as soon as it reads it (``MAX_FRAMES``). What a peer's unfinished message holds before then
is bounded by the broker's memory budget (broker/memory.py), which closes and binds these sockets again
(``BrokerSockets.reopen``: ``open_sockets`` with the ``ports`` they had).
"""

from __future__ import annotations

import errno
import fcntl
import socket as _socket
import struct
import termios
import time
from collections.abc import Callable, Sequence
from operator import attrgetter
from pathlib import Path
from typing import Any, NamedTuple

import zmq

from zddrl import protocol as P
from zddrl.broker.auth import BrokerAuth, HandshakeCounter
from zddrl.brokerconf import BrokerConfig, ipc_dir, ipc_endpoint, is_ipc, split_endpoint
from zddrl.tomlconf import ConfigError
from zddrl.transport.io import NOBLOCK, send_frames

PORT_OPTIONS = {
    "control": "--bind tcp://HOST:PORT (the profile's bind) moves it, and with it every port not set on its own "
    "(PORT+1, +2, +3)",
    "trajectories": "--trajectory-port (the profile's trajectory_port) moves it; --bind tcp://HOST:PORT moves all "
    "four (PORT, PORT+1, +2, +3)",
    "learners": "--learner-port (the profile's learner_port) moves it; --bind tcp://HOST:PORT moves all four "
    "(PORT, PORT+1, +2, +3)",
    "params": "--params-port (the profile's params_port) moves it; --bind tcp://HOST:PORT moves all four "
    "(PORT, PORT+1, +2, +3)",
}
"""How to choose another port for each broker socket (the CLI option, the profile key)."""


class BindError(RuntimeError):
    """A broker socket could not be bound. The message is one line: which port, whose, and how to choose others."""


class SocketSet(NamedTuple):
    """The four sockets as ``open_sockets`` made them."""

    control: zmq.Socket
    """ROUTER: hello/welcome, heartbeats, stats, status, snapshots, fleet messages."""
    trajectories: zmq.Socket
    """PULL: the actors' trajectories."""
    learners: zmq.Socket
    """ROUTER: the learner shards' credit and parameters in, trajectories out."""
    params: zmq.Socket
    """PUB: parameter versions to every actor."""
    ports: dict[str, int]
    """The bound port of each socket, by name (empty on the local bus)."""


def bind_error(role: str, host: str, port: str, exc: zmq.ZMQError) -> str:
    """The one-line error of a socket that could not be bound: which port, whose, and how to choose another."""
    why = "is in use by another process" if exc.errno == errno.EADDRINUSE else f"cannot be bound ({exc.strerror})"
    return f"broker: port {port} on {host} (the {role} socket) {why}: {PORT_OPTIONS[role]}"


CONTROL_SNDHWM = 1000
"""Replies queued per control connection before more are dropped (counted control_unroutable): ZeroMQ's default,
said out loud. A parameter snapshot goes out in one burst of up to this many chunks, so it cannot be much
smaller; what connections that never read may hold of status replies is bounded in bytes instead
(limits.UnreadReplies)."""
LEARNERS_RCVHWM = 10_000
"""Messages read ahead per learner connection: past it libzmq stops reading that connection (TCP pushes back,
nothing is dropped); credit and parameter chunks are far fewer than this between two polls."""


FRAME_OVERHEAD_BYTES = 4096
"""Room for the framing around one frame on the wire (CurveZMQ's MESSAGE command adds 33 bytes to each)."""
SUBSCRIPTION_BYTES = 256
"""Largest frame the params socket takes: it reads only subscriptions (actors subscribe to the 5-byte preamble)."""
MAX_FRAMES = {"control": 3, "learners": 3 + P.MAX_ARRAYS, "trajectories": 2 + P.MAX_ARRAYS}
"""Frames of one message at most, by socket: a control message carries no arrays (routing identity, preamble,
header), a learner's or an actor's at most MAX_ARRAYS. A message with more is dropped as soon as it is read
(``control_too_many_frames``, ``learner_too_many_frames``; a trajectory's by the router, as malformed)."""
REBIND_S = 2.0
"""How long a reset waits for a port it just closed to bind again (libzmq closes the listener in its own thread)."""


def frame_caps(c: BrokerConfig) -> dict[str, int]:
    """``ZMQ_MAXMSGSIZE`` of each socket: the largest frame its messages can have. Control messages are a header
    (MAX_HEADER_BYTES) and no arrays; a trajectory's or a parameter version's frames are a header or an array of at
    most ``max_message_bytes``; the params socket reads subscriptions only."""
    data = max(c.max_message_bytes, P.MAX_HEADER_BYTES) + FRAME_OVERHEAD_BYTES
    return {
        "control": P.MAX_HEADER_BYTES + FRAME_OVERHEAD_BYTES,
        "trajectories": data,
        "learners": data,
        "params": SUBSCRIPTION_BYTES + FRAME_OVERHEAD_BYTES,
    }


def open_sockets(
    ctx: zmq.Context, c: BrokerConfig, auth: BrokerAuth | None = None, ports: dict[str, int] | None = None
) -> SocketSet:
    """Every socket made, configured and bound (CURVE servers of their ZAP domains when ``auth`` is given), on
    ``ports`` if given (a reset binds the ports it just closed, waiting up to REBIND_S for each); ConfigError for a
    bad bind port, BindError for a port that is taken (the sockets made so far are closed first)."""
    if not c.bind:
        raise ConfigError("broker.bind is empty: `zddrl broker` makes a local bus; give ipc://DIR/control or tcp://...")
    local = is_ipc(c.bind)
    host, port = (str(ipc_dir(c.bind)), "") if local else split_endpoint(c.bind)
    # BrokerConfig checks only the tcp://HOST:PORT shape: name the bad setting, not a bare int() error.
    if not local and port != "*" and not (port.isdigit() and 0 < int(port) < 65536):
        raise ConfigError(f"broker.bind port must be 1..65535 or *, got {c.bind!r}")
    if local and not Path(host).is_dir():
        raise ConfigError(f"broker.bind {c.bind!r}: the directory {host} does not exist (make it owner-only: 0700)")
    made: list[zmq.Socket] = []
    caps = frame_caps(c)

    def socket(kind: int, domain: str) -> zmq.Socket:
        sock = ctx.socket(kind)
        made.append(sock)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, caps[domain])
        if auth is not None:
            auth.serve(sock, domain)
        return sock

    control = socket(zmq.ROUTER, "control")
    control.setsockopt(zmq.ROUTER_MANDATORY, 1)
    control.setsockopt(zmq.SNDHWM, CONTROL_SNDHWM)
    trajectories = socket(zmq.PULL, "trajectories")
    trajectories.setsockopt(zmq.RCVHWM, c.trajectory_hwm)
    learners = socket(zmq.ROUTER, "learners")
    learners.setsockopt(zmq.ROUTER_MANDATORY, 1)
    learners.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a reconnecting shard reuses its identity
    learners.setsockopt(zmq.SNDHWM, 0)  # bounded by credit, not by HWM
    learners.setsockopt(zmq.RCVHWM, LEARNERS_RCVHWM)  # a full pipe pushes back over TCP: nothing is lost
    params = socket(zmq.PUB, "params")
    params.setsockopt(zmq.SNDHWM, c.params_hwm)
    base = None if port in ("*", "") else int(port)
    plan = [
        ("control", control, base),
        ("trajectories", trajectories, c.trajectory_port),
        ("learners", learners, c.learner_port),
        ("params", params, c.params_port),
    ]
    bound: dict[str, int] = {}
    for offset, (name, sock, wanted) in enumerate(plan):
        if ports is not None and not local:
            wanted = ports[name]
        port_text = str(wanted) if wanted else ("*" if base is None else str(base + offset))
        endpoint = ipc_endpoint(host, name) if local else f"tcp://{host}:{port_text}"
        try:
            _bind(sock, endpoint, REBIND_S if ports is not None else 0.0)
        except zmq.ZMQError as exc:  # one line that says which port, whose, and how to choose others
            for made_sock in made:
                made_sock.close(linger=0)
            why = f"broker: {endpoint} (the {name} socket) cannot be bound ({exc.strerror})"
            raise BindError(why if local else bind_error(name, host, port_text, exc)) from None
        if not local:
            bound[name] = int(sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
    return SocketSet(control, trajectories, learners, params, bound)


def _bind(sock: zmq.Socket, endpoint: str, wait_s: float) -> None:
    """``sock.bind(endpoint)``, tried again for up to ``wait_s`` while the port is still in use."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            sock.bind(endpoint)
            return
        except zmq.ZMQError as exc:
            if exc.errno != errno.EADDRINUSE or time.monotonic() >= deadline:
                raise
        time.sleep(0.01)


class BrokerSockets:
    """The one owner of the broker's four sockets (``control``, ``trajectories``, ``learners``, ``params``), of
    their handshake monitors on a closed bus (``handshakes``) and of their places in the broker's ``poller``.

    Made bound (``open_sockets``: ConfigError, BindError). Every part that uses a socket holds this object and reads
    the socket from it at each use; ``reopen`` (a memory reset) closes them and binds them again here, and the
    parts use the new ones from then on. ``counters`` takes the handshakes counted as the monitors close."""

    def __init__(
        self,
        ctx: zmq.Context,
        config: BrokerConfig,
        auth: BrokerAuth | None,
        poller: zmq.Poller,
        counters: dict[str, int],
    ) -> None:
        self.ctx, self.config, self.auth, self.poller, self.counters = ctx, config, auth, poller, counters
        self.handshakes: HandshakeCounter | None = None
        """The closed bus's socket monitors (handshakes counted, control connections that close); None when open."""
        self.polled: set[str] = {"control", "learners"}
        """The names of the sockets the poller holds (``poll``), kept across a reset."""
        self._take(open_sockets(ctx, config, auth))
        self.ports: dict[str, int] = self._set.ports
        """The bound port of each socket, by name: a reset binds the same ones."""

    def _take(self, s: SocketSet) -> None:
        self._set = s
        self.control, self.trajectories, self.learners, self.params = s.control, s.trajectories, s.learners, s.params
        for name in self.polled:
            self.poller.register(getattr(self, name), zmq.POLLIN)
        if self.auth is not None:
            self.handshakes = HandshakeCounter(s[:4], closes_of=s.control)
            for monitor in self.handshakes.monitors:
                self.poller.register(monitor, zmq.POLLIN)

    def poll(self, name: str, on: bool) -> None:
        """Whether the poller holds the socket ``name`` (the broker reads trajectories only while it has credit)."""
        if on and name not in self.polled:
            self.poller.register(getattr(self, name), zmq.POLLIN)
            self.polled.add(name)
        elif not on and name in self.polled:
            self.poller.unregister(getattr(self, name))
            self.polled.discard(name)

    def publish(self, frames: Sequence[Any]) -> None:
        """One message out of the params socket, to every actor's SUB."""
        self.params.send_multipart(frames, copy=False)

    def reopen(self) -> None:
        """Close the four sockets with linger 0 (everything libzmq held for them goes; the last handshakes are
        counted) and bind their ports again. If one does not bind, unbound stand-ins take the sockets' places (every
        send finds no peer) and BindError is raised: call again later."""
        self.close()
        try:
            s = open_sockets(self.ctx, self.config, self.auth, self.ports)
        except BindError:
            self._take(self._stand_ins())
            raise
        self._take(s)

    def _stand_ins(self) -> SocketSet:
        kinds = (zmq.ROUTER, zmq.PULL, zmq.ROUTER, zmq.PUB)
        control, trajectories, learners, params = (self.ctx.socket(k) for k in kinds)
        for sock in (control, trajectories, learners, params):
            sock.setsockopt(zmq.LINGER, 0)
        for router in (control, learners):
            router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        return SocketSet(control, trajectories, learners, params, dict(self.ports))

    def close(self) -> None:
        """Close the monitors and the sockets (out of the poller)."""
        polled = {sock for sock, _ in self.poller.sockets}
        if self.handshakes is not None:
            for monitor in self.handshakes.monitors:
                if monitor in polled:
                    self.poller.unregister(monitor)
                self.handshakes.drain(monitor, self.counters)  # the last handshakes counted (every connection closes)
            self.handshakes.close()
            self.handshakes = None
        for sock in self._set[:4]:
            if sock in polled:
                self.poller.unregister(sock)
            sock.close(linger=0)


class Replies:
    """Messages out of one ROUTER socket of ``sockets`` (``name``: control, or learners) to a peer's identity, never
    blocking: a peer gone, or whose queue is full, is counted (``control_unroutable``) and skipped; it will reconnect
    or ask again."""

    def __init__(self, sockets: BrokerSockets, name: str, counters: dict[str, int]) -> None:
        self.sockets = sockets
        self._sock: Callable[[BrokerSockets], zmq.Socket] = attrgetter(name)
        self.counters = counters

    def send(self, identity: bytes, msg: P.Message) -> None:
        self.send_frames(identity, P.encode(msg))

    def send_frames(self, identity: bytes, frames: Sequence[Any]) -> None:
        try:  # io.send_frames: ~1.3 us a message where send_multipart takes ~8.5 (bench fleet's heartbeat pass)
            send_frames(self._sock(self.sockets), frames, NOBLOCK, prefix=identity)
        except zmq.ZMQError:
            self.counters["control_unroutable"] += 1


def drained(fd: int) -> bool:
    """Whether the connection on ``fd`` has taken what was sent to it: its kernel send queue (Linux's TIOCOUTQ)
    holds under a quarter of its send buffer. libzmq writes a connection's queued messages into the kernel while
    there is room, so below that nothing waits in libzmq for it; a peer that reads nothing fills the kernel's
    queue first. A descriptor that is closed, or no longer a socket, has nothing queued: True."""
    try:
        queued = struct.unpack("i", fcntl.ioctl(fd, termios.TIOCOUTQ, b"\0\0\0\0"))[0]
        sock = _socket.socket(fileno=fd)  # a view of libzmq's descriptor: detached below, never closed here
    except OSError:
        return True
    try:
        size = sock.getsockopt(_socket.SOL_SOCKET, _socket.SO_SNDBUF)
    except OSError:
        return True
    finally:
        sock.detach()
    return queued < size // 4
