"""Logging set-up (configured once, in the CLI entry point; library code only binds context) and
rate-limited warnings for events that can repeat at the rate of messages."""

from __future__ import annotations

import os
import socket
import sys
import time
from collections import defaultdict

from loguru import logger

LOG_EVERY_S = 5.0
"""A repeated warning's key is logged at most once per this many seconds (with a count)."""
FORMAT = (
    "<green>{time:HH:mm:ss.SSS}</green> <level>{level: <7}</level> "
    "<cyan>{extra[role]}</cyan>@{extra[host]}:{process} <level>{message}</level>"
)


def configure(level: str = "INFO", log_file: str | None = None, role: str = "main") -> None:
    """Route loguru to stderr (and a rotated file); bind role and host into every line."""
    logger.remove()
    logger.configure(extra={"role": role, "host": socket.gethostname(), "peer": ""})
    logger.add(sys.stderr, level=level.upper(), format=FORMAT, colorize=None if sys.stderr.isatty() else False)
    if log_file:
        rank = os.environ.get("RANK")
        if rank is not None:  # learner shards share their launcher's command line: each gets its own file
            stem, dot, ext = log_file.rpartition(".")
            log_file = f"{stem}.shard{rank}.{ext}" if dot and "/" not in ext else f"{log_file}.shard{rank}"
        os.makedirs(os.path.dirname(os.path.abspath(log_file)), exist_ok=True)
        logger.add(log_file, level=level.upper(), format=FORMAT, rotation="50 MB", retention=5, enqueue=True)


class RateLimitedLog:
    """Logs the first occurrence of a key at once, then at most once per LOG_EVERY_S with a count."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = defaultdict(int)
        self._pending: dict[str, tuple[str, str]] = {}

    def warning(self, key: str, text: str) -> None:
        self.log(key, text, "WARNING")

    def info(self, key: str, text: str) -> None:
        self.log(key, text, "INFO")

    def log(self, key: str, text: str, level: str) -> None:
        now = time.monotonic()
        if now - self._last.get(key, -1e9) >= LOG_EVERY_S:
            extra = f" ({self._suppressed[key]} more like it since the last line)" if self._suppressed[key] else ""
            logger.log(level, text + extra)
            self._last[key] = now
            self._suppressed[key] = 0
        else:
            self._suppressed[key] += 1
            self._pending[key] = (level, text)

    def flush(self) -> None:
        """Report suppressed repeats whose window has passed (call it periodically): without it, a burst
        of 200 bad messages followed by silence would leave one line and never mention the other 199."""
        now = time.monotonic()
        for key, n in list(self._suppressed.items()):
            if n and now - self._last.get(key, -1e9) >= LOG_EVERY_S:
                level, text = self._pending.pop(key, ("WARNING", key))
                logger.log(level, f"{n} more like it since the last line: {text}")
                self._last[key] = now
                self._suppressed[key] = 0
