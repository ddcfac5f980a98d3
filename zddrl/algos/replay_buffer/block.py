"""A rollout as ``prioritized.PrioritizedReplay`` stores it: the checks on its arrays and the layout of its block.

``insert`` writes one time-major rollout ``[T, N]`` as a contiguous block of ``(T + 1) N + K`` ring
slots (modulo the capacity):

====================  ==================================  =========================
offset in the block   observation                         transition
====================  ==================================  =========================
``t N + i``           ``obs[t, i]``                       step ``t`` of env ``i``
``T N + i``           ``next_obs[i]`` (after the rollout)  none
``T N + N + j``       ``trunc_obs[j]`` (``trunc_idx`` order)  none
====================  ==================================  =========================

The last ``N + K`` are observation-only slots (priority 0, never drawn): the price of never storing a
second copy of an observation is ``1/T`` more slots (plus one per truncated episode). A transition
summing ``k`` rewards (``nstep.py``) bootstraps from ``s_{t+k}``, which ``next_offsets`` finds
at offset ``(t + k) N + i``: ``obs[t + k]`` inside the rollout, ``next_obs`` when ``t + k = T``; after
a truncation at step ``t + k - 1`` it is that episode's ``trunc_obs`` (``obs[t + k]`` is already the
next episode's reset observation); after a termination it is the transition's own slot, a
placeholder: the discount is 0, and actors do not ship a terminated episode's last observation.
Every offset points forward or at the transition itself, which is what keeps wrap-around safe
(``prioritized.py``, "Wrap-around").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

__all__ = ["CheckedRollout", "checked_rollout", "next_offsets"]


class CheckedRollout(NamedTuple):
    obs: np.ndarray  # [T, N, *obs_shape]
    actions: np.ndarray  # [T, N, *action_shape]
    rewards: np.ndarray  # [T, N]
    terminated: np.ndarray  # [T, N] bool
    truncated: np.ndarray  # [T, N] bool
    next_obs: np.ndarray  # [N, *obs_shape]
    trunc_obs: np.ndarray  # [K, *obs_shape]
    trunc_pos: np.ndarray  # [T, N] int64, each step's row in trunc_obs, -1: none


def checked_rollout(
    arrays: Mapping[str, Any],
    obs_shape: tuple[int, ...],
    obs_dtype: np.dtype,
    action_shape: tuple[int, ...],
    action_dtype: np.dtype,
) -> CheckedRollout:
    """A rollout's arrays (wire names; ``trunc_idx``/``trunc_obs`` may be None) checked against the buffer's
    shapes and dtypes; ``ValueError`` names what does not fit. Arrays are not copied or cast here."""
    rewards = np.asarray(arrays["rewards"])
    if rewards.ndim != 2:
        raise ValueError(f"rewards must be time-major [T, N], not of shape {list(rewards.shape)}")
    T, N = rewards.shape
    trunc_idx, trunc_obs = arrays.get("trunc_idx"), arrays.get("trunc_obs")
    if trunc_obs is None:
        trunc_obs = np.zeros((0, *obs_shape), obs_dtype)
    obs = _as(arrays["obs"], "obs", (T, N, *obs_shape), obs_dtype)
    next_obs = _as(arrays["next_obs"], "next_obs", (N, *obs_shape), obs_dtype)
    trunc_obs = _as(trunc_obs, "trunc_obs", (len(trunc_obs), *obs_shape), obs_dtype)
    actions = _as(arrays["actions"], "actions", (T, N, *action_shape), action_dtype)
    flags = []
    for name in ("terminated", "truncated"):
        a = np.asarray(arrays[name])
        if a.shape != (T, N):
            raise ValueError(f"{name} has shape {list(a.shape)}, expected {[T, N]}")
        flags.append(a.astype(bool, copy=False))
    terminated, truncated = flags
    trunc_idx = np.asarray(trunc_idx if trunc_idx is not None else [], dtype=np.int64).reshape(-1)
    wanted = np.flatnonzero(truncated & ~terminated)
    if len(trunc_idx) != len(trunc_obs) or not np.array_equal(np.sort(trunc_idx), wanted):
        raise ValueError(
            f"trunc_idx {trunc_idx.tolist()} must list the truncated, not terminated steps {wanted.tolist()}, "
            f"one final observation each ({len(trunc_obs)} given)"
        )
    trunc_pos = np.full(T * N, -1, dtype=np.int64)
    trunc_pos[trunc_idx] = np.arange(len(trunc_idx))
    return CheckedRollout(obs, actions, rewards, terminated, truncated, next_obs, trunc_obs, trunc_pos.reshape(T, N))


def _as(a: Any, name: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """``a`` as an array of ``shape`` whose dtype converts to ``dtype`` within its kind (no float -> uint8)."""
    a = np.asarray(a)
    if a.shape != shape:
        raise ValueError(f"{name} has shape {list(a.shape)}, expected {list(shape)}")
    if not np.can_cast(a.dtype, dtype, "same_kind"):
        raise ValueError(f"{name} is {a.dtype}, the buffer stores {dtype}: convert it where that is safe")
    return a


def next_offsets(steps: np.ndarray, terminated: np.ndarray, truncated: np.ndarray, trunc_pos: np.ndarray) -> np.ndarray:
    """Each transition's bootstrap observation ``s_{t+k}`` as an offset in its block ``[T, N]`` (module docstring)."""
    T, N = steps.shape
    t, i = np.arange(T)[:, None], np.arange(N)[None, :]
    last = t + steps - 1  # the last step summed
    offsets = (last + 1) * N + i  # for t + k = T this is the next_obs slot T N + i
    term = np.take_along_axis(terminated, last, axis=0)
    trunc = np.take_along_axis(truncated, last, axis=0) & ~term
    offsets = np.where(trunc, T * N + N + np.take_along_axis(trunc_pos, last, axis=0), offsets)
    return np.where(term, t * N + i, offsets)
