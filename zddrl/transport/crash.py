"""A client's crash report: why its process is dying, bounded, sent to the broker in its bye.

The broker keeps it in `zddrl status` (departures): the traceback would otherwise be only in the dying process's
own log, on its own host.
"""

from __future__ import annotations

import traceback

from zddrl import protocol as P

CRASH_MESSAGE_CHARS = 1000
"""Longest exception message sent in a crash report."""
CRASH_TRACEBACK_CHARS = 4000
"""Longest traceback sent in a crash report; its end is kept (the innermost frames and the error)."""


def crash_reason(exc: BaseException) -> str:
    """``crashed: <type>: <message>`` then the traceback, both truncated to a few KB.

    Never raises: it runs while the process is already dying, and a broken ``__str__`` must not hide
    the original exception."""
    try:
        message = str(exc)
    except Exception:  # noqa: BLE001
        message = "<unprintable message>"
    if len(message) > CRASH_MESSAGE_CHARS:
        message = message[:CRASH_MESSAGE_CHARS] + " ..."
    try:
        # Each piece bounded too: the last one repeats the message, which must not crowd out the frames.
        tb = "".join(
            p if len(p) <= CRASH_MESSAGE_CHARS else p[:CRASH_MESSAGE_CHARS] + " ...\n"
            for p in traceback.format_exception(type(exc), exc, exc.__traceback__)
        )
    except Exception:  # noqa: BLE001
        tb = ""
    if len(tb) > CRASH_TRACEBACK_CHARS:
        tb = "... (traceback truncated)\n" + tb[-CRASH_TRACEBACK_CHARS:]
    return f"{P.CRASH_PREFIX}{type(exc).__name__}: {message}\n{tb}".rstrip("\n")
