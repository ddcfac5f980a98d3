"""zddrl: distributed deep reinforcement learning on a ZeroMQ message bus.

Roles: ``zddrl broker`` (routing), ``zddrl actor`` (sampling), ``zddrl learner`` (training);
``zddrl train`` runs all of them on one machine. From Python: ``zddrl.train(config, ...)`` and
``zddrl.load_policy(checkpoint)`` (``zddrl.ops.api``), ``zddrl.AlgorithmSpec`` for an algorithm of one's own
(docs/extending.md), and the numerical functions ``gae`` and ``vtrace``. Each is imported when first used, so
actor hosts start without torch.
"""

from __future__ import annotations

import time as _time
from typing import TYPE_CHECKING, Any

STARTED_AT = _time.time()
"""When this process imported zddrl: `zddrl train` measures wall_s_to_target from here."""
__version__ = "0.1.0"
__all__ = [
    "__version__",
    "AlgorithmSpec",
    "Config",
    "LoadedPolicy",
    "TrainResult",
    "gae",
    "load_config",
    "load_policy",
    "train",
    "vtrace",
]
_LAZY = {
    "gae": "zddrl.algos.returns",
    "vtrace": "zddrl.algos.returns",
    "GAEReturns": "zddrl.algos.returns",
    "VTraceReturns": "zddrl.algos.returns",
    "AlgorithmSpec": "zddrl.algos.spec",
    "Config": "zddrl.config",
    "load_config": "zddrl.config",
    "LoadedPolicy": "zddrl.ops.api",
    "TrainResult": "zddrl.ops.api",
    "load_policy": "zddrl.ops.api",
    "train": "zddrl.ops.api",
}
"""Public names and their modules, imported when first used (an actor host's start-up never pays for torch)."""

if TYPE_CHECKING:  # pragma: no cover - what the lazy names are, for type checkers
    from zddrl.algos.returns import GAEReturns as GAEReturns
    from zddrl.algos.returns import VTraceReturns as VTraceReturns
    from zddrl.algos.returns import gae, vtrace
    from zddrl.algos.spec import AlgorithmSpec
    from zddrl.config import Config, load_config
    from zddrl.ops.api import LoadedPolicy, TrainResult, load_policy, train


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'zddrl' has no attribute {name!r}")
