"""Wanda: structured (Wanda-sp, Σ mean|W|·‖X‖ per unit, layer by layer) and unstructured (the |W|·‖X‖-lowest weights
of every row zeroed, layer by layer)."""

from __future__ import annotations

import torch
from torch import nn

from ..model.adapter import Adapter, get_adapter
from .budgets import scoped_layers, uniform_counts
from .calibration import InputStats, sequential
from .methods import Entries, PruneRequest
from .record import encode_mask, linears
from .selection import per_unit, uniform_entry
from .slicing import units


def wanda_sp_scores(ad: Adapter, i: int, stats: InputStats) -> tuple[torch.Tensor, torch.Tensor]:
    """(per attention unit, per MLP channel) Σ_{j ∈ unit} mean over output rows of |W[:, j]|·‖X_j‖₂."""
    o = ad.attention(i).o_proj.weight.detach().double().abs().mean(0) * stats.norm(f"{i}.o_proj")
    down = ad.mlp(i).down_proj.weight.detach().double().abs().mean(0) * stats.norm(f"{i}.down_proj")
    return per_unit(o, units(ad, i)), down


def _row_counts(total: int, rows: int) -> torch.Tensor:
    base, extra = divmod(total, rows)
    return torch.full((rows,), base, dtype=torch.long, device="cpu") + (torch.arange(rows, device="cpu") < extra)


def _matrix_counts(sizes: dict[tuple[int, str], int], total: int) -> dict[tuple[int, str], int]:
    """Split `total` over matrices in proportion to their sizes (largest remainder), so the sum is exact."""
    all_w = sum(sizes.values())
    exact = {k: total * n / all_w for k, n in sizes.items()}
    counts = {k: int(v) for k, v in exact.items()}
    for k in sorted(exact, key=lambda k: counts[k] - exact[k])[: total - sum(counts.values())]:
        counts[k] += 1
    return counts


def wanda_mask(weight: torch.Tensor, norms: torch.Tensor, per_row: torch.Tensor) -> torch.Tensor:
    """True for the per_row[r] lowest |W[r, j]|·‖X_j‖ of each row r."""
    score = weight.detach().double().abs().cpu() * norms.cpu()[None, :]
    order = torch.sort(score, dim=1, stable=True).indices
    rank_ok = torch.arange(weight.shape[1], device="cpu")[None, :] < per_row[:, None]
    return torch.zeros_like(rank_ok).scatter_(1, order, rank_ok)


def wanda(model: nn.Module, request: PruneRequest) -> Entries:
    """Unstructured Wanda: per output row, the |W|·‖X‖-lowest weights zeroed (shapes kept), layer by layer."""
    ad = get_adapter(model)
    sizes = {(i, p): lin.weight.numel() for i in range(ad.n_layers) for p, lin in linears(ad, i).items()}
    counts = _matrix_counts(sizes, request.budget)
    reads = {"q_proj": "q_proj", "k_proj": "q_proj", "v_proj": "q_proj", "o_proj": "o_proj",
             "gate_proj": "gate_proj", "up_proj": "gate_proj", "down_proj": "down_proj"}  # shared inputs

    def entry(i, stats):
        zeroed = {}
        for p, lin in linears(ad, i).items():
            per_row = _row_counts(counts[(i, p)], lin.weight.shape[0])
            zeroed[p] = encode_mask(wanda_mask(lin.weight, stats.norm(f"{i}.{reads[p]}"), per_row))
        return {"zeroed": zeroed}

    return sequential(model, request, "wanda", entry), True


def wanda_sp(model: nn.Module, request: PruneRequest) -> Entries:
    """Wanda-sp: layer by layer from the bottom, each layer scored on the outputs of the pruned layers below."""
    ad = get_adapter(model)
    u, layers = units(ad), scoped_layers(request.method, ad.n_layers)
    n_heads, n_channels = uniform_counts(u, layers, request.budget, request.heads)

    def entry(i, stats):
        return uniform_entry(u, wanda_sp_scores(ad, i, stats), n_heads, n_channels[i], request.heads)

    return sequential(model, request, "wanda-sp", entry), True
