"""Confidence intervals for comparisons on the same items: bootstrap intervals of a mean and of a paired difference.

A difference between two methods is called only when its interval excludes 0 (`decided`). Intervals are
percentile bootstraps from scipy.stats.bootstrap with a seeded generator, so a rerun gives the same bounds.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from scipy import stats

CONFIDENCE = 0.95
N_RESAMPLES = 9999


def mean_ci(values, seed: int = 0, confidence: float = CONFIDENCE, n_resamples: int = N_RESAMPLES
            ) -> tuple[float, float, float]:
    """(mean, low, high): the mean of `values` and its bootstrap confidence interval.

    Args:
        values: one number per independent unit (item, window), at least one.
        seed: seeds the resampling.
    """
    x = np.asarray(values, dtype=float)
    if x.ndim != 1 or len(x) == 0 or not np.isfinite(x).all():
        raise ValueError("mean_ci needs a non-empty 1-D array of finite numbers")
    mean = float(x.mean())
    if len(x) == 1 or np.ptp(x) == 0:  # no spread: the interval is the point (scipy would return NaN)
        return mean, mean, mean
    res = stats.bootstrap((x,), np.mean, confidence_level=confidence, n_resamples=n_resamples, method="percentile",
                          rng=np.random.default_rng(seed))
    return mean, float(res.confidence_interval.low), float(res.confidence_interval.high)


def _mean_of_means(*samples, axis=-1):
    return np.mean([x.mean(axis=axis) for x in samples], axis=0)


def mean_of_means_ci(samples: list, seed: int = 0, confidence: float = CONFIDENCE, n_resamples: int = N_RESAMPLES
                     ) -> tuple[float, float, float]:
    """(value, low, high) for the unweighted mean of several groups' means (e.g. a task average), each group resampled
    on its own (a stratified bootstrap), so every group keeps its size and weight."""
    xs = [np.asarray(x, dtype=float) for x in samples]
    if not xs or any(x.ndim != 1 or len(x) == 0 for x in xs):
        raise ValueError("mean_of_means_ci needs one non-empty 1-D array per group")
    value = float(_mean_of_means(*xs))
    if all(len(x) == 1 or np.ptp(x) == 0 for x in xs):
        return value, value, value
    res = stats.bootstrap(tuple(xs), _mean_of_means, confidence_level=confidence, n_resamples=n_resamples,
                          method="percentile", rng=np.random.default_rng(seed))
    return value, float(res.confidence_interval.low), float(res.confidence_interval.high)


def paired_difference(a, b, seed: int = 0, confidence: float = CONFIDENCE, n_resamples: int = N_RESAMPLES) -> dict:
    """mean(a − b) over paired items with a bootstrap interval (the items are resampled, each keeping its pair).

    Args:
        a, b: per-item scores of two methods on the same items, in the same order.
    Returns:
        dict: diff, ci_low, ci_high, n, decided (the interval excludes 0), confidence, seed.
    """
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if a.shape != b.shape:
        raise ValueError(f"paired scores need the same items: got {a.shape} and {b.shape}")
    diff, low, high = mean_ci(a - b, seed, confidence, n_resamples)
    return {"diff": diff, "ci_low": low, "ci_high": high, "n": len(a), "decided": decided(low, high),
            "confidence": confidence, "seed": seed}


def decided(low: float, high: float) -> bool:
    """True when an interval lies entirely on one side of 0."""
    return bool(low > 0 or high < 0)


def aligned(reference: pd.Series, other: pd.Series) -> tuple[np.ndarray, np.ndarray]:
    """The values of two per-item Series (indexed by item id) on the items both have, in one order."""
    common = reference.index.intersection(other.index)
    return other[common].to_numpy(dtype=float), reference[common].to_numpy(dtype=float)


def paired_table(items: pd.DataFrame, reference: str, by: list[str], unit: str = "doc_id", value: str = "correct",
                 seed: int = 0) -> pd.DataFrame:
    """Each method's paired difference from `reference` on the items both scored, per group of `by` columns.

    Args:
        items: one row per method and item: `method`, the `by` columns, `unit` (the item id) and `value`.
        reference: the method every other is compared with (e.g. "dense").
    Returns:
        DataFrame: the `by` columns, method, reference, diff, ci_low, ci_high, n, decided, confidence, seed.
    """
    rows = []
    for key, part in items.groupby(by, sort=False):
        key = key if isinstance(key, tuple) else (key,)
        ref = part[part.method == reference].set_index(unit)[value]
        for method, other in part[part.method != reference].groupby("method", sort=False):
            a, b = aligned(ref, other.set_index(unit)[value])
            if len(a):
                rows.append({**dict(zip(by, key, strict=True)), "method": method, "reference": reference,
                             **paired_difference(a, b, seed)})
    return pd.DataFrame(rows)
