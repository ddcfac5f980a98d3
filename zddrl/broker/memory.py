"""The broker's memory budget: its resident memory read every MEMORY_CHECK_S, and the reset of its sockets past it.

What libzmq buffers before the broker's code can see it cannot be bounded from Python: a multipart message is
delivered only once its last frame arrived, ``ZMQ_MAXMSGSIZE`` bounds each frame and not their number, and the
high-water marks count whole messages. So a key holder's message of many frames grows the broker until it ends,
and so do replies that peers never read. The one bound left is the process's own: ``MemoryBudget`` reads the
resident set (``/proc/self/statm``, one system call) and says when it passed the limit; the broker then closes
and binds again its four sockets with linger 0 (``sockets.BrokerSockets.reopen``), which frees everything libzmq
held for them (partial messages included), and hands freed heap pages back to the system (``trim``). Clients
reconnect on their own and say hello again (docs/security.md, "Bounded resources").

A reset frees only what the sockets held: if the resident set is still over the limit once the sockets were
closed, what holds it is the broker's own state, and resetting again would only cost the fleet its connections.
The budget then waits until the resident set is back under the limit before it may call for another reset.

A fleet whose honest load is over the budget refills what each reset freed: past RESET_STORM resets in
RESET_WINDOW_S the budget says so once (an error that names the budget and the peak) and spaces the next resets
out, each wait twice the last. A port that does not bind again within the reset leaves the broker on unbound
stand-in sockets (it keeps its state and serves nobody) until a retry, backed off, binds it.
"""

from __future__ import annotations

import ctypes
import os
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from zddrl.broker.sockets import BindError, BrokerSockets
from zddrl.logs import RateLimitedLog
from zddrl.proc import rss_bytes

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
RESET_STORM = 3
"""Resets within RESET_WINDOW_S past which the budget spaces them out: the fleet's honest load is over the budget."""
RESET_WINDOW_S = 300.0
RESET_SPACING_S = 30.0
"""The first wait between two resets once they are spaced out; each next one waits twice the last."""
REBIND_RETRY_S = 1.0
"""The first wait before binding the ports again after a reset could not; each next one waits twice the last, up
to REBIND_RETRY_MAX_S."""
REBIND_RETRY_MAX_S = 30.0
RESET = "reset"
STUCK = "stuck"
STORM = "storm"
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


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
        self.resets: deque[float] = deque()
        """When the resets of the last RESET_WINDOW_S were called for."""
        self.last_reset = float("-inf")
        self.spacing_s = 0.0
        """The least time from one reset to the next (0: not spaced out)."""
        self.rebind_at: float | None = None
        """When to bind the ports again after a reset could not; None: they are bound."""
        self.rebind_wait_s = REBIND_RETRY_S

    def check(self, now: float) -> str:
        """RESET, STUCK, STORM (once, when resets start to be spaced out: a RESET is due next) or ""."""
        self.next_at = now + MEMORY_CHECK_S
        self.rss = self._read()
        self.peak = max(self.peak, self.rss)
        if self.rss <= self.limit:
            self.reset_at, self.stuck = None, False
            return ""
        if self.reset_at is None:
            return self._reset(now)
        if not self.stuck and now - self.reset_at >= RESET_SETTLE_S:
            self.stuck = True
            return STUCK
        return ""

    def _reset(self, now: float) -> str:
        while self.resets and now - self.resets[0] > RESET_WINDOW_S:
            self.resets.popleft()
        if self.spacing_s and now - self.last_reset > 2 * RESET_WINDOW_S:  # no reset was due for long: calm again
            self.spacing_s = 0.0
        if not self.spacing_s and len(self.resets) >= RESET_STORM:
            self.spacing_s = RESET_SPACING_S
            return STORM  # said once; the reset itself waits for the spacing
        if self.spacing_s:
            if now - self.last_reset < self.spacing_s:
                return ""
            self.spacing_s = min(self.spacing_s * 2, RESET_WINDOW_S)
        self.resets.append(now)
        self.last_reset = self.reset_at = now
        return RESET

    def rebind_failed(self, now: float) -> None:
        """A reset could not bind its ports: try again after a wait twice the last one."""
        self.rebind_at = now + self.rebind_wait_s
        self.rebind_wait_s = min(self.rebind_wait_s * 2, REBIND_RETRY_MAX_S)

    def rebound(self) -> None:
        self.rebind_at, self.rebind_wait_s = None, REBIND_RETRY_S


