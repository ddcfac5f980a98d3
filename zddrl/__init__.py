"""zddrl: distributed deep reinforcement learning on a ZeroMQ message bus.

Roles: ``zddrl broker`` (routing), ``zddrl actor`` (sampling), ``zddrl learner`` (training);
``zddrl train`` runs all of them on one machine. The numerical functions ``gae`` and ``vtrace``
are importable from here; torch is only imported when they are first used, so actor hosts start
without it.
"""

from __future__ import annotations

import time as _time
from typing import Any

STARTED_AT = _time.time()
"""When this process imported zddrl: `zddrl train` measures wall_s_to_target from here."""
__version__ = "0.1.0"
__all__ = ["__version__", "gae", "vtrace"]


def __getattr__(name: str) -> Any:
    if name in ("gae", "vtrace", "GAEReturns", "VTraceReturns"):
        from zddrl.algos import returns

        return getattr(returns, name)
    raise AttributeError(f"module 'zddrl' has no attribute {name!r}")
