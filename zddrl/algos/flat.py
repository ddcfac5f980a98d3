"""The rules actor and learner must share, in numpy (actor hosts import this without torch).

Parameters travel as one flat float32 buffer plus layout rows ``[name, dtype, shape, offset]`` (offsets
in elements); ``unflatten`` rebuilds the named arrays. Observations are normalised with the learner's
running statistics and clipped to ``OBS_CLIP`` on both sides, so that the network sees the same
inputs when acting and when learning.
"""

from __future__ import annotations

import numpy as np

OBS_CLIP = 10.0
"""Normalised observations are clipped to [-OBS_CLIP, OBS_CLIP]."""


def unflatten(flat: np.ndarray, layout: list) -> dict[str, np.ndarray]:
    """Layout rows -> named arrays (views into ``flat``). Raises ValueError if they do not fit."""
    out = {}
    for name, dtype, shape, offset in layout:
        size = int(np.prod(shape))
        if dtype != "float32" or offset < 0 or offset + size > flat.size:
            raise ValueError(f"layout entry {name!r} does not fit a flat buffer of {flat.size} elements")
        out[name] = flat[offset : offset + size].reshape(shape)
    return out


def normalize_obs(obs: np.ndarray, mean: np.ndarray | None, var: np.ndarray | None) -> np.ndarray:
    if mean is None or var is None:
        return obs.astype(np.float32, copy=False)
    return np.clip((obs - mean) / np.sqrt(var + 1e-8), -OBS_CLIP, OBS_CLIP).astype(np.float32)
