"""The broker's memory budget: its resident memory read every MEMORY_CHECK_S, and the reset of its sockets past it.

What libzmq buffers before the broker's code can see it cannot be bounded from Python: a multipart message is
delivered only once its last frame arrived, ``ZMQ_MAXMSGSIZE`` bounds each frame and not their number, and the
high-water marks count whole messages. So a key holder's message of many frames grows the broker until it ends,
and so do replies that peers never read. The one bound left is the process's own: ``MemoryBudget`` reads the
resident set (``/proc/self/statm``, one system call) and says when it passed the limit; the broker then closes
and binds again its four sockets with linger 0, which frees everything libzmq held for them (partial messages
included), and hands freed heap pages back to the system (``trim``). Clients reconnect on their own and say hello
again (docs/security.md, "Bounded resources").

A reset frees only what the sockets held: if the resident set is still over the limit once the sockets were
closed, what holds it is the broker's own state, and resetting again would only cost the fleet its connections.
The budget then waits until the resident set is back under the limit before it may call for another reset.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import zmq

from zddrl.broker.sockets import BrokerSockets, open_sockets

if TYPE_CHECKING:  # the broker calls check_memory from its loop
    from zddrl.broker.broker import Broker

MEMORY_CHECK_S = 0.1
"""Seconds between two reads of the resident set: the broker passes its limit by at most what arrives in that time
before it acts."""
RESET_SETTLE_S = 2.0
"""Seconds after a reset before a resident set still over the limit is judged not to be the sockets' (libzmq
frees a closed socket's buffers in its own threads, a little after the close)."""
AUTO_FRACTION = 0.5
"""``memory_limit_mib = 0``: this share of the memory the broker may use (its cgroup's limit, else the host's),
above what its process holds when the broker is made (a broker made inside a bigger process, as in tests, is not
charged for the rest of it)."""
RESET = "reset"
STUCK = "stuck"
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


_statm: tuple[int, int] | None = None
"""(pid, descriptor) of the process's ``/proc/self/statm``, opened once per process (descriptor -1: none)."""


def rss_bytes() -> int:
    """This process's resident set in bytes; 0 where ``/proc/self/statm`` does not exist (not Linux: no budget)."""
    global _statm
    pid = os.getpid()
    if _statm is None or _statm[0] != pid:  # a forked child reads its own, not its parent's
        try:
            _statm = (pid, os.open("/proc/self/statm", os.O_RDONLY))
        except OSError:
            _statm = (pid, -1)
    if _statm[1] < 0:
        return 0
    return int(os.pread(_statm[1], 128, 0).split()[1]) * _PAGE  # pread at offset 0 regenerates it: one system call


def memory_available() -> int:
    """Bytes of memory this process may use: its cgroup's limit (v2, then v1) where one is set, else the host's."""
    host = os.sysconf("SC_PHYS_PAGES") * _PAGE if hasattr(os, "sysconf") else 0
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < host:
            return int(text)
    return host


def limit_bytes(memory_limit_mib: int) -> int:
    """The limit in bytes of ``broker.memory_limit_mib`` (0: AUTO_FRACTION of ``memory_available()`` above the
    resident set now)."""
    if memory_limit_mib > 0:
        return memory_limit_mib << 20
    return int(memory_available() * AUTO_FRACTION) + rss_bytes()


def _malloc_trim() -> Callable[[], object]:
    try:  # the symbols of the running process, libc's among them
        malloc_trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return lambda: None
    return lambda: malloc_trim(0)


trim = _malloc_trim()
"""Hand freed heap pages back to the system (glibc's ``malloc_trim(0)``; nothing elsewhere): memory freed in
libzmq's threads otherwise stays in their arenas, resident, after a reset."""


