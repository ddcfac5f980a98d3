"""Facts about this process that every role reports (memory)."""
from __future__ import annotations

import os
import resource

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_mb() -> float:
    """Resident memory now, in MiB (Linux /proc; elsewhere the peak, which is what getrusage knows)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE / 2**20
    except (OSError, IndexError, ValueError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