class SocketResets:
    """The budget acted on: ``check(now)`` every MEMORY_CHECK_S (``budget.next_at``) resets ``sockets`` past the
    budget (``reset``), says so, and binds the ports again until they bind. ``connections_closed`` is called at each
    reset: every control connection closed with the sockets."""

    def __init__(
        self,
        budget: MemoryBudget,
        sockets: BrokerSockets,
        connections_closed: Callable[[], None],
        counters: dict[str, int],
        ratelog: RateLimitedLog,
        log: Any,
    ) -> None:
        self.budget = budget
        self.sockets = sockets
        self.connections_closed = connections_closed
        self.counters = counters
        self.ratelog = ratelog
        self.log = log

    def check(self, now: float) -> None:
        budget = self.budget
        if budget.rebind_at is not None:  # a reset could not bind the ports again: nothing else until they are
            if now >= budget.rebind_at:
                self._reopen(now)
            budget.next_at = now + MEMORY_CHECK_S if budget.rebind_at is None else budget.rebind_at
            return
        if budget.reset_at is not None and now - budget.reset_at < RESET_SETTLE_S:
            trim()  # what the closed sockets' buffers freed in libzmq's threads, as libzmq frees it
        action = budget.check(now)
        if action == RESET:
            self.reset(now)
        elif action == STORM:
            self.ratelog.log(
                "memory_storm",
                f"the broker reset its sockets {RESET_STORM} times in {RESET_WINDOW_S:.0f} s and still takes "
                f"{budget.rss >> 20} MiB (peak {budget.peak >> 20} MiB), over its budget of {budget.limit >> 20} MiB "
                "(broker.memory_limit_mib): the fleet refills what a reset frees; resets are spaced out from now on "
                f"(at least {budget.spacing_s:.0f} s apart, doubling); raise the budget if this is the fleet's honest "
                "size",
                "ERROR",
            )
        elif action == STUCK:
            self.ratelog.warning(
                "memory_stuck",
                f"the broker takes {budget.rss >> 20} MiB, over its budget of {budget.limit >> 20} MiB, after a reset "
                "of its sockets: what holds it is the broker's own state, not its queues; raise "
                "broker.memory_limit_mib if this is the fleet's honest size",
            )

    def reset(self, now: float) -> None:
        """Close the four sockets with linger 0 and bind their ports again: everything libzmq held for them goes
        (messages still arriving, queued trajectories and replies), and every client reconnects and says hello
        again, a learner shard re-granting its credit. Members stay until their processes' new hellos replace them
        (at once: same key, same process) or they expire."""
        self._reopen(now)
        self.connections_closed()
        trim()
        self.counters["memory_resets"] += 1
        self.ratelog.warning(
            "memory_reset",
            f"the broker took {self.budget.rss >> 20} MiB, over its budget of {self.budget.limit >> 20} MiB "
            "(broker.memory_limit_mib): its sockets were closed and bound again, freeing what they held; clients "
            "reconnect and say hello again",
        )

    def _reopen(self, now: float) -> None:
        """Bind the ports again; if one does not bind, the sockets' unbound stand-ins serve meanwhile (every send
        finds no peer, as after a reset) and the budget retries later (``memory_rebind_failed``)."""
        budget = self.budget
        try:
            self.sockets.reopen()
        except BindError as exc:
            self.counters["memory_rebind_failed"] += 1
            if budget.rebind_at is None:
                why = f"{exc}; it serves no one until a retry (backed off) binds them"
                self.log.error(f"the broker could not bind its ports again after a memory reset: {why}")
            budget.rebind_failed(now)
            return
        if budget.rebind_at is not None:
            self.log.info("the broker bound its ports again after a memory reset: clients reconnect")
        budget.rebound()
