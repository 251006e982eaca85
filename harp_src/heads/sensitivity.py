"""Per-layer sensitivity: test perplexity with one layer changed at a time (all its heads gated off, bypassed with
α = 1, bypassed with its own searched α)."""

from __future__ import annotations

import math

import pandas as pd
import torch
from tqdm.auto import tqdm

from ..method.harp import harp_applied
from ..method.prefix import Boundaries
from ..method.search import GRID
from ..model.adapter import get_adapter
from .gates import HeadGates

HARP_SEARCHED, HARP_ONE = "HARP, searched α", "HARP, α = 1"  # the bypass rows' labels


# ---------------------------------------------------------------------------------------------- sensitivity
def _ppl(nll_count: tuple[float, int]) -> float:
    return math.exp(nll_count[0] / nll_count[1])


def layer_sensitivity(model, calib: torch.Tensor, test: torch.Tensor, grid=GRID, progress: bool = True
                      ) -> pd.DataFrame:
    """Test perplexity with one layer changed at a time: all its heads gated off, HARP-bypassed with α = 1, and
    bypassed with its own α searched (on `calib`) over `grid` with only that layer pruned.

    Returns:
        layer, depth, intervention, ppl, alpha; plus one row per layer of the dense model ("dense").
    """
    ad = get_adapter(model)
    test_bounds, calib_bounds = Boundaries(model, test), Boundaries(model, calib)
    dense = _ppl(test_bounds.nll_from(ad.n_layers - 1))
    rows = []
    for i in tqdm(range(ad.n_layers), desc="layer sensitivity", disable=not progress):
        depth = i / max(ad.n_layers - 1, 1)
        with HeadGates(model) as gates:
            gates.close_heads({i: list(range(ad.n_heads))})
            rows.append(dict(layer=i, depth=depth, intervention="all heads off", ppl=_ppl(test_bounds.nll_from(i)),
                             alpha=float("nan")))
        calib_ppl = {}
        for alpha in grid:
            with harp_applied(model, [i], {i: alpha}):
                calib_ppl[alpha] = _ppl(calib_bounds.nll_from(i))
        best = min(grid, key=lambda a: (calib_ppl[a], a))
        for name, alpha in ((HARP_ONE, 1.0), (HARP_SEARCHED, best)):
            with harp_applied(model, [i], {i: alpha}):
                rows.append(dict(layer=i, depth=depth, intervention=name, ppl=_ppl(test_bounds.nll_from(i)),
                                 alpha=alpha))
        rows.append(dict(layer=i, depth=depth, intervention="dense", ppl=dense, alpha=float("nan")))
    return pd.DataFrame(rows)
