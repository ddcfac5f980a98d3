"""The client side of a status request: one monitor's question to a broker, and why no answer came.

``zddrl status``, a standby broker's probe of its peer (broker/standby.py) and the test harnesses ask through
here: a fresh DEALER per request (a CURVE client with credentials on a closed bus), its handshake watched so that a
refusal is known at once rather than after the timeout.
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

import zmq
from loguru import logger
from zmq.utils.monitor import recv_monitor_message

from zddrl import protocol as P
from zddrl.config import split_endpoints
from zddrl.keys import Credentials
from zddrl.transport.handshakes import HANDSHAKE_FAILED, refusal


class Answer(NamedTuple):
    """What a status request got: the body, or why none came ("" for silence: nothing answered in time).
    ``refused``: a broker answered, with a reject (it rate-limits status requests): it lives, unlike silence."""

    body: dict[str, Any] | None
    why: str = ""

    @property
    def refused(self) -> bool:
        return isinstance(self, Refused)


class Refused(Answer):
    """The answer of a broker that refused the request with a reject (still a two-field ``Answer``)."""


def request_status(
    connect: str,
    timeout_s: float,
    context: zmq.Context | None = None,
    credentials: Credentials | None = None,
    *,
    page: int = 1,
) -> dict[str, Any] | None:
    """One status request for ``page`` of the member rows (from 1) on a fresh DEALER (a CURVE client with
    ``credentials`` on a closed bus); None if no broker answers within the timeout, refuses (it rate-limits
    status requests, or refuses the handshake), or answers with something that is not a valid status message: a
    caller that asks now and then must not die of a bad answer. ``connect`` may be a fallback list
    (``tcp://A:5555,tcp://B:5555``): each broker is asked in turn, ``timeout_s`` each, and the first answer is
    returned. ``ask_status`` says why none came."""
    return ask_status(connect, timeout_s, context, credentials, page=page).body


def ask_status(
    connect: str,
    timeout_s: float,
    context: zmq.Context | None = None,
    credentials: Credentials | None = None,
    *,
    page: int = 1,
) -> Answer:
    """``request_status``, with why no body came: a refused handshake is known at once (no keys on a closed bus,
    a key the broker does not hold), not after the timeout; a reject answer (``refused``) is told from silence."""
    ctx = context or zmq.Context.instance()
    whys, refused = [], False
    for endpoint in split_endpoints(connect):
        answer = _request_one(ctx, endpoint, timeout_s, credentials, page)
        if answer.body is not None:
            return answer
        if answer.why:
            whys.append(answer.why)
        refused = refused or answer.refused
    return (Refused if refused else Answer)(None, "; ".join(whys))


def _request_one(
    ctx: zmq.Context, connect: str, timeout_s: float, credentials: Credentials | None, page: int
) -> Answer:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if credentials is not None:
        credentials.apply(sock)
    monitor = sock.get_monitor_socket(HANDSHAKE_FAILED)
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(monitor, zmq.POLLIN)
    deadline = time.monotonic() + timeout_s
    try:
        sock.connect(connect)
        sock.send_multipart(P.encode(P.StatusRequest(peer_id="status", page=page)))
        while (left_ms := int((deadline - time.monotonic()) * 1000)) > 0:
            events = dict(poller.poll(left_ms))
            if monitor in events:  # ZeroMQ gives up on a refused handshake: no answer will come
                event = recv_monitor_message(monitor)["event"]
                key = credentials.client.name if credentials is not None else ""
                return Answer(None, refusal(event, connect, "monitor", key))
            if sock in events:
                answer = _answer(connect, sock)
                if answer is not None:
                    return answer
        return Answer(None)
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)


def _answer(connect: str, sock: zmq.Socket) -> Answer | None:
    """The status answer just received on ``sock``; None for anything else the broker might send first (skipped)."""
    try:
        msg = P.decode(sock.recv_multipart())
    except P.ProtocolError as exc:
        why = f"unusable status answer from {connect}: {exc}"
        logger.warning(why)
        return Answer(None, why)
    if isinstance(msg, P.Status):
        return Answer(msg.body)
    if isinstance(msg, P.Reject):
        why = f"the broker at {connect} refused the status request: {msg.reason}"
        logger.warning(why)
        return Refused(None, why)
    return None
