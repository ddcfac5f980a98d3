"""zddrl.algos.replay_buffer.sumtree: proportional sampling against the intended distribution and a slow prefix-sum
search."""

from __future__ import annotations

import math

import numpy as np
import pytest

from zddrl.algos.replay_buffer.sumtree import SumTree

Z_1E6 = 4.753
"""The standard normal's upper 1e-6 quantile: a chi-square beyond it is a one-in-a-million fluke."""


def chi2_upper(dof: int, z: float = Z_1E6) -> float:
    """The chi-square quantile at ``z`` (Wilson-Hilferty: accurate to a fraction of a percent at these dofs)."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def chi2(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    expected = counts.sum() * probs
    return float(((counts - expected) ** 2 / expected).sum()), len(counts) - 1


def slow_find(priorities: list[float], prefix: float) -> int:
    """The leaf under ``prefix``: walk the cumulative sum (skipping leaves of priority 0)."""
    acc = 0.0
    for i, p in enumerate(priorities):
        acc += p
        if p > 0 and prefix < acc:
            return i
    return max(i for i, p in enumerate(priorities) if p > 0)


def tree_with(priorities: np.ndarray) -> SumTree:
    tree = SumTree(len(priorities))
    tree.set(np.arange(len(priorities)), priorities)
    return tree


def test_sampling_matches_the_priorities() -> None:
    rng = np.random.default_rng(1234)
    priorities = rng.uniform(0.2, 3.0, 1000)
    priorities[rng.choice(1000, 100, replace=False)] = 0.0  # empty slots: never drawn
    tree = tree_with(priorities)
    counts = np.zeros(1000)
    for _ in range(1000):
        np.add.at(counts, tree.stratified(256, rng), 1)
    assert counts[priorities == 0].sum() == 0
    live = priorities > 0
    stat, dof = chi2(counts[live], priorities[live] / priorities.sum())
    limit = chi2_upper(dof)
    assert stat < 0.8 * limit, f"chi-square {stat:.0f} with {dof} dof (limit {limit:.0f})"
    # the same test tells a wrong distribution apart: uniform over the live leaves fails it by far
    stat_uniform, _ = chi2(counts[live], np.full(live.sum(), 1 / live.sum()))
    assert stat_uniform > 10 * limit


def test_stratified_batch_has_one_draw_per_segment() -> None:
    tree = tree_with(np.ones(8))
    for seed in range(20):
        assert sorted(tree.stratified(8, np.random.default_rng(seed)).tolist()) == list(range(8))


def test_find_against_a_slow_prefix_search() -> None:
    rng = np.random.default_rng(7)
    for capacity in (1, 2, 3, 5, 64, 100, 257):
        priorities = rng.exponential(1.0, capacity) * (rng.random(capacity) > 0.3)
        priorities[rng.integers(capacity)] = 0.5  # at least one positive leaf
        tree = tree_with(priorities)
        assert tree.total == pytest.approx(priorities.sum(), rel=1e-12)
        assert tree.min == pytest.approx(priorities[priorities > 0].min(), rel=1e-6)
        prefixes = np.concatenate([rng.uniform(0, tree.total, 200), [0.0, np.nextafter(tree.total, 0)]])
        expected = [slow_find(priorities.tolist(), u) for u in prefixes]
        assert tree.find(prefixes).tolist() == expected


def test_rounding_never_lands_on_an_empty_leaf() -> None:
    # huge next to tiny priorities, empty leaves after them: the prefixes at the top edge must stay on the tiny leaf
    priorities = np.array([1e12, 1e-9, 0.0, 0.0, 3e-12, 0.0, 0.0, 0.0])
    tree = tree_with(priorities)
    edge = np.nextafter(tree.total, 0.0) - np.arange(4) * 1e-4
    found = tree.find(np.concatenate([edge, [tree.total * 2]]))  # even past the total
    assert np.all(priorities[found] > 0)


def test_updates_with_repeated_indices_keep_both_trees_consistent() -> None:
    rng = np.random.default_rng(3)
    tree = tree_with(np.ones(100))
    reference = np.ones(100)
    for _ in range(50):
        idx = rng.integers(0, 100, 64)  # repeats, as a batch drawn with replacement has
        values = rng.exponential(1.0, 64) * (rng.random(64) > 0.1)
        tree.set(idx, values)
        reference[idx] = values  # numpy's fancy assignment keeps one of the values; the tree keeps the same
        assert np.array_equal(tree.leaves(), reference)
        assert tree.total == pytest.approx(reference.sum(), rel=1e-12)
        assert tree.min == pytest.approx(reference[reference > 0].min(), rel=1e-6)
    rebuilt = SumTree(100)
    rebuilt.assign(reference)
    assert np.array_equal(rebuilt.sums, tree.sums) and np.array_equal(rebuilt.mins, tree.mins)


def test_empty_tree_and_bad_priorities_are_refused() -> None:
    tree = SumTree(10)
    assert tree.min == math.inf
    with pytest.raises(ValueError, match="nothing to sample"):
        tree.stratified(4, np.random.default_rng(0))
    with pytest.raises(ValueError, match="finite"):
        tree.set([1], [math.nan])
    with pytest.raises(ValueError, match=">= 0"):
        tree.set([1], [-1.0])
    with pytest.raises(ValueError, match="0..9"):
        tree.set([10], [1.0])
    assert SumTree.nbytes_for(10) == tree.nbytes == 2 * 16 * 12


def test_set_range_is_set_of_a_contiguous_run() -> None:
    rng = np.random.default_rng(9)
    by_range, by_index = SumTree(300), SumTree(300)
    for _ in range(100):
        start = int(rng.integers(0, 300))
        values = rng.exponential(1.0, int(rng.integers(0, 301 - start))) * (rng.random() > 0.2)
        by_range.set_range(start, values)
        by_index.set(start + np.arange(values.size), values)
        assert np.array_equal(by_range.sums, by_index.sums) and np.array_equal(by_range.mins, by_index.mins)
    with pytest.raises(ValueError, match="not all in 0..299"):
        by_range.set_range(299, [1.0, 1.0])
