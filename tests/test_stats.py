"""Paired bootstrap intervals: they find a known difference, and say so only when the interval excludes 0."""

import numpy as np
import pandas as pd
import pytest

from harp_src.eval.stats import decided, mean_ci, paired_difference, paired_table


def test_paired_interval_finds_a_known_difference():
    """1,000 items, accuracy 0.6 vs 0.5: the interval contains 0.1 and excludes 0."""
    rng = np.random.default_rng(0)
    a, b = np.zeros(1000), np.zeros(1000)
    a[rng.choice(1000, 600, replace=False)] = 1
    b[rng.choice(1000, 500, replace=False)] = 1
    r = paired_difference(a, b, seed=3)
    assert r["diff"] == pytest.approx(0.1) and r["ci_low"] < 0.1 < r["ci_high"] and r["ci_low"] > 0
    assert r["decided"] and r["n"] == 1000 and r["seed"] == 3
    assert paired_difference(a, b, seed=3) == r  # seeded: the same bounds again


def test_no_difference_is_not_decided():
    a = np.r_[np.ones(10), np.zeros(10), np.random.default_rng(1).integers(0, 2, 180)]
    b = a.copy()
    b[:20] = 1 - b[:20]  # 10 items lost, 10 gained: the mean difference is exactly 0, with spread
    r = paired_difference(a, b, seed=0)
    assert r["diff"] == 0 and r["ci_low"] < 0 < r["ci_high"] and not r["decided"]
    assert not decided(-0.01, 0.02) and decided(0.001, 0.2) and decided(-0.3, -0.1)
    assert mean_ci([2.0, 2.0, 2.0]) == (2.0, 2.0, 2.0)  # no spread, no interval


def test_bad_input():
    with pytest.raises(ValueError, match="same items"):
        paired_difference([1, 0], [1, 0, 1])
    with pytest.raises(ValueError, match="non-empty"):
        mean_ci([])


def test_paired_table_pairs_items_by_id():
    items = pd.DataFrame({"method": ["dense"] * 4 + ["harp"] * 3, "task": ["t"] * 7,
                          "doc_id": [0, 1, 2, 3, 3, 1, 0], "correct": [1, 1, 0, 0, 1, 0, 1]})
    table = paired_table(items, "dense", ["task"])
    row = table.iloc[0]
    assert (row.method, row.n) == ("harp", 3)  # doc 2 was not scored by harp: left out of the pairing
    assert row["diff"] == pytest.approx(((1 - 0) + (0 - 1) + (1 - 1)) / 3)
