"""Mag-sp: ‖W_out[:, unit]‖₂ of the output projection each unit feeds; a uniform ratio, no data."""

from __future__ import annotations

import torch
from torch import nn

from ..model.adapter import Adapter, get_adapter
from .budgets import scoped_layers, uniform_counts
from .methods import Entries, PruneRequest
from .selection import per_unit, uniform_entry
from .slicing import units


def magnitude_scores(ad: Adapter, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(per attention unit, per MLP channel) L2 norm of the output-projection columns each feeds."""
    u = units(ad, i)
    o = ad.attention(i).o_proj.weight.detach().double()
    down = ad.mlp(i).down_proj.weight.detach().double()
    return per_unit(o.pow(2).sum(0), u).sqrt(), down.norm(dim=0)


def mag_sp(model: nn.Module, request: PruneRequest) -> Entries:
    """Mag-sp: in every layer, the units whose output columns have the smallest norm (no data)."""
    ad = get_adapter(model)
    u, layers = units(ad), scoped_layers(request.method, ad.n_layers)
    n_heads, n_channels = uniform_counts(u, layers, request.budget, request.heads)  # heads: 0 (scope "mlp")
    return {i: uniform_entry(u, magnitude_scores(ad, i), n_heads, n_channels[i], request.heads) for i in layers}, False
