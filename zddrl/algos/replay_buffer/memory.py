"""What a replay buffer costs in memory, and the check that it fits before anything is allocated.

The sizes are those of ``prioritized.PrioritizedReplay``'s arrays (its module docstring, "Storage"). The
check compares them with the memory available *now* (``MemAvailable`` in /proc/meminfo: free memory
plus the caches the kernel can drop, without swapping): numpy's zeroed arrays are only backed by
pages as they fill, so without it a buffer too big for the host is built happily and the learner is
killed by the OOM killer hours later, when the buffer is nearly full.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from zddrl.algos.replay_buffer.sumtree import SumTree

__all__ = ["SLOT_EXTRA_BYTES", "ReplayMemoryError", "available_memory", "check_fits", "replay_nbytes"]

SLOT_EXTRA_BYTES = 4 + 4 + 4 + 4
"""returns, discounts (float32), next_slot, versions (int32): what a slot holds besides obs and action."""


class ReplayMemoryError(ValueError):
    """A buffer of this capacity would not fit in the memory available."""


def available_memory() -> int:
    """Bytes the kernel says can be allocated now without swapping (``MemAvailable``), else free pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def slot_nbytes(obs_shape: tuple[int, ...], obs_dtype: Any, action_shape: tuple[int, ...], action_dtype: Any) -> int:
    """Bytes of one slot's data, without the trees: ``obs + action + SLOT_EXTRA_BYTES``."""
    obs = int(np.prod(obs_shape, dtype=np.int64)) * np.dtype(obs_dtype).itemsize
    action = int(np.prod(action_shape, dtype=np.int64)) * np.dtype(action_dtype).itemsize
    return obs + action + SLOT_EXTRA_BYTES


def replay_nbytes(
    capacity: int,
    obs_shape: tuple[int, ...],
    obs_dtype: Any,
    action_shape: tuple[int, ...] = (),
    action_dtype: Any = np.int64,
) -> int:
    """Bytes a ``PrioritizedReplay`` of this capacity allocates: its arrays and both trees."""
    return capacity * slot_nbytes(obs_shape, obs_dtype, action_shape, action_dtype) + SumTree.nbytes_for(capacity)


def check_fits(capacity: int, nbytes: int, memory_fraction: float, available: int | None = None) -> None:
    """Raise ``ReplayMemoryError`` (one line) if ``nbytes`` exceed ``memory_fraction`` of the memory available."""
    have = available_memory() if available is None else available
    if nbytes > memory_fraction * have:
        raise ReplayMemoryError(
            f"a replay buffer of capacity {capacity:,} needs {nbytes / 2**30:.2f} GiB ({nbytes // capacity:,} B a "
            f"slot), more than {memory_fraction:.0%} of the {have / 2**30:.2f} GiB available: lower the capacity"
        )
