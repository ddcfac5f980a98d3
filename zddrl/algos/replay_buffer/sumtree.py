"""A sum-tree and a min-tree over priorities, for proportional prioritized sampling.

Schaul, Quan, Antonoglou, Silver, "Prioritized Experience Replay", ICLR 2016 (arXiv:1511.05952),
section 3.3 and appendix B.2.1: transition ``i`` is drawn with probability ``P(i) = p_i / sum_k p_k``;
a binary tree whose every node holds the sum of its children finds the leaf under a prefix sum in
``log2(capacity)`` steps, and a batch of ``B`` is drawn stratified: the total is cut into ``B`` equal
segments and one prefix sum is drawn uniformly inside each. The min over the priorities gives the
largest importance weight, by which the paper normalises all of them.

Layout (the usual heap order): ``2 * size`` nodes, the root at 1, the children of node ``k`` at
``2k`` and ``2k + 1``, leaf ``i`` at ``size + i``, ``size`` the capacity rounded up to a power of two
(padding leaves hold 0). Every operation is numpy over a whole batch; the only Python loop runs over
the tree's levels.

* Sums are float64: with 10^6 leaves a float32 root would lose the smallest priorities' share in
  rounding. Each parent is recomputed from its two children (never by adding a delta), so rounding
  never accumulates across updates.
* Mins are float32 (they only scale the weights; 8 bytes a leaf fewer); a leaf of priority 0 (an
  empty or retired slot) holds +inf there, so the min is over the sampleable leaves only.
"""

from __future__ import annotations

import numpy as np

__all__ = ["SumTree"]


