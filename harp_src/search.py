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

import torch
from tqdm.auto import tqdm

from .analysis import layer_metrics
from .evaluate import check_windows, nll_sum
from .harp import check_layers
from .models import get_adapter
from .prefix import Boundaries, harp_applied

GRID = tuple(round(0.1 * k, 1) for k in range(11))  # 0.0, 0.1, ..., 1.0 (paper)


def _check_grid(grid: Sequence[float]) -> tuple[float, ...]:
    grid = tuple(float(a) for a in grid)
    if not grid:
        raise ValueError("the α grid is empty; use e.g. (0.0, 0.1, ..., 1.0)")
    bad = [a for a in grid if not (math.isfinite(a) and 0.0 <= a <= 1.0)]
    if bad:
        raise ValueError(f"α grid values {bad} are outside [0, 1]")
    return tuple(sorted(set(grid)))  # ascending, so the first minimum found is the smaller α


def _setup(model, calib: torch.Tensor, layers, grid) -> tuple[list[int], tuple[float, ...]]:
    """Checked inputs: the layers top-down and the grid ascending."""
    check_windows(model, calib)
    layers = check_layers(get_adapter(model), layers)
    if not layers:
        raise ValueError("no layers to search")
    return sorted(layers, reverse=True), _check_grid(grid)


def search_alphas(
    model,
    calib: torch.Tensor,
    layers: Iterable[int] | str,
    grid: Sequence[float] = GRID,
    cache_prefix: bool = True,
    batch_size: int = 4,
    history: list | None = None,
    memo: dict | None = None,
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
    Returns:
        {layer: α}
    """
    order, grid = _setup(model, calib, layers, grid)
    memo = {} if memo is None else memo
    bounds = None
    chosen: dict[int, float] = {}
    bar = tqdm(total=len(order) * len(grid), desc="α search")
    for depth, layer in enumerate(order):
        key = (tuple(order[: depth + 1]), grid, batch_size, cache_prefix)
        if key in memo:
            scores = memo[key]
            bar.update(len(grid))
        else:
            if cache_prefix and bounds is None:
                bounds = Boundaries(model, calib, batch_size)
            scores = []
            for alpha in grid:
                bar.set_postfix(layer=layer, alpha=alpha)
                with harp_applied(model, [*chosen, layer], {**chosen, layer: alpha}):
                    nll, count = bounds.nll_from(layer) if bounds else nll_sum(model, calib, batch_size,
                                                                                 progress=False)
                scores.append(math.exp(nll / count))
                bar.update()
            memo[key] = scores
        best = min(range(len(grid)), key=lambda k: (scores[k], grid[k]))
        chosen[layer] = grid[best]
        if history is not None:
            history += [dict(layer=layer, alpha=a, calib_ppl=s, chosen=k == best)
                        for k, (a, s) in enumerate(zip(grid, scores, strict=True))]
    bar.close()
    return dict(sorted(chosen.items()))


def refine_alphas(model, calib: torch.Tensor, alphas: dict[int, float], grid: Sequence[float] = GRID,
                  sweeps: int = 1, batch_size: int = 4, history: list | None = None) -> dict[int, float]:
    """Coordinate descent after the greedy pass: re-search each layer (top-down) with all others at their
    current α, `sweeps` times. Shows whether greedy leaves calibration perplexity on the table."""
    order, grid = _setup(model, calib, list(alphas), grid)
    current = dict(alphas)
    for sweep in range(sweeps):
        for layer in tqdm(order, desc=f"refine sweep {sweep + 1}"):
            others = {i: a for i, a in current.items() if i != layer}
            with harp_applied(model, list(others), others):
                bounds = Boundaries(model, calib, batch_size)  # layers below may be pruned: recompute
                scores = []
                for alpha in grid:
                    with harp_applied(model, [layer], {layer: alpha}):
                        nll, count = bounds.nll_from(layer)
                    scores.append(math.exp(nll / count))
            best = min(range(len(grid)), key=lambda k: (scores[k], grid[k]))
            current[layer] = grid[best]
            if history is not None:
                history += [dict(layer=layer, alpha=a, calib_ppl=s, chosen=k == best, sweep=sweep + 1)
                            for k, (a, s) in enumerate(zip(grid, scores, strict=True))]
    return dict(sorted(current.items()))


def closed_form_alphas(model, calib: torch.Tensor, layers: Iterable[int] | str, batch_size: int = 1
                       ) -> dict[int, float]:
    """Search-free α per layer: the least-squares scale that best matches the dense attention branch with the
    bypass branch on calibration tokens, α* = ⟨b, a⟩ / ‖b‖², clipped to [0, 1] (one forward pass)."""
    order, _ = _setup(model, calib, layers, GRID)
    df = layer_metrics(model, calib, batch_size=batch_size, entropy=False)
    star = df[df.metric == "alpha_star"].set_index("layer").value
    return {i: float(min(max(star[i], 0.0), 1.0)) for i in sorted(order)}
