"""The learner-local prioritized replay buffer: a ring of transitions and a sum-tree over their priorities.

Proportional prioritized replay, Schaul, Quan, Antonoglou, Silver, "Prioritized Experience Replay",
ICLR 2016 (arXiv:1511.05952), algorithm 1: transition ``i`` is drawn with probability
``P(i) = p_i / sum_k p_k``, ``p_i = (|delta_i| + eps)^alpha``; new transitions get the largest
priority seen so far (or, as Ape-X's actors do, one computed from their own TD error); the bias is
corrected by the importance weights ``w_i = (N P(i))^-beta / max_j w_j = (p_i / p_min)^-beta``,
``beta`` annealed linearly from ``beta0`` to 1 over ``beta_steps`` calls of ``sample``.
Numpy only (no torch, no sockets): every insert, sample and update is vectorized; the only Python
loops run over the tree's levels (``sumtree.py``) and over ``n`` (``nstep.py``).

**Storage.** One ring of ``capacity`` slots; a slot holds one observation, and, when it is a
transition's start, that transition. Per slot:

==============  ======================  =================================================
array           dtype                   what
==============  ======================  =================================================
``obs``         the env's (``uint8``    the observation (``[capacity, *obs_shape]``)
                stays ``uint8``)
``actions``     the run's               the action taken from it
``returns``     float32                 the n-step return ``G_t`` (``nstep.py``)
``discounts``   float32                 ``gamma^k``; 0 after a termination, and when no transition
``next_slot``   int32                   the slot holding ``s_{t+k}``, the bootstrap observation
``versions``    int32                   the policy version that acted; -1: observation only
(sum-tree)      float64 + float32       the priority, sums and mins (``sumtree.py``)
==============  ======================  =================================================

so a slot costs ``obs + action + 16`` bytes plus the trees' ``24 * 2^ceil(log2 C) / C`` (25 at
10^6). The bare minimum of a transition with a shared next observation is ``obs + action + 4
(reward) + 1 (done)`` and a plain ``(s, a, r, s', done)`` row is ``2 obs + action + 5``: for
CartPole (4 float32, int64 actions) 65 B a slot against 29 and 45, for 4x84x84 uint8 frames
28,273 B against 28,237 and 56,461. ``zddrl bench replay`` prints the figures it measures.

**A rollout's block.** ``insert`` writes one time-major rollout ``[T, N]`` as a contiguous block of
``(T + 1) N + K`` slots: its ``T N`` transitions, then the ``N`` observations after it (``next_obs``),
then the ``K`` final observations of episodes truncated in it (``trunc_obs``); the last ``N + K``
are observation-only (priority 0, never drawn). A transition's ``next_slot`` points at ``obs[t + k]``
in its block, at ``next_obs`` when ``t + k = T``, or at its episode's ``trunc_obs`` after a
truncation; after a termination at its own slot (a placeholder: the discount is 0). The details
are in ``block.py``, the returns in ``nstep.py``.

**Wrap-around.** New blocks overwrite the oldest slots first, in the order they were written, and
every ``next_slot`` points forward within its own block. So while a transition's slot is alive,
its bootstrap observation is too, even when a block's front has already been overwritten or the
block wraps past the ring's end. A block must fit in the ring (``ValueError`` otherwise).

**Ids.** ``insert`` and ``sample`` name transitions by their id: the count of slots written before
them (int64, never reused), ``slot = id % capacity``. ``update_priorities`` skips, and counts in
``stale_updates``, the ids whose slot has been overwritten since they were sampled (the learner
computed their TD errors on data that is gone) and those retired by version.

**Policy versions.** ``drop_older_than(v)`` retires (priority 0, never drawn again) every
transition acted by a version older than ``v`` and raises the buffer's version floor: later
inserts of older versions are retired on arrival, and updates never bring them back. The floor
only rises. ``version_counts`` is the buffer's version histogram.

**Threads.** Nothing here locks: one thread inserts, samples and updates, or the caller holds a
lock around each call (a learner that receives on one thread and trains on another).

**Memory.** The arrays are allocated at construction; the OS backs their pages as they fill.
A buffer that needs more than ``memory_fraction`` of the memory available now (``MemAvailable``)
is refused there, with one line naming the capacity, the bytes and what is available.

**Checkpoints.** ``state_dict`` holds numpy arrays (views of the used slots: save them before the
next insert) and plain scalars, lists, strings and dicts; turned into tensors with
``torch.from_numpy``, the checkpoint loads with ``torch.load(weights_only=True)``.
``load_state_dict`` takes them back as numpy arrays or CPU tensors.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from zddrl.algos.replay_buffer.block import CheckedRollout, checked_rollout, next_offsets
from zddrl.algos.replay_buffer.memory import ReplayMemoryError, available_memory, check_fits, replay_nbytes
from zddrl.algos.replay_buffer.nstep import nstep_returns
from zddrl.algos.replay_buffer.sumtree import SumTree

__all__ = ["PrioritizedReplay", "TransitionBatch", "ReplayMemoryError", "available_memory", "replay_nbytes"]

_DATA = ("actions", "returns", "discounts", "next_slot", "versions")


class TransitionBatch(NamedTuple):
    ids: np.ndarray  # [B] int64, for update_priorities
    weights: np.ndarray  # [B] float32, importance weights, max 1
    obs: np.ndarray  # [B, *obs_shape], the buffer's dtype
    actions: np.ndarray  # [B, *action_shape]
    returns: np.ndarray  # [B] float32, n-step returns
    discounts: np.ndarray  # [B] float32, target = returns + discounts * max_a Q(next_obs, a)
    next_obs: np.ndarray  # [B, *obs_shape]
    versions: np.ndarray  # [B] int32, the policy version that acted


class PrioritizedReplay:
    """A ring of ``capacity`` slots with proportional prioritized sampling (module docstring).

    ``alpha``, ``beta0``, ``beta_steps``, ``eps``: the paper's priority exponent, initial importance
    exponent, its annealing length (in ``sample`` calls) and the priority's floor. ``gamma``,
    ``n_step``: the returns stored. ``seed``: the sampling generator's. ``memory_fraction``: the share
    of the available memory the buffer may take.
    """

    def __init__(
        self,
        capacity: int,
        obs_shape: tuple[int, ...],
        obs_dtype: Any = np.float32,
        action_shape: tuple[int, ...] = (),
        action_dtype: Any = np.int64,
        *,
        alpha: float = 0.6,
        beta0: float = 0.4,
        beta_steps: int = 100_000,
        eps: float = 1e-6,
        gamma: float = 0.99,
        n_step: int = 1,
        seed: int = 0,
        memory_fraction: float = 0.8,
    ) -> None:
        _check_settings(capacity, alpha, beta0, beta_steps, eps, gamma, n_step, memory_fraction)
        self.capacity = int(capacity)
        self.obs_shape, self.action_shape = tuple(obs_shape), tuple(action_shape)
        self.obs_dtype, self.action_dtype = np.dtype(obs_dtype), np.dtype(action_dtype)
        self.alpha, self.beta0, self.beta_steps, self.eps = float(alpha), float(beta0), int(beta_steps), float(eps)
        self.gamma, self.n_step = float(gamma), int(n_step)
        need = replay_nbytes(capacity, self.obs_shape, self.obs_dtype, self.action_shape, self.action_dtype)
        check_fits(capacity, need, memory_fraction)
        C = self.capacity
        self.obs = np.zeros((C, *self.obs_shape), dtype=self.obs_dtype)
        self.actions = np.zeros((C, *self.action_shape), dtype=self.action_dtype)
        self.returns = np.zeros(C, dtype=np.float32)
        self.discounts = np.zeros(C, dtype=np.float32)
        self.next_slot = np.zeros(C, dtype=np.int32)
        self.versions = np.full(C, -1, dtype=np.int32)
        self.tree = SumTree(C)
        self.rng = np.random.default_rng(seed)
        self.written = 0  # slots ever written: the next block's first id
        self.version_floor = 0
        self.max_priority = 1.0  # the paper's p_1
        self.samples = 0  # sample() calls: beta's clock
        self.stale_updates = 0
        self.dropped_by_version = 0
        self._live = 0  # transitions of positive priority

    # ------------------------------------------------------------------ accounting

    @property
    def nbytes(self) -> int:
        """Bytes allocated: every array and both trees, whatever the fill."""
        arrays = (self.obs, self.actions, self.returns, self.discounts, self.next_slot, self.versions)
        return sum(a.nbytes for a in arrays) + self.tree.nbytes

    @property
    def fill(self) -> float:
        """Share of the slots written at least once (1.0 from the first wrap on)."""
        return min(self.written, self.capacity) / self.capacity

    def __len__(self) -> int:
        """Transitions that can be drawn (positive priority)."""
        return self._live

    @property
    def beta(self) -> float:
        return self.beta0 + (1.0 - self.beta0) * min(1.0, self.samples / self.beta_steps)

    def version_counts(self) -> dict[int, int]:
        """Policy version -> transitions of it that can be drawn."""
        used = min(self.written, self.capacity)
        held = self.versions[:used][self.tree.leaves()[:used] > 0]
        values, counts = np.unique(held, return_counts=True)
        return dict(zip(values.tolist(), counts.tolist()))

    # ------------------------------------------------------------------ insert

    def insert(
        self,
        obs: np.ndarray,
        actions: np.ndarray,
        rewards: np.ndarray,
        terminated: np.ndarray,
        truncated: np.ndarray,
        next_obs: np.ndarray,
        version: int | np.ndarray,
        *,
        trunc_idx: np.ndarray | None = None,
        trunc_obs: np.ndarray | None = None,
        td_errors: np.ndarray | None = None,
    ) -> np.ndarray:
        """Add one time-major rollout (the actor's arrays, docs/protocol.md section 7); return its ids ``[T, N]``.

        ``trunc_idx`` (flat ``t * N + i``) and ``trunc_obs`` are the final observations of the episodes
        truncated (and not terminated) in it, all of them. ``version``: the policy version that acted, one
        number or ``[T, N]``. ``td_errors`` ``[T, N]``: the TD errors the actor computed (Ape-X's
        actor-side priorities), stored as ``(|delta| + eps)^alpha`` like ``update_priorities``; None
        gives every transition the largest priority seen so far.
        """
        arrays: dict[str, Any] = dict(
            obs=obs, actions=actions, rewards=rewards, terminated=terminated, truncated=truncated
        )
        arrays.update(next_obs=next_obs, trunc_idx=trunc_idx, trunc_obs=trunc_obs)
        return self.insert_arrays(arrays, version, td_errors)

    def insert_arrays(
        self, arrays: Mapping[str, Any], version: int | np.ndarray, td_errors: np.ndarray | None = None
    ) -> np.ndarray:
        """``insert`` of a rollout's arrays under their wire names (a ``Rollout``'s ``arrays``)."""
        r = checked_rollout(arrays, self.obs_shape, self.obs_dtype, self.action_shape, self.action_dtype)
        T, N = r.rewards.shape
        block = T * N + N + len(r.trunc_obs)
        if block > self.capacity:
            raise ValueError(f"a rollout of {block} slots ((T + 1) N + K) does not fit a capacity of {self.capacity}")
        versions = np.broadcast_to(np.asarray(version), (T, N)).astype(np.int32).reshape(-1)
        if versions.min() < 0:
            raise ValueError(f"policy versions must be >= 0, not {versions.min()}")
        priorities = self._initial_priorities(td_errors, (T, N))
        old = versions < self.version_floor
        priorities[old] = 0.0
        self.dropped_by_version += int(old.sum())
        self._write_block(r, versions, priorities)
        first = self.written
        self.written += block
        return first + np.arange(T * N, dtype=np.int64).reshape(T, N)

    def _write_block(self, r: CheckedRollout, versions: np.ndarray, priorities: np.ndarray) -> None:
        """Write the rollout's block from slot ``written % capacity`` on (block.py's layout)."""
        T, N = r.rewards.shape
        tail = N + len(r.trunc_obs)  # the observation-only slots
        ns = nstep_returns(r.rewards, r.terminated, r.truncated, self.gamma, self.n_step)
        offsets = next_offsets(ns.steps, r.terminated, r.truncated, r.trunc_pos).reshape(-1)
        start = self.written % self.capacity
        self._put(self.obs, start, r.obs.reshape(T * N, *self.obs_shape))
        self._put(self.obs, start + T * N, r.next_obs)
        self._put(self.obs, start + T * N + N, r.trunc_obs)
        self._put(self.actions, start, r.actions.reshape(T * N, *self.action_shape))
        self._put(self.actions, start + T * N, np.zeros((tail, *self.action_shape), self.action_dtype))
        zeros = np.zeros(tail, dtype=np.float32)
        self._put(self.returns, start, np.concatenate([ns.returns.reshape(-1), zeros]))
        self._put(self.discounts, start, np.concatenate([ns.discounts.reshape(-1), zeros]))
        self._put(self.versions, start, np.concatenate([versions, np.full(tail, -1, np.int32)]))
        nxt = np.concatenate([offsets, T * N + np.arange(tail)])  # observation-only slots point at themselves
        self._put(self.next_slot, start, (start + nxt) % self.capacity)
        self._set_priority_range(start, np.concatenate([priorities, np.zeros(tail)]))

    # ------------------------------------------------------------------ sample and update

    def sample(self, batch: int) -> TransitionBatch:
        """``batch`` transitions drawn with probability ``P(i)`` (stratified), with their importance weights."""
        if self._live == 0:
            raise ValueError("the replay buffer holds no transition to sample")
        if batch < 1:
            raise ValueError(f"batch must be >= 1, not {batch}")
        slots = self.tree.stratified(batch, self.rng)
        weights = (self.tree.get(slots) / self.tree.min) ** -self.beta
        self.samples += 1
        return self._gather(slots, weights)

    def get(self, ids: np.ndarray) -> TransitionBatch:
        """The transitions ``ids`` as ``sample`` returns them, with weights 1; ``ValueError`` if one is gone."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        slots = ids % self.capacity
        gone = ~self._held(ids, slots)
        if gone.any():
            raise ValueError(f"transitions {ids[gone][:8].tolist()} are not in the buffer (overwritten or retired)")
        return self._gather(slots, np.ones(ids.size))

    def _gather(self, slots: np.ndarray, weights: np.ndarray) -> TransitionBatch:
        nxt = self.next_slot[slots]
        return TransitionBatch(
            ids=self._ids_of(slots),
            weights=weights.astype(np.float32),
            obs=self.obs[slots],
            actions=self.actions[slots],
            returns=self.returns[slots],
            discounts=self.discounts[slots],
            next_obs=self.obs[nxt],
            versions=self.versions[slots],
        )

    def update_priorities(self, ids: np.ndarray, td_errors: np.ndarray) -> int:
        """Set ``p = (|delta| + eps)^alpha`` for the transitions ``ids``; return how many were still there.

        Ids overwritten since they were sampled, or retired by version, are skipped and counted in
        ``stale_updates``. An id given twice keeps one of its values.
        """
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        td = np.asarray(td_errors, dtype=np.float64).reshape(-1)
        if ids.shape != td.shape:
            raise ValueError(f"{ids.size} ids and {td.size} TD errors")
        if ids.size and (ids.min() < 0 or ids.max() >= self.written):
            raise ValueError(f"ids must lie in 0..{self.written - 1} (ids of transitions this buffer gave out)")
        if not np.all(np.isfinite(td)):
            raise ValueError("TD errors must be finite")
        slots = ids % self.capacity
        keep = self._held(ids, slots)
        self.stale_updates += int(ids.size - keep.sum())
        priorities = self._priorities(td[keep])
        if priorities.size:
            self.max_priority = max(self.max_priority, float(priorities.max()))
            self._set_priorities(slots[keep], priorities)
        return int(keep.sum())

    def td_cap(self) -> float:
        """The TD error whose priority is the largest seen so far: the most a transition may be given."""
        return max(self.max_priority ** (1.0 / self.alpha) - self.eps, 0.0) if self.alpha else math.inf

    def capped_td(self, td_errors: np.ndarray) -> np.ndarray:
        """Actor-side TD errors as initial priorities: a number off the wire buys no more replay than the largest
        priority seen (Ape-X's actors compute them with their copy of the network)."""
        return np.minimum(np.abs(td_errors), self.td_cap())

    def drop_older_than(self, version: int) -> int:
        """Retire every transition of a policy version below ``version`` and keep retiring them; return how many."""
        self.version_floor = max(self.version_floor, int(version))
        used = min(self.written, self.capacity)
        v = self.versions[:used]
        slots = np.flatnonzero((v >= 0) & (v < self.version_floor) & (self.tree.leaves()[:used] > 0))
        self._set_priorities(slots, np.zeros(slots.size))
        self.dropped_by_version += slots.size
        return int(slots.size)

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """The buffer as numpy arrays and plain values (module docstring, "Checkpoints")."""
        used = min(self.written, self.capacity)
        state: dict[str, Any] = {"layout": self.layout()}
        state.update({k: getattr(self, k) for k in _SCALARS})
        state["rng"] = self.rng.bit_generator.state
        state.update({k: getattr(self, k)[:used] for k in ("obs", *_DATA)})
        state["priorities"] = self.tree.leaves()[:used]
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take back what ``state_dict`` gave (numpy arrays or CPU tensors); a buffer of another layout is refused."""
        if dict(state["layout"]) != self.layout():
            raise ValueError(f"the checkpoint's replay buffer is {dict(state['layout'])}, this one {self.layout()}")
        written = int(state["written"])
        used = min(written, self.capacity)
        arrays = {k: np.asarray(state[k]) for k in ("obs", *_DATA, "priorities")}
        for name, a in arrays.items():
            want = self.tree.sums if name == "priorities" else getattr(self, name)
            if a.shape[0] != used or a.shape[1:] != want.shape[1:] or a.dtype != want.dtype:
                raise ValueError(f"the checkpoint's replay {name} is {a.dtype}{list(a.shape)}, expected {used} rows")
        for name in ("obs", *_DATA):
            getattr(self, name)[:used] = arrays[name]
        self.versions[used:] = -1
        self.tree.assign(arrays["priorities"])
        self._live = int(np.count_nonzero(arrays["priorities"] > 0))
        for k in _SCALARS:
            setattr(self, k, type(getattr(self, k))(state[k]))
        self.rng.bit_generator.state = state["rng"]

    # ------------------------------------------------------------------ internals

    def layout(self) -> dict[str, Any]:
        """What the stored data depends on: a checkpoint loads only into a buffer that agrees on all of it."""
        return {
            "capacity": self.capacity,
            "obs_shape": list(self.obs_shape),
            "obs_dtype": self.obs_dtype.str,
            "action_shape": list(self.action_shape),
            "action_dtype": self.action_dtype.str,
            "alpha": self.alpha,
            "gamma": self.gamma,
            "n_step": self.n_step,
        }

    def _put(self, array: np.ndarray, start: int, values: np.ndarray) -> None:
        """Write ``values`` into the ring ``array`` from slot ``start`` on, as two slices where it wraps."""
        start %= self.capacity
        first = min(len(values), self.capacity - start)
        array[start : start + first] = values[:first]
        if first < len(values):
            array[: len(values) - first] = values[first:]

    def _priorities(self, td_errors: np.ndarray) -> np.ndarray:
        return (np.abs(td_errors) + self.eps) ** self.alpha

    def _initial_priorities(self, td_errors: np.ndarray | None, shape: tuple[int, int]) -> np.ndarray:
        if td_errors is None:
            return np.full(shape[0] * shape[1], self.max_priority)
        td = np.asarray(td_errors, dtype=np.float64)
        if td.shape != shape or not np.all(np.isfinite(td)):
            raise ValueError(f"td_errors must be finite numbers of shape {list(shape)}, not {list(td.shape)}")
        priorities = self._priorities(td.reshape(-1))
        self.max_priority = max(self.max_priority, float(priorities.max(initial=0.0)))
        return priorities

    def _set_priorities(self, slots: np.ndarray, priorities: np.ndarray) -> None:
        old = self.tree.get(slots)
        self._live += int(np.count_nonzero(priorities > 0)) - int(np.count_nonzero(old > 0))
        self.tree.set(slots, priorities)

    def _held(self, ids: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """Which ids are transitions the buffer still holds: written, not overwritten, not retired by version."""
        written = (ids >= 0) & (ids < self.written) & (ids >= self.written - self.capacity)
        return written & (self.versions[slots] >= max(self.version_floor, 0))

    def _set_priority_range(self, start: int, priorities: np.ndarray) -> None:
        """``_set_priorities`` of the ring slots from ``start`` on: at most two contiguous runs, set by slices."""
        first = min(len(priorities), self.capacity - start)
        for begin, p in ((start, priorities[:first]), (0, priorities[first:])):
            if p.size:
                old = self.tree.sums[self.tree.size + begin : self.tree.size + begin + p.size]
                self._live += int(np.count_nonzero(p > 0)) - int(np.count_nonzero(old > 0))
                self.tree.set_range(begin, p)

    def _ids_of(self, slots: np.ndarray) -> np.ndarray:
        """The id of the transition each slot holds now: its last write before ``written``."""
        slots = slots.astype(np.int64)
        return slots + self.capacity * ((self.written - 1 - slots) // self.capacity)


_SCALARS = ("written", "version_floor", "max_priority", "samples", "stale_updates", "dropped_by_version")


def _check_settings(
    capacity: int, alpha: float, beta0: float, beta_steps: int, eps: float, gamma: float, n_step: int, fraction: float
) -> None:
    if not 1 <= capacity < 2**31:
        raise ValueError(f"replay capacity must lie in 1..2^31 - 1 (int32 slots), not {capacity}")
    if alpha < 0 or not 0 <= beta0 <= 1 or beta_steps < 1:
        raise ValueError(f"need alpha >= 0, 0 <= beta0 <= 1, beta_steps >= 1: got {alpha}, {beta0}, {beta_steps}")
    if not eps > 0:
        raise ValueError(f"eps must be > 0: a transition of priority 0 is never drawn again to correct it ({eps})")
    if not 0 <= gamma <= 1 or n_step < 1:
        raise ValueError(f"need 0 <= gamma <= 1 and n_step >= 1: got {gamma}, {n_step}")
    if not 0 < fraction <= 1:
        raise ValueError(f"memory_fraction must lie in (0, 1], not {fraction}")
