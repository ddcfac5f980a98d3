"""The client side of the bus, shared by actor hosts and learner shards.

``BrokerLink`` runs the control conversation in a background thread so that it never sits on the
stepping or training path: hello/welcome, heartbeats both ways, reconnect with capped exponential
backoff when the broker goes away (to the next broker of a fallback list, if it has one), and (for
actors) receiving, verifying and keeping the newest parameters (latest wins), and (for learners) the
newest fleet message: which actors are joined.
ZeroMQ sockets are not thread-safe, so the link's sockets live in its
thread only; data sockets (PUSH for actors, DEALER for learners) belong to the caller's thread and
are rebuilt whenever ``generation`` changes (a new welcome), on the host of the broker that sent it.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import socket
import threading
import time
from typing import Any

import zmq
from loguru import logger

from zddrl import keys
from zddrl import protocol as P
from zddrl.config import socket_endpoint
from zddrl.logs import RateLimitedLog
from zddrl.transport import signatures as signing
from zddrl.transport.crash import CRASH_MESSAGE_CHARS as CRASH_MESSAGE_CHARS  # re-exported: where callers look
from zddrl.transport.crash import CRASH_TRACEBACK_CHARS as CRASH_TRACEBACK_CHARS
from zddrl.transport.crash import crash_reason
from zddrl.transport.fallback import Brokers
from zddrl.transport.handshakes import HandshakeWatch
from zddrl.transport.params import Assembler
from zddrl.transport.session import HEARTBEAT_INTERVAL_S, PASSIVE, SILENT, Session

BYE_LINGER_MS = 500
"""How long a closing link lets ZeroMQ deliver its last messages (the bye)."""


class Refused(RuntimeError):
    """The broker refused this client's hello (the message says why); retrying would not help."""


