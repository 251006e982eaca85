"""Choosing α per pruned layer: the paper's greedy top-down search, its cached form, and search-free options.

Greedy (paper): start at the topmost layer of the set, try every α of the grid with that layer bypassed, keep the
α with the lowest calibration perplexity (ties go to the smaller α), freeze it, move one layer down. Layers
below the one being searched stay dense, so the hidden states entering it do not depend on the candidate: with
`cache_prefix=True` they are computed once and each candidate runs only that layer, the layers above it, the
final norm and the LM head. `cache_prefix=False` re-runs the whole model per candidate (the reference).

The α of a layer depends only on the layers searched before it (those above it, top-down) and their α's, which
in turn depend only on those layers: searches of two layer sets that start with the same top layers choose the
same α's for them. A `memo` dict shared between searches on one model and one calibration set reuses them (the
N sweep of top-N is one search of the deepest N; another selection that shares its top layers skips them).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from ..eval.perplexity import check_windows, nll_sum
from ..eval.smoothing import layer_metrics
from ..model.adapter import get_adapter
from .harp import check_bypass, check_keep_for, check_kv_kept, harp_applied
from .layers import check_layers
from .prefix import Boundaries

GRID = tuple(round(0.1 * k, 1) for k in range(11))  # 0.0, 0.1, ..., 1.0 (paper)


def _check_grid(grid: Sequence[float]) -> tuple[float, ...]:
    grid = tuple(float(a) for a in grid)
    if not grid:
        raise ValueError("the α grid is empty; use e.g. (0.0, 0.1, ..., 1.0)")
    bad = [a for a in grid if not (math.isfinite(a) and 0.0 <= a <= 1.0)]
    if bad:
        raise ValueError(f"α grid values {bad} are outside [0, 1]")
    return tuple(sorted(set(grid)))  # ascending, so the first minimum found is the smaller α


def check_search(model, calib: torch.Tensor, layers, grid) -> tuple[list[int], tuple[float, ...]]:
    """Checked inputs: the layers top-down and the grid ascending."""
    check_windows(model, calib)
    layers = check_layers(get_adapter(model), layers)
    if not layers:
        raise ValueError("no layers to search")
    return sorted(layers, reverse=True), _check_grid(grid)


def candidate_ppl(model, calib: torch.Tensor, bounds: Boundaries | None, layer: int, alpha: float,
                  batch_size: int = 4, *, bypass: str = "identity", keep_heads: dict | None = None) -> float:
    """Calibration perplexity with `layer` bypassed at `alpha` (keeping its `keep_heads`, if any) on top of
    whatever the model already has pruned: from the cached boundary when `bounds` is given (only `layer` and those
    above it run), else the whole model (the naive reference)."""
    with harp_applied(model, [layer], {layer: alpha}, bypass=bypass, keep_heads=keep_heads):
        nll, count = bounds.nll_from(layer) if bounds else nll_sum(model, calib, batch_size, progress=False)
    return math.exp(nll / count)


def candidate_window_nll(bounds: Boundaries, layer: int, alpha: float, bypass: str = "identity", *,
                         keep_heads: dict | None = None) -> torch.Tensor:
    """Summed NLL per calibration window [n_windows] with `layer` bypassed at `alpha` (cached boundary)."""
    with harp_applied(bounds.model, [layer], {layer: alpha}, bypass=bypass, keep_heads=keep_heads):
        return bounds.window_nll_from(layer)


def pick(grid: tuple[float, ...], scores: list[float]) -> float:
    """The grid value with the lowest score; ties go to the smaller α."""
    return grid[min(range(len(grid)), key=lambda k: (scores[k], grid[k]))]


def _layer_scores(model, calib: torch.Tensor, bounds: Boundaries | None, layer: int, grid: tuple[float, ...], *,
                  bar, batch_size: int, bypass: str, keep_heads: dict) -> tuple[list[float], np.ndarray | None]:
    """Calibration perplexity of every α of the grid at `layer` (the layers above already pruned): cached from
    `bounds` with per-window NLLs [len(grid), n_windows], or naive (None for the per-window NLLs)."""
    scores, per_window = [], []
    for alpha in grid:
        bar.set_postfix(layer=layer, alpha=alpha)
        if bounds is not None:
            per_window.append(candidate_window_nll(bounds, layer, alpha, bypass, keep_heads=keep_heads))
            scores.append(math.exp(float(per_window[-1].sum()) / (len(calib) * bounds.n_predicted)))
        else:
            scores.append(candidate_ppl(model, calib, None, layer, alpha, batch_size, bypass=bypass,
                                        keep_heads=keep_heads))
        bar.update()
    return scores, torch.stack(per_window).numpy() if per_window else None


def search_alphas(
    model,
    calib: torch.Tensor,
    layers: Iterable[int] | str,
    grid: Sequence[float] = GRID,
    *,
    cache_prefix: bool = True,
    batch_size: int = 4,
    history: list | None = None,
    memo: dict | None = None,
    window_nll: dict | None = None,
    bypass: str = "identity",
    keep_heads: dict[int, list[int]] | None = None,
) -> dict[int, float]:
    """Greedy top-down α search minimising calibration perplexity; the model is left unchanged.

    Args:
        model: a dense model (layers not yet pruned).
        calib: calibration windows [n, T] (enwiki *train* split; evaluation uses test).
        layers: the layers to prune (0-based, or "top:N").
        grid: candidate α values in [0, 1]; ties go to the smaller α.
        cache_prefix: reuse the hidden states entering the searched layer (identical result, faster).
        history: if a list is given, one dict per candidate is appended (layer, alpha, calib_ppl, chosen).
        memo: a dict reused across calls on the same model and calibration windows; a layer whose searched-before
            layers (and hence α's) match an earlier search is not searched again. Identical α's by construction.
        window_nll: if a dict is given, {layer: array [len(grid), n_windows]} of every candidate's summed NLL per
            calibration window (grid ascending), for `resample_search`; needs cache_prefix.
        bypass: the bypass searched for: "identity" (HARP) or "mean" (the causal-mean extension).
        keep_heads: {layer: [query head, ...]} the searched layers keep (`apply_harp`); α scales the others only.
    Returns:
        {layer: α}
    """
    if window_nll is not None and not cache_prefix:
        raise ValueError("per-window NLLs are recorded by the cached search: use cache_prefix=True")
    order, grid = check_search(model, calib, layers, grid)
    keep = check_keep_for(get_adapter(model), order, keep_heads)
    check_kv_kept(get_adapter(model), order, check_bypass(bypass), keep)  # refused now, not after the search
    memo = {} if memo is None else memo
    bounds = None
    chosen: dict[int, float] = {}
    bar = tqdm(total=len(order) * len(grid), desc="α search")
    for depth, layer in enumerate(order):
        key = (tuple(order[: depth + 1]), grid, batch_size, cache_prefix, bypass, repr(keep))  # keep: all layers'
        if key in memo:
            bar.update(len(grid))
        else:
            if cache_prefix and bounds is None:
                bounds = Boundaries(model, calib, batch_size)
            with harp_applied(model, list(chosen), chosen, bypass=bypass, keep_heads=keep):  # the layers above
                memo[key] = _layer_scores(model, calib, bounds if cache_prefix else None, layer, grid, bar=bar,
                                          batch_size=batch_size, bypass=bypass, keep_heads=keep)
        scores, per_window = memo[key]
        chosen[layer] = pick(grid, scores)
        if window_nll is not None:
            window_nll[layer] = per_window
        if history is not None:
            history += [dict(layer=layer, alpha=a, calib_ppl=s, chosen=a == chosen[layer])
                        for a, s in zip(grid, scores, strict=True)]
    bar.close()
    return dict(sorted(chosen.items()))


def bootstrap_counts(n_windows: int, n_draw: int, n_boot: int, seed: int = 0) -> np.ndarray:
    """[n_boot, n_windows] counts: how often each of `n_windows` recorded windows is drawn in each of `n_boot`
    resamples of `n_draw` windows with replacement (`n_draw` < `n_windows` is the m-out-of-n bootstrap, which
    mimics a smaller calibration set)."""
    if min(n_windows, n_draw, n_boot) < 1:
        raise ValueError(f"need n_windows, n_draw and n_boot >= 1, got {n_windows}, {n_draw}, {n_boot}")
    return np.random.default_rng(seed).multinomial(n_draw, np.full(n_windows, 1.0 / n_windows), size=n_boot)


def resample_search(window_nll: dict[int, np.ndarray], counts: np.ndarray, grid: Sequence[float] = GRID
                    ) -> pd.DataFrame:
    """The greedy picks of a recorded search (`search_alphas(..., window_nll=...)`) re-made on reweighted
    calibration windows: in each resample (a row of `counts`) every layer, top-down, takes the grid α with the
    lowest count-weighted NLL (ties to the smaller α). No model runs, so thousands of resamples cost nothing.

    One approximation: a layer's candidates were evaluated with the layers above at the recorded search's α's, so
    a resample that picks differently above would have seen slightly different curves below. Check it against
    real searches on fresh samples before trusting it (notebook 03 does).

    Args:
        window_nll: {layer: [len(grid), n_windows] summed NLL per window} from the search.
        counts: [n_resamples, n_windows] non-negative weights per window, e.g. `bootstrap_counts`.
        grid: the search's grid (sorted ascending as the search sorts it).
    Returns:
        DataFrame: replicate (row of counts), layer, alpha.
    """
    grid = _check_grid(grid)
    counts = np.asarray(counts, dtype=np.float64)
    if not window_nll:
        raise ValueError("window_nll is empty: record it with search_alphas(..., window_nll={})")
    for layer, table in window_nll.items():
        if table is None or np.shape(table) != (len(grid), counts.shape[-1]):
            raise ValueError(f"layer {layer}: recorded NLLs have shape {np.shape(table)}, expected "
                             f"({len(grid)} grid values, {counts.shape[-1]} windows as in counts)")
    if counts.ndim != 2 or (counts < 0).any() or (counts.sum(1) == 0).any():
        raise ValueError("counts must be [n_resamples, n_windows], non-negative, each row drawing some window")
    rows = []
    for layer in sorted(window_nll, reverse=True):
        picks = np.asarray(grid)[(counts @ np.asarray(window_nll[layer]).T).argmin(axis=1)]  # first = smaller α
        rows.append(pd.DataFrame({"replicate": np.arange(len(counts)), "layer": layer, "alpha": picks}))
    return pd.concat(rows, ignore_index=True)


def refine_alphas(model, calib: torch.Tensor, alphas: dict[int, float], grid: Sequence[float] = GRID, *,
                  sweeps: int = 1, batch_size: int = 4, history: list | None = None, bypass: str = "identity"
                  ) -> dict[int, float]:
    """Coordinate descent after the greedy pass: re-search each layer (top-down) with all others at their
    current α, `sweeps` times. Shows whether greedy leaves calibration perplexity on the table."""
    order, grid = check_search(model, calib, list(alphas), grid)
    current = dict(alphas)
    for sweep in range(sweeps):
        for layer in tqdm(order, desc=f"refine sweep {sweep + 1}"):
            others = {i: a for i, a in current.items() if i != layer}
            with harp_applied(model, list(others), others, bypass=bypass):
                bounds = Boundaries(model, calib, batch_size)  # layers below may be pruned: recompute
                scores = []
                for alpha in grid:
                    with harp_applied(model, [layer], {layer: alpha}, bypass=bypass):
                        nll, count = bounds.nll_from(layer)
                    scores.append(math.exp(nll / count))
            current[layer] = pick(grid, scores)
            if history is not None:
                history += [dict(layer=layer, alpha=a, calib_ppl=s, chosen=a == current[layer], sweep=sweep + 1)
                            for a, s in zip(grid, scores, strict=True)]
    return dict(sorted(current.items()))


def closed_form_alphas(model, calib: torch.Tensor, layers: Iterable[int] | str, batch_size: int = 1
                       ) -> dict[int, float]:
    """Search-free α per layer: the least-squares scale that best matches the dense attention branch with the
    bypass branch on calibration tokens, α* = ⟨b, a⟩ / ‖b‖², clipped to [0, 1] (one forward pass)."""
    order, _ = check_search(model, calib, layers, GRID)
    df = layer_metrics(model, calib, batch_size=batch_size, entropy=False)
    star = df[df.metric == "alpha_star"].set_index("layer").value
    return {i: float(min(max(star[i], 0.0), 1.0)) for i in sorted(order)}