class MemoryBudget:
    """``check(now)`` every MEMORY_CHECK_S (``next_at``): RESET when the sockets are to be reset (the resident set
    passed ``limit``, and the last reset, if any, brought it back under), STUCK once when a reset did not bring it
    back under, else "". ``rss`` is the last reading, in bytes."""

    def __init__(self, limit: int, rss: Callable[[], int] | None = None) -> None:
        self.limit = limit
        self._read = rss or rss_bytes
        self.rss = self._read()
        self.peak = self.rss
        self.next_at = 0.0
        self.reset_at: float | None = None
        """When the last reset was called for; None once the resident set went back under the limit."""
        self.stuck = False
        """Still over the limit RESET_SETTLE_S after a reset: not the sockets' memory (the broker logs it once)."""

    def check(self, now: float) -> str:
        self.next_at = now + MEMORY_CHECK_S
        self.rss = self._read()
        self.peak = max(self.peak, self.rss)
        if self.rss <= self.limit:
            self.reset_at, self.stuck = None, False
            return ""
        if self.reset_at is None:
            self.reset_at = now
            return RESET
        if not self.stuck and now - self.reset_at >= RESET_SETTLE_S:
            self.stuck = True
            return STUCK
        return ""


def check_memory(b: Broker, now: float) -> None:
    """Every MEMORY_CHECK_S (``b.memory.next_at``): past the budget, Broker ``b``'s sockets are reset."""
    budget = b.memory
    if budget.reset_at is not None and now - budget.reset_at < RESET_SETTLE_S:
        trim()  # what the closed sockets' buffers freed in libzmq's threads, as libzmq frees it
    action = budget.check(now)
    if action == RESET:
        reset_sockets(b)
    elif action == STUCK:
        b.ratelog.warning(
            "memory_stuck",
            f"the broker takes {budget.rss >> 20} MiB, over its budget of {budget.limit >> 20} MiB, after a reset of "
            "its sockets: what holds it is the broker's own state, not its queues; raise broker.memory_limit_mib if "
            "this is the fleet's honest size",
        )


def reset_sockets(b: Broker) -> None:
    """Close Broker ``b``'s four sockets with linger 0 and bind their ports again: everything libzmq held for them
    goes (messages still arriving, queued trajectories and replies), and every client reconnects and says hello
    again, a learner shard re-granting its credit. Members stay until their processes' new hellos replace them (at
    once: same key, same process) or they expire."""
    if b.handshakes is not None:
        for monitor in b.handshakes.monitors:
            b.poller.unregister(monitor)
        b.handshakes.close()
        b.handshakes = None
    old = (b.control, b.trajectories, b.learners, b.params)
    polled = {sock for sock, _ in b.poller.sockets}
    for sock in old:
        if sock in polled:
            b.poller.unregister(sock)
        sock.close(linger=0)
    _adopt(b, open_sockets(b.ctx, b.config, b.auth, b.ports), [sock in polled for sock in old])
    for member in b.membership.members.values():
        if member.conn_fd >= 0:  # every control connection closed: each key may take its ids back at once
            b.claims.connection_closed(member.conn_fd)
    b.unread.clear()
    trim()
    b.counters["memory_resets"] += 1
    b.ratelog.warning(
        "memory_reset",
        f"the broker took {b.memory.rss >> 20} MiB, over its budget of {b.memory.limit >> 20} MiB "
        "(broker.memory_limit_mib): its sockets were closed and bound again, freeing what they held; clients "
        "reconnect and say hello again",
    )


def _adopt(b: Broker, s: BrokerSockets, polled: list[bool]) -> None:
    """Sockets bound anew take the old ones' places in every part of ``b`` that uses them, and in its poller."""
    b.control, b.trajectories, b.learners, b.params = s.control, s.trajectories, s.learners, s.params
    b.replies.sock = s.control
    b.shards.learners = s.learners
    b.shards.replies.sock = s.learners
    b.router.trajectories = s.trajectories
    b.publisher.pub = s.params
    for sock, was_polled in zip(s[:4], polled):
        if was_polled:
            b.poller.register(sock, zmq.POLLIN)
    b.watch_handshakes()