class BrokerLink:
    """Control link to the broker. ``start()``, then ``wait_welcome()``; ``close()`` at the end.

    Usage (actor)::

        link = BrokerLink("tcp://host:5555", P.Hello(role="actor", peer_id="actor-0"), subscribe_params=True)
        link.start(); welcome = link.wait_welcome(timeout_s=30)
        params = link.wait_params(newer_than=-1, timeout_s=30)

    ``connect`` may be a fallback list, ``"tcp://a:5555,tcp://b:5555"``: the link talks to one broker at a time
    and moves to the next when that one is silent (``fallback.Brokers``).

    ``accept_welcome``, ``accept_params`` and ``accept_fleet`` are what the link does with those messages from the
    broker; its thread calls them, and a test drives them on a link it never started (no sockets).
    """

    def __init__(
        self,
        connect: str,
        hello: P.Hello,
        *,
        subscribe_params: bool = False,
        context: zmq.Context | None = None,
        credentials: keys.Credentials | None = None,
    ) -> None:
        self.brokers = Brokers(connect)
        """The brokers to try, in order; ``connect`` is the one tried now."""
        self._welcome_from = ""
        """The control endpoint of the broker that sent ``welcome``: its data endpoints are beside it."""
        self.hello = hello
        self.subscribe_params = subscribe_params
        self.ctx = context or zmq.Context.instance()
        self.credentials = credentials
        """This client's keys on a closed bus: every socket to the broker is a CURVE client, and only versions
        signed by one of ``credentials.pins`` are assembled. None on an open bus."""
        self.log = logger.bind(role=hello.role, peer=hello.peer_id)
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._outbox: queue.SimpleQueue[P.Message] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"link-{hello.peer_id}", daemon=True)
        self.welcome: P.Welcome | None = None
        self.refused: str | None = None
        """Why the broker refused our hello, if it did (the link has stopped)."""
        self.generation = 0
        self.sent = 0
        self.acked = 0
        self.params: P.Parameters | None = None
        self.reconnects = 0
        self.params_rejected = 0
        self.assembler = Assembler(verify=None if credentials is None else self._params_refusal)
        self._ratelog = RateLimitedLog()
        self.last_broker_beat = 0.0
        self.interval_s = HEARTBEAT_INTERVAL_S
        """The heartbeat interval the broker set (welcome, then its heartbeats): an actor's stats go out as often."""
        self._fleet: tuple[int, dict[str, dict]] | None = None
        self.fleet_ignored = 0
        """Fleet messages ignored because they named another run than the link's."""
        self._sub: zmq.Socket | None = None
        self._sub_endpoint: str | None = None
        role, key = (credentials.client.role, credentials.client.name) if credentials else (hello.role, "")
        self.handshakes = HandshakeWatch(role, key, self.log)
        """The control socket's monitor: failed handshakes (a refused key, or no keys on a closed bus, is otherwise
        silence) and the connection lost and regained (a fallback list is left early: ``Session``)."""
        self.hellos = 0
        """Hellos sent, every session: one per reconnection."""
        self.hellos_held = 0
        """Rejects asking for a hello that got none: they answered messages sent before the hello on its way."""

    # ---------------------------------------------------------------- caller side
    def start(self) -> BrokerLink:
        self._thread.start()
        return self

    def socket(self, kind: int) -> zmq.Socket:
        """A socket for talking to the broker: a CURVE client with this link's keys on a closed bus. Every
        socket to the broker is made here (data sockets too), so none can be left open by mistake."""
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if self.credentials is not None:
            self.credentials.apply(sock)
        return sock

    def _params_refusal(self, head: P.Parameters) -> str:
        """Why a version must not be assembled: not signed by a pinned key, or (once a run is known) by another
        key than the one that signed the run: any other learner key could otherwise publish into this run."""
        assert self.credentials is not None
        why = signing.params_refusal(head, self.credentials.pins)
        run_signer = self.welcome.run_signer if self.welcome is not None else ""
        if not why and run_signer and head.signer != run_signer:
            why = f"signed by {head.signer!r}, not by the run's learner ({run_signer!r})"
        return why

    @property
    def peer_id(self) -> str:
        """Our peer id: the hello's, or (``auto_id``) the one the last welcome assigned ("" before it)."""
        with self._cond:
            return self.hello.peer_id

    @property
    def data_identity(self) -> bytes:
        """The ZeroMQ identity of a learner's data DEALER: what the welcome issued (a closed bus), else the peer id."""
        assert self.welcome is not None, "no welcome yet"
        return self.welcome.data_identity or self.hello.peer_id.encode()

    @property
    def connect(self) -> str:
        """The control endpoint of the broker this link is talking to (or trying) now."""
        return self.brokers.current

    def endpoint(self, port_name: str) -> str:
        """The endpoint of the socket ``port_name`` of the broker that sent the current welcome (the port the welcome
        names on its host; on a local bus, the file beside its control endpoint)."""
        with self._cond:
            assert self.welcome is not None, "no welcome yet"
            return socket_endpoint(self._welcome_from, port_name, self.welcome.ports)

    def wait_welcome(self, timeout_s: float, need_run: bool = False) -> P.Welcome | None:
        """Block until a welcome (with a run spec if ``need_run``) arrived, or the timeout."""
        with self._cond:
            self._cond.wait_for(
                lambda: (
                    self.welcome is not None and (self.welcome.run is not None or not need_run) or self._stop.is_set()
                ),
                timeout_s,
            )
            return self.welcome

    def wait_params(self, newer_than: int, timeout_s: float) -> P.Parameters | None:
        """Block until parameters with version > ``newer_than`` of the current run are held."""
        with self._cond:
            self._cond.wait_for(lambda: self._newer(newer_than) or self._stop.is_set(), timeout_s)
            return self.params if self._newer(newer_than) else None

    def note_sent(self, generation: int) -> None:
        """The caller pushed one trajectory while ``generation`` was current; it is in flight until the
        broker returns its credit. One pushed just as a new welcome arrived went to the old session,
        whose count was reset: counting it now would leave a credit that never comes back."""
        with self._cond:
            if generation == self.generation:
                self.sent += 1

    def wait_in_flight_below(self, limit: int, timeout_s: float) -> bool:
        """Block until fewer than ``limit`` pushed trajectories are unread by the broker (actor-side
        credit: the broker returns one per trajectory it reads). False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self.sent - self.acked < limit or self._stop.is_set(), timeout_s)

    def latest_params(self) -> P.Parameters | None:
        with self._cond:
            return self.params

    def fleet(self) -> tuple[int, dict[str, dict]] | None:
        """``(seq, actors)`` of the newest fleet message of the link's current run, or None before the first.

        ``actors`` maps each joined actor's peer id to ``{"num_envs": int, "host": str}`` (``num_envs`` 0: the
        run's ``env.num_envs``). Cheap enough to call on every poll: one uncontended lock, no copy. The map is
        the received message's own: read it, never modify it (the next fleet message brings a new one).
        ``seq`` changes exactly when the map may have: compare it with the last one seen (``!=``, not ``>``:
        a restarted broker numbers afresh, from its start time; see docs/protocol.md section 5.5).

        Usage (a learner shard)::

            seen = None
            while training:
                fleet = link.fleet()
                if fleet is not None and fleet[0] != seen:
                    seen, actors = fleet
                    ...  # resize the rollouts, the sync quota
        """
        with self._cond:
            return self._fleet

    def wait_fleet(self, timeout_s: float) -> tuple[int, dict[str, dict]] | None:
        """``fleet()`` once the first fleet message of the run arrived (the broker sends one right after a
        learner's welcome), or None after ``timeout_s``."""
        with self._cond:
            self._cond.wait_for(lambda: self._fleet is not None or self._stop.is_set(), timeout_s)
            return self._fleet

    def _newer(self, version: int) -> bool:
        return self.params is not None and self.params.policy_version > version

    def send(self, msg: P.Message) -> None:
        """Queue a control message (stats, bye) for the link thread to send."""
        self._outbox.put(msg)

    def report_crash(self, exc: BaseException) -> None:
        """Tell the broker why this process is dying (bye with ``crash_reason(exc)``), then close.

        Best effort: delivered only if the broker is reachable now (the bye gets BYE_LINGER_MS)."""
        self.close(reason=crash_reason(exc))

    def close(self, reason: str = "") -> None:
        if self._thread.is_alive():
            self.send(P.Bye(peer_id=self.hello.peer_id, reason=reason))
            self._stop.set()
            self._thread.join(timeout=5)
        with self._cond:
            self._cond.notify_all()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    # ---------------------------------------------------------------- link thread
    def _run(self) -> None:
        while not self._stop.is_set():
            control = self._open()
            served, cause = False, ""
            try:
                served, cause = self._serve(control)
            except Exception:  # a bug in the link must not hang its owner silently
                self.log.exception("control link failed")
            finally:
                # Closing on purpose lingers: linger 0 discards what ZeroMQ has not written yet, and the
                # bye that close() just queued would race the close, leaving the member (and a learner's
                # credit) at the broker until heartbeat expiry.
                self.handshakes.stop(control)  # done already unless _serve failed before its own finally
                control.close(linger=BYE_LINGER_MS if self._stop.is_set() else 0)
            if self._stop.is_set():
                break
            self.reconnects += 1
            gone, wait_s = self.connect, self.brokers.next(served, answered=cause.startswith(PASSIVE))
            why = self.handshakes.refused or ("" if cause == SILENT else cause)
            self.log.warning(self.brokers.moving(gone, wait_s, why))
            self._stop.wait(wait_s)
        with self._cond:
            self._cond.notify_all()

    def _open(self) -> zmq.Socket:
        control = self.socket(zmq.DEALER)
        self.handshakes.watch(control)  # before connecting: a refused handshake fails within the connect's first ms
        control.connect(self.connect)
        control.send_multipart(P.encode(self.hello), zmq.NOBLOCK)  # a fresh pipe: never full
        self.hellos += 1
        return control

    @staticmethod
    def _try_send(sock: zmq.Socket, msg: P.Message) -> bool:
        """Never blocks: a DEALER whose queue to a dead broker is full blocks in send, which would freeze the
        link thread (and close() with it). Control messages are periodic: when one cannot be queued now, the
        next one will do."""
        try:
            sock.send_multipart(P.encode(msg), zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False

    def _serve(self, control: zmq.Socket) -> tuple[bool, str]:
        """Talk to the broker until it is gone: (whether it welcomed us, why it counts as gone: ``Session.ended``;
        "" when the link was closed or refused)."""
        session = Session(time.monotonic(), fallback=len(self.brokers) > 1, interval_s=self.interval_s)
        poller = zmq.Poller()
        poller.register(control, zmq.POLLIN)
        poller.register(self.handshakes.monitor, zmq.POLLIN)
        try:
            cause = self._serve_loop(control, poller, session)
            return session.welcomed_once, cause
        finally:
            # The SUB opened at a welcome (kept in self._sub) is closed however the session ends.
            if self._sub is not None:
                self._sub.close(linger=0)
                self._sub = None
            self.handshakes.stop(control)

    def _serve_loop(self, control: zmq.Socket, poller: zmq.Poller, session: Session) -> str:
        while not self._stop.is_set():
            self._flush_outbox(control)
            events = dict(poller.poll(int(min(100, session.interval_s * 1000))))
            if self.handshakes.monitor in events:
                session.connection(self.handshakes.drain(self.connect), time.monotonic())
            if control in events:
                for msg in self._drain(control):
                    if not self._on_control(msg, control, poller, session):
                        return ""  # refused: the link has stopped
            if self._sub is not None and self._sub in events:
                for msg in self._drain(self._sub):
                    if isinstance(msg, (P.Parameters, P.ParamChunk)):
                        self.accept_params(msg)
            now = time.monotonic()
            if session.beat_due(now):
                version = self.params.policy_version if self.params is not None else -1
                self._try_send(control, P.Heartbeat(peer_id=self.hello.peer_id, policy_version=version))
            cause = session.ended(now)
            if cause:
                return cause
        self._flush_outbox(control)
        return ""

    def _on_control(self, msg: P.Message, control: zmq.Socket, poller: zmq.Poller, session: Session) -> bool:
        """One message from the broker on control; False if it refused us (the link stops)."""
        now = time.monotonic()
        session.heard(now)
        if isinstance(msg, P.Welcome):
            session.welcomed(msg, now)
            self.interval_s = session.interval_s
            self._resubscribe(msg, poller)
            self.accept_welcome(msg)
        elif isinstance(msg, P.Reject):
            return self._on_reject(msg, control, session, now)
        elif isinstance(msg, (P.Parameters, P.ParamChunk)):
            self.accept_params(msg)
        elif isinstance(msg, P.Credit):
            self._on_credit(msg)
        elif isinstance(msg, P.Heartbeat):
            self.last_broker_beat = time.time()
            session.retimed(msg.interval_s, now)  # the fleet grew or shrank
            self.interval_s = session.interval_s
        elif isinstance(msg, P.Fleet):
            self.accept_fleet(msg)
        return True

    def _on_reject(self, msg: P.Reject, control: zmq.Socket, session: Session, now: float) -> bool:
        """A broker that does not know us asks for a hello: one per reconnection (``Session.wants_hello``)."""
        if msg.rehello:
            if session.wants_hello(now):
                self.log.warning(
                    f"the broker at {self.connect} does not know us (it restarted, or expired us): saying hello again"
                )
                self.hellos += 1
                self._try_send(control, self.hello)
            else:
                self.hellos_held += 1  # it answers a message sent before the hello on its way
            return True
        if msg.reason.startswith(P.PASSIVE_PREFIX):  # a standby pair's passive broker: on to the next at once
            session.passive(msg.reason)
            return True
        if msg.reason.startswith(P.REFUSED_PREFIX):
            self.log.warning(f"broker refused us: {msg.reason}")
            self._refuse(msg.reason)
            return False
        self.log.warning(f"broker rejected us: {msg.reason}")
        return True

    def _resubscribe(self, welcome: P.Welcome, poller: zmq.Poller) -> None:
        """(Re)subscribe at every welcome that names another params endpoint: a restarted broker may re-welcome this
        same session on a new port."""
        if not self.subscribe_params:  # a monitor: its welcome names no data port (ports {} on a closed bus)
            return
        endpoint = self.brokers.endpoint("params", welcome.ports)
        if self._sub is not None and self._sub_endpoint == endpoint:
            return
        if self._sub is not None:
            poller.unregister(self._sub)
            self._sub.close(linger=0)
        self._sub = self._subscribe(welcome, endpoint)
        poller.register(self._sub, zmq.POLLIN)

    def _subscribe(self, welcome: P.Welcome, endpoint: str) -> zmq.Socket:
        sub = self.socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, PARAMS_RCVHWM)
        sub.setsockopt(zmq.MAXMSGSIZE, welcome.max_message_bytes + P.MAX_HEADER_BYTES + 4096)
        sub.setsockopt(zmq.SUBSCRIBE, P.PREAMBLE)
        sub.connect(endpoint)
        self._sub_endpoint = endpoint
        return sub

    def _drain(self, sock: zmq.Socket) -> list[P.Message]:
        out: list[P.Message] = []
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return out
            try:
                out.append(P.decode(frames))
            except P.ProtocolError as exc:
                self.log.warning(f"dropped a malformed message from the broker: {exc}")

    def _flush_outbox(self, control: zmq.Socket) -> None:
        while True:
            try:
                msg = self._outbox.get_nowait()
            except queue.Empty:
                return
            if not self._try_send(control, msg):
                return  # the broker is not there; stats are best effort

    def accept_welcome(self, msg: P.Welcome) -> None:
        """Take a welcome: a new session (its run, ports, an assigned id); what belonged to another run is dropped."""
        with self._cond:
            # Versions restart with a new run: never compare across runs. Only a different, named run resets
            # them: a welcome without a run (a restarted broker, before the learner said hello again) is no
            # run change, else the same run coming back could hand the actor an older version than it had.
            if self.params is not None and msg.run_id and msg.run_id != self.params.run_id:
                self.params = None
            if self.welcome is not None and msg.run_id and msg.run_id != self.welcome.run_id:
                self._fleet = None  # the fleet of another run
            self.welcome = msg
            self._welcome_from = self.brokers.current
            if self.hello.auto_id and msg.peer_id and msg.peer_id != self.hello.peer_id:
                # the broker assigned our id: every later message, and the hello of a reconnection, names it
                self.hello = dataclasses.replace(self.hello, peer_id=msg.peer_id)
                self.log = logger.bind(role=self.hello.role, peer=msg.peer_id)
            self.generation += 1
            self.sent = self.acked = 0  # a new session: what the old broker had in flight is gone
            self._cond.notify_all()
        at = f" at {self.connect}" if len(self.brokers) > 1 else ""  # which one, when there are several
        self.log.info(f"welcomed by broker{at}: run {msg.run_id or '(none yet)'}, ports {msg.ports}")

    def _refuse(self, reason: str) -> None:
        """The broker will not have us (bad hello, peer id in use): stop, and let the owner say why."""
        with self._cond:
            self.refused = reason
            self._stop.set()
            self._cond.notify_all()

    def accept_fleet(self, msg: P.Fleet) -> None:
        """Keep the newest fleet message of the link's run (the broker sends them in order on this socket)."""
        with self._cond:
            if self.welcome is None or msg.run_id != self.welcome.run_id:
                self.fleet_ignored += 1
                return
            self._fleet = (msg.seq, msg.actors)
            self._cond.notify_all()

    def _on_credit(self, msg: P.Credit) -> None:
        with self._cond:
            self.acked = min(self.sent, self.acked + msg.credit)
            self._cond.notify_all()

    def accept_params(self, msg: P.Parameters | P.ParamChunk) -> None:
        """Put versions together chunk by chunk (``params.Assembler``: every hash verified) and keep the
        newest whole one; never go back to an older version, never use a half-arrived one."""
        if self.welcome is None or msg.run_id != self.welcome.run_id:
            return
        if isinstance(msg, P.Parameters) and "flat" not in msg.arrays:
            self.params_rejected += 1
            self.log.warning(f"rejected parameters version {msg.policy_version}: no flat buffer")
            return
        refused = sum(self.assembler.rejected[r] for r in REFUSED_PARAMS)
        unsigned = self.assembler.rejected["signature"]
        whole = self.assembler.add(msg)
        if sum(self.assembler.rejected[r] for r in REFUSED_PARAMS) > refused:
            self.params_rejected += 1
            self.log.warning(
                f"rejected parameters version {msg.policy_version}: hash or chunk mismatch "
                f"({dict(self.assembler.rejected)} so far)"
            )
        if self.assembler.rejected["signature"] > unsigned:  # the version held stays in use
            self._ratelog.warning(
                "params_signature",
                f"refused parameters version {msg.policy_version} of run {msg.run_id!r}: {self.assembler.refusal}",
            )
        if whole is None:
            return
        msg = whole
        with self._cond:
            if self.params is None or msg.policy_version > self.params.policy_version:
                self.params = msg
                self._cond.notify_all()


PARAMS_RCVHWM = 64
"""Parameter messages a subscriber queues: whole versions of models up to ~128 MiB in 4 MiB chunks.
A version that loses a chunk here is not used; the broker sends the actor its newest whole version
directly when its heartbeats show it behind."""
REFUSED_PARAMS = ("chunk_hash", "whole_hash", "bad_chunk")
"""Assembler rejections that mean damaged data (not merely old, repeated or early)."""


def hello_fields() -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid()}
