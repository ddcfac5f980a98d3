"""Logging set-up: configured once, in the CLI entry point; library code only binds context."""
from __future__ import annotations

import os
import socket
import sys

from loguru import logger

FORMAT = ("<green>{time:HH:mm:ss.SSS}</green> <level>{level: <7}</level> "
          "<cyan>{extra[role]}</cyan>@{extra[host]}:{process} <level>{message}</level>")


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
