"""Which heads to remove, given a score per head: one-shot or iterative, global ranking or a uniform ratio.

Scores are *keep* scores, [n_layers, n_heads], higher = more useful; the lowest go first. Every choice keeps a valid
GQA layout (`pruning.slicing.balanced_groups`): the unit removed is a **slot**, the r-th least useful query head of
every KV group of one layer at once (n_kv heads; a single head for MQA and MHA with one head per group). A slot's
score is the mean of its heads' scores; within a layer the slots come in rank order, so removing a layer's slots one
by one takes its weakest heads first. Heads already removed carry score −inf and stay removed.
"""

from __future__ import annotations

import math

import torch

from ..model.adapter import Adapter


def check_fraction(fraction: float, what: str = "target fraction of heads") -> float:
    """A fraction strictly between 0 and 1, or a clear ValueError."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction < 1:
        raise ValueError(f"the {what} must be a number strictly between 0 and 1 (e.g. 0.5 for half the heads); "
                         f"got {fraction!r}")
    return float(fraction)


def slot_size(adapter: Adapter) -> int:
    """Heads removed per slot: one from each KV group."""
    return adapter.n_kv_heads


def _slots(scores: torch.Tensor, adapter: Adapter, layers: list[int]) -> list[tuple[float, int, int, list[int]]]:
    """(score, layer, rank, heads) of every slot of `layers`."""
    out = []
    for i in layers:
        groups = scores[i].view(adapter.n_kv_heads, adapter.n_rep)
        order = torch.argsort(groups, dim=1, stable=True)  # per group: weakest first
        for r in range(adapter.n_rep):
            heads = [g * adapter.n_rep + int(order[g, r]) for g in range(adapter.n_kv_heads)]
            values = scores[i, heads].double()
            score = -math.inf if torch.isinf(values).all() else float(values[torch.isfinite(values)].mean())
            out.append((score, i, r, heads))
    return out


def heads_to_slots(n_heads: int, adapter: Adapter) -> int:
    """The number of slots closest to `n_heads` heads (half-way rounds up)."""
    return math.floor(n_heads / slot_size(adapter) + 0.5)


def choose_heads(scores: torch.Tensor, adapter: Adapter, n_remove: int, layers: list[int] | None = None,
                 mode: str = "global") -> dict[int, list[int]]:
    """The heads to remove: `n_remove` heads (rounded to whole slots) with the lowest keep scores.

    Args:
        scores: keep scores [n_layers, n_heads] (−inf: already removed).
        n_remove: how many heads in all.
        layers: the layers that may lose heads (default: all).
        mode: "global" (one ranking over all layers) or "uniform" (the same number of slots from every layer; the
            remainder from the layers whose next slot scores lowest).
    Returns:
        {layer: sorted heads} for every layer that loses any.
    """
    layers = list(range(adapter.n_layers)) if layers is None else list(layers)
    if mode not in ("global", "uniform"):
        raise ValueError(f"mode must be 'global' or 'uniform', not {mode!r}")
    if tuple(scores.shape) != (adapter.n_layers, adapter.n_heads):
        raise ValueError(f"scores must be [{adapter.n_layers}, {adapter.n_heads}] (layers × heads); got "
                         f"{tuple(scores.shape)}")
    n_slots = heads_to_slots(n_remove, adapter)
    if not 0 <= n_slots <= len(layers) * adapter.n_rep:
        raise ValueError(f"cannot remove {n_remove} heads from {len(layers)} layers of {adapter.n_heads} heads")
    slots = sorted(_slots(scores, adapter, layers), key=lambda s: (s[0], s[2], s[1]))
    if mode == "global":
        taken = slots[:n_slots]
    else:
        each, extra = divmod(n_slots, len(layers))
        taken = [s for s in slots if s[2] < each]
        rest = [s for s in slots if s[2] == each]  # every layer's next slot, weakest first
        taken += rest[:extra]
    out: dict[int, list[int]] = {}
    for _, layer, _, heads in taken:
        out.setdefault(layer, []).extend(heads)
    return {i: sorted(hs) for i, hs in sorted(out.items())}


def count_heads(heads: dict[int, list[int]]) -> int:
    return sum(len(hs) for hs in heads.values())


def iterative_schedule(adapter: Adapter, target: float, step: float = 0.1, layers: list[int] | None = None
                       ) -> list[int]:
    """Cumulative heads removed after each round: each round removes `step` of the heads still there (at least one
    slot, in whole slots, half-way rounding up) until `target` of all heads are gone."""
    target, step = check_fraction(target), check_fraction(step, "step fraction")
    total = (adapter.n_layers if layers is None else len(layers)) * adapter.n_heads
    goal = heads_to_slots(target * total, adapter) * slot_size(adapter)
    counts, removed = [], 0
    while removed < goal:
        more = max(1, heads_to_slots(step * (total - removed), adapter)) * slot_size(adapter)
        removed = min(goal, removed + more)
        counts.append(removed)
    return counts


def without(scores: torch.Tensor, heads: dict[int, list[int]]) -> torch.Tensor:
    """`scores` with the given heads marked removed (−inf)."""
    out = scores.clone().double()
    for i, hs in heads.items():
        out[i, hs] = -math.inf
    return out
