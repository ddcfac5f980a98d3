"""The broker's ZAP handler (RFC 27) and its log of refused handshakes, one line per interval, per peer address.

libzmq asks the handler about every CURVE client once the client's INITIATE has been decrypted, so by then the
handshake's crypto is spent whatever the answer; what the handler adds is its own work, under the GIL the broker's
loop needs. pyzmq's generic ``ThreadAuthenticator`` runs an asyncio loop in its thread and builds async socket
wrappers per request, which under a stranger's flood of handshakes cost the broker more CPU than libzmq's crypto
itself. ``ZapHandler`` is a plain thread on a REP socket: per request one blocking receive (the GIL released while
it waits), one dict lookup by the raw key, one send.

``RefusedHandshakes`` gathers the handshakes refused, by peer address: the ZAP handler's refusals (the address is
in the ZAP request) and the ones libzmq refuses before asking (a client without CURVE, a wrong broker key), whose
address the control socket's monitor gives where it can (broker/auth.py, ``HandshakeCounter``). It logs the first
refusal at once and after that at most one line per ``REFUSED_LOG_EVERY_S`` naming the busiest addresses, so that a
flood costs a few lines, and keeps at most ``MAX_SOURCES`` (address, reason) pairs per interval, whatever the number
of addresses.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import zmq
from loguru import logger
from zmq.utils import z85

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
"""Where libzmq sends a context's ZAP requests (RFC 27): one handler per context."""
REFUSED_LOG_EVERY_S = 30.0
"""Refused handshakes are logged at once, then at most once per this many seconds (counted per address)."""
MAX_SOURCES = 256
"""(address, reason) pairs counted one by one per log interval; past it, the least seen pair's count joins the
other addresses' sum and a new pair takes its place."""
SOURCES_NAMED = 8
"""The busiest (address, reason) pairs a log line names with their counts; the others are summed."""
UNKNOWN_ADDRESS = "an unknown address"
"""A refusal libzmq made before ZAP whose connection's address was not read (broker/auth.py, ``HandshakeCounter``)."""

Reason = tuple[str, ...]
"""Why one handshake was refused: ``("unlisted", KEY_HEX)``, ``("role", ROLE, SOCKET)``, ``("mechanism", NAME)``
from ZAP; ``("no-curve", SOCKET)``, ``("server-key", SOCKET)``, ``("closed", SOCKET)``, ``("protocol", SOCKET,
CODE)`` from a socket monitor. Worded only when a line is logged."""


def reason_text(reason: Reason) -> str:
    """What a refusal means to an operator, and what to check."""
    kind, *rest = reason
    if kind == "unlisted":
        raw = bytes.fromhex(rest[0])
        key = z85.encode(raw).decode()[:8] if len(raw) == 32 else "(not 32 bytes)"
        return f"a CURVE key the broker does not list, {key}...: not in its --keys, or revoked"
    if kind == "role":
        return f"a {rest[0]} key, which the {rest[1]} socket does not admit"
    if kind == "mechanism":
        return f"the {rest[0]} mechanism where the broker speaks CURVE only"
    where = f" on {rest[0]}" if rest else ""
    if kind == "no-curve":
        return f"no CURVE{where}: a client without --keys"
    if kind == "server-key":
        return f"a wrong broker key{where}: the client's broker/*.key is not this broker's"
    if kind == "closed":
        return f"closed during the handshake{where}, as a client without --keys does"
    return f"ZMTP protocol error {rest[1] if len(rest) > 1 else '?'}{where}"


class RefusedHandshakes:
    """Refused handshakes by peer address and reason over the current log interval; ``note`` from any thread."""

    def __init__(
        self,
        every_s: float | None = None,
        log: Callable[[str], Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.every_s = REFUSED_LOG_EVERY_S if every_s is None else every_s
        self._log = log or logger.bind(role="broker").warning
        self._clock = clock
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, Reason], int] = {}
        """(address, reason) -> refusals this interval."""
        self._others = 0
        """Refusals this interval of pairs that gave way to others in the table."""
        self._first = 0.0
        """When this interval's first refusal came."""
        self._last_line = -float("inf")

    def note(self, address: str, reason: Reason) -> None:
        """Count one refused handshake; logs at once when no line was logged in the last interval."""
        now = self._clock()
        with self._lock:
            if not (self._counts or self._others):
                self._first = now
            key = (address, reason)
            if key in self._counts:
                self._counts[key] += 1
            else:
                if len(self._counts) >= MAX_SOURCES:  # the least seen gives way: a busy address still gets named
                    self._others += self._counts.pop(min(self._counts, key=self._counts.__getitem__))
                self._counts[key] = 1
            line = self._due_line(now)
        if line:
            self._log(line)

    def flush(self, final: bool = False) -> float:
        """Log what the interval gathered if a line is due (``final``: now, as the broker stops); returns the
        seconds until the next one may be."""
        now = self._clock()
        with self._lock:
            line = self._due_line(now, final)
            wait = self._last_line + self.every_s - now if self._counts or self._others else self.every_s
        if line:
            self._log(line)
        return max(wait, 0.0)

    def _due_line(self, now: float, final: bool = False) -> str:
        if (now - self._last_line < self.every_s and not final) or not (self._counts or self._others):
            return ""
        busiest = sorted(self._counts.items(), key=lambda kv: -kv[1])
        parts = [f"{n} from {addr} ({reason_text(why)})" for (addr, why), n in busiest[:SOURCES_NAMED]]
        rest = sum(n for _, n in busiest[SOURCES_NAMED:]) + self._others
        if rest:
            parts.append(f"{rest} more from other addresses")
        total = sum(self._counts.values()) + self._others
        span = now - self._first
        self._counts, self._others, self._last_line = {}, 0, now
        when = f" in the last {span:.0f} s" if span >= 1.0 else ""
        return f"refused {total} handshake{'s' if total != 1 else ''}{when}: " + "; ".join(parts)


