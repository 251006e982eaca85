"""Choosing units from scores: the k lowest, a layer's standardised scores, FLAP's global take under a budget, the
uniform ratio's entry."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .slicing import Units


# ---------------------------------------------------------------------------------------------- unit scores
def per_unit(columns: torch.Tensor, u: Units) -> torch.Tensor:
    """Column scores of an o_proj input [n_heads·width] summed per attention unit."""
    return columns.view(u.n_heads, u.head_width).sum(1)


# ---------------------------------------------------------------------------------------------- selection
def lowest(scores: torch.Tensor, k: int) -> list[int]:
    """Indices of the k lowest scores (ties: the lower index first)."""
    order = torch.sort(scores, stable=True).indices
    return sorted(order[:k].tolist())


def kept(n: int, removed: Iterable[int]) -> list[int]:
    gone = set(removed)
    return [j for j in range(n) if j not in gone]


def standardise(scores: torch.Tensor) -> torch.Tensor:
    """(s − mean) / std over one layer's units of one module (0 where all are equal)."""
    std = scores.std(unbiased=False)
    return torch.zeros_like(scores) if std == 0 else (scores - scores.mean()) / std


def global_take(candidates: list[tuple[float, int, str, int]], costs: dict[str, int], budget: int) -> list:
    """FLAP's global selection: walk the units from the lowest score up, taking each that still fits the budget.

    Args:
        candidates: (score, layer, kind, unit) with kind "heads" or "channels".
        costs: parameters one unit of each kind frees.
    Returns:
        The taken candidates; their cost is within one channel of `budget`.
    """
    taken, spent = [], 0
    for c in sorted(candidates):
        cost = costs[c[2]]
        if spent + cost <= budget:
            taken.append(c)
            spent += cost
    return taken


def global_entries(u: Units, scores: dict[int, tuple[torch.Tensor, torch.Tensor]], budget: int,
                   costs: dict[str, int] | None = None) -> tuple[dict[int, dict], list]:
    """Heads and channels of every layer in `scores` ranked together: each layer's scores standardised per module
    (`standardise`), then the lowest taken while they fit `budget` (`global_take`).

    Args:
        scores: {layer: (per attention unit, per MLP channel)}, higher = more useful.
        costs: parameters one unit of each kind frees (default: the dense units').
    Returns:
        ({layer: {"heads": kept, "channels": kept}}, the taken candidates (score, layer, kind, unit)).
    """
    costs = costs or {"heads": u.head_params, "channels": u.channel_params}
    candidates = []
    for i, (head_s, chan_s) in scores.items():
        candidates += [(float(s), i, "heads", j) for j, s in enumerate(standardise(head_s))]
        candidates += [(float(s), i, "channels", j) for j, s in enumerate(standardise(chan_s))]
    taken = global_take(candidates, costs, budget)
    entries = {i: {"heads": kept(u.n_heads, [c[3] for c in taken if c[1] == i and c[2] == "heads"]),
                   "channels": kept(u.n_channels, [c[3] for c in taken if c[1] == i and c[2] == "channels"])}
               for i in scores}
    return entries, taken


def uniform_entry(u: Units, scores: tuple[torch.Tensor, torch.Tensor], n_heads: int, n_channels: int,
                   heads: bool) -> dict:
    entry = {"channels": kept(u.n_channels, lowest(scores[1], n_channels))}
    if heads:
        entry["heads"] = kept(u.n_heads, lowest(scores[0], n_heads))
    return entry