class SumTree:
    """Priorities of ``capacity`` leaves with their sum and min at the root.

    Leaves of priority 0 are never sampled. ``set`` with an index given twice keeps one of its
    values (numpy's fancy assignment); both trees keep the same one.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a sum-tree needs capacity >= 1, not {capacity}")
        self.capacity = int(capacity)
        self.size = 1 << (self.capacity - 1).bit_length()
        self.depth = self.size.bit_length() - 1
        self.sums = np.zeros(2 * self.size, dtype=np.float64)
        self.mins = np.full(2 * self.size, np.inf, dtype=np.float32)

    @staticmethod
    def nbytes_for(capacity: int) -> int:
        """Bytes both trees take for ``capacity`` leaves (allocated, whatever the fill)."""
        size = 1 << (int(capacity) - 1).bit_length()
        return 2 * size * (8 + 4)

    @property
    def nbytes(self) -> int:
        return self.sums.nbytes + self.mins.nbytes

    @property
    def total(self) -> float:
        return float(self.sums[1])

    @property
    def min(self) -> float:
        """The smallest positive priority; +inf when no leaf is sampleable."""
        return float(self.mins[1])

    def get(self, index: np.ndarray) -> np.ndarray:
        """The priorities of leaves ``index`` (a copy)."""
        return self.sums[self.size + np.asarray(index)]

    def leaves(self) -> np.ndarray:
        """All ``capacity`` priorities (a view)."""
        return self.sums[self.size : self.size + self.capacity]

    def set(self, index: np.ndarray, priorities: np.ndarray) -> None:
        """Set leaves ``index`` to ``priorities`` (finite, >= 0) and recompute their ancestors."""
        index = np.asarray(index, dtype=np.int64).reshape(-1)
        p = np.broadcast_to(np.asarray(priorities, dtype=np.float64), index.shape)
        if index.size == 0:
            return
        if not np.all(np.isfinite(p)) or p.min() < 0:
            raise ValueError("priorities must be finite and >= 0")
        if index.min() < 0 or index.max() >= self.capacity:
            raise ValueError(f"leaf indices must lie in 0..{self.capacity - 1}")
        node = index + self.size
        self.sums[node] = p
        self.mins[node] = np.where(p > 0, p, np.inf)
        for _ in range(self.depth):
            # Siblings share a parent: it appears more than once, and each copy is assigned the same value (both
            # children were set at the level below), so no dedupe is needed (measured: ~40 % less time at B = 64).
            node >>= 1
            left = node << 1
            self.sums[node] = self.sums[left] + self.sums[left + 1]
            self.mins[node] = np.minimum(self.mins[left], self.mins[left + 1])

    def set_range(self, start: int, priorities: np.ndarray) -> None:
        """``set`` of the leaves ``start, start + 1, ...`` (no wrap): each level is one slice, no fancy indexing."""
        p = np.asarray(priorities, dtype=np.float64).reshape(-1)
        if p.size == 0:
            return
        if not np.all(np.isfinite(p)) or p.min() < 0:
            raise ValueError("priorities must be finite and >= 0")
        if start < 0 or start + p.size > self.capacity:
            raise ValueError(f"leaves {start}..{start + p.size - 1} are not all in 0..{self.capacity - 1}")
        lo, hi = self.size + start, self.size + start + p.size  # nodes [lo, hi) of the current level
        self.sums[lo:hi] = p
        self.mins[lo:hi] = np.where(p > 0, p, np.inf)
        for _ in range(self.depth):
            lo, hi = lo >> 1, ((hi - 1) >> 1) + 1
            self.sums[lo:hi] = self.sums[2 * lo : 2 * hi : 2] + self.sums[2 * lo + 1 : 2 * hi : 2]
            self.mins[lo:hi] = np.minimum(self.mins[2 * lo : 2 * hi : 2], self.mins[2 * lo + 1 : 2 * hi : 2])

    def assign(self, priorities: np.ndarray) -> None:
        """Set the first ``len(priorities)`` leaves, clear the others, and rebuild the tree (a checkpoint's load)."""
        p = np.asarray(priorities, dtype=np.float64).reshape(-1)
        if p.size > self.capacity or not np.all(np.isfinite(p)) or (p.size and p.min() < 0):
            raise ValueError(f"at most {self.capacity} finite priorities >= 0")
        leaves = slice(self.size, 2 * self.size)
        self.sums[leaves] = 0.0
        self.sums[self.size : self.size + p.size] = p
        self.mins[leaves] = np.where(self.sums[leaves] > 0, self.sums[leaves], np.inf)
        self.rebuild()

    def rebuild(self) -> None:
        """Recompute every inner node from the leaves (after many leaves changed at once)."""
        lo = self.size >> 1
        while lo >= 1:
            self.sums[lo : 2 * lo] = self.sums[2 * lo : 4 * lo : 2] + self.sums[2 * lo + 1 : 4 * lo : 2]
            self.mins[lo : 2 * lo] = np.minimum(self.mins[2 * lo : 4 * lo : 2], self.mins[2 * lo + 1 : 4 * lo : 2])
            lo >>= 1

    def find(self, prefix: np.ndarray) -> np.ndarray:
        """The leaf ``i`` with ``sum(p[:i]) <= prefix < sum(p[:i + 1])`` for each prefix in ``[0, total)``.

        Rounding can leave a prefix at or past the sum of the subtree it reached; the descent then
        never enters a child of sum 0, so it always ends on a leaf of positive priority.
        """
        if not self.total > 0:
            raise ValueError("no leaf has a positive priority: nothing to sample")
        u = np.asarray(prefix, dtype=np.float64).copy()
        node = np.ones(u.shape, dtype=np.int64)
        for _ in range(self.depth):
            left = node << 1
            ls, rs = self.sums[left], self.sums[left + 1]
            right = ((u >= ls) & (rs > 0)) | (ls <= 0)
            u = np.where(right, u - ls, u)
            node = left + right
        return node - self.size

    def stratified(self, batch: int, rng: np.random.Generator) -> np.ndarray:
        """``batch`` leaves drawn proportionally to priority, one from each of ``batch`` equal segments of the total."""
        total = self.total
        if not total > 0:
            raise ValueError("no leaf has a positive priority: nothing to sample")
        u = (np.arange(batch) + rng.random(batch)) * (total / batch)
        return self.find(np.minimum(u, np.nextafter(total, 0.0)))