class Judge(Protocol):
    """Who decides: ``judge(ZAP domain, raw CURVE public key)`` is (the ZAP User-Id, None) if admitted, else ("",
    why not); ``denied`` counts the refusals (the handler's thread adds to it)."""

    denied: int

    def judge(self, domain: bytes, key: bytes) -> tuple[str, Reason | None]: ...


class ZapHandler:
    """The ZAP handler of one context, on a thread of its own: ``judge`` decides each CURVE client, refusals are
    counted in ``judge.denied`` and noted in ``refused`` with the client's address."""

    def __init__(self, ctx: zmq.Context, judge: Judge, refused: RefusedHandshakes) -> None:
        self.ctx = ctx
        self.judge = judge
        self.refused = refused
        self._stopping = False
        self.errors = 0
        """Requests the handler failed on (refused with a 500)."""
        self._zap = ctx.socket(zmq.REP)
        self._zap.setsockopt(zmq.LINGER, 0)
        self._zap.bind(ZAP_ENDPOINT)  # in the caller's thread: a second handler in this context fails here, loudly
        self._thread = threading.Thread(target=self._serve, name="zap", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        # A blocking receive (the GIL released) with a timeout for the log, rather than a poller: the least work
        # per request. stop() wakes it with a request of its own.
        try:
            while not self._stopping:
                self._zap.setsockopt(zmq.RCVTIMEO, int(self.refused.flush() * 1000) + 1)
                try:
                    frames = self._zap.recv_multipart()
                except zmq.Again:
                    continue
                if not self._stopping:
                    self._zap.send_multipart(self._reply(frames))
        except zmq.ContextTerminated:
            pass
        except Exception:
            # Left bound: handshakes then wait unanswered and time out. Unbound, libzmq would admit every key (a
            # CURVE server whose context has no ZAP handler authenticates no one).
            logger.exception("the broker's ZAP handler stopped: no client can complete a handshake now")
            return
        self._zap.close(linger=0)

    def _reply(self, frames: list[bytes]) -> list[bytes]:
        try:
            return self.answer(frames)
        except Exception:  # a bug, not the client's doing: refuse this one, say so once, keep serving the others
            self.errors += 1
            if self.errors == 1:
                logger.exception("the broker's ZAP handler failed on a request (refused; later failures counted)")
            return [b"1.0", frames[1] if len(frames) > 1 else b"", b"500", b"internal error", b"", b""]

    def answer(self, frames: list[bytes]) -> list[bytes]:
        """The ZAP reply to one request: ``version, request_id, domain, address, identity, mechanism, credentials``
        in; ``version, request_id, status, text, user_id, metadata`` out."""
        if len(frames) < 6:  # libzmq never sends one; answer what can be answered
            return [b"1.0", frames[1] if len(frames) > 1 else b"", b"500", b"malformed ZAP request", b"", b""]
        version, request_id, domain, address, _identity, mechanism = frames[:6]
        if mechanism == b"CURVE" and len(frames) == 7:
            user, reason = self.judge.judge(domain, frames[6])
        else:
            user, reason = "", ("mechanism", mechanism.decode("ascii", "replace"))
        if reason is None:
            return [version, request_id, b"200", b"OK", user.encode(), b""]
        self.judge.denied += 1
        self.refused.note(address.decode("ascii", "replace") or "an unnamed peer", reason)
        return [version, request_id, b"400", b"not admitted", b"", b""]

    def alive(self) -> bool:
        """Whether the handler's thread runs (dead, no handshake completes: the broker admits no one)."""
        return self._thread.is_alive()

    def stop(self) -> None:
        if self._thread.is_alive():
            self._stopping = True
            wake = self.ctx.socket(zmq.REQ)
            wake.setsockopt(zmq.LINGER, 0)
            wake.connect(ZAP_ENDPOINT)
            wake.send(b"")
            self._thread.join(timeout=5)
            wake.close(linger=0)
        if not self._thread.is_alive() and not self._zap.closed:  # its thread died, leaving it bound
            self._zap.close(linger=0)
        self.refused.flush(final=True)
