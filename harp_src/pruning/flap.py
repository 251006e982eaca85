"""FLAP: fluctuation (Var(X_j)·‖W[:, j]‖²) standardised per layer and module, one global ranking, removed inputs'
mean folded into the output bias."""

from __future__ import annotations

import torch
from torch import nn

from ..model.adapter import Adapter, get_adapter
from .calibration import InputStats, calibrate
from .methods import Entries, PruneRequest
from .selection import global_take, kept, per_unit, standardise
from .slicing import units


def fluctuation(lin: nn.Linear, variance: torch.Tensor) -> torch.Tensor:
    """Per input column j: Var(X_j)·‖W[:, j]‖² (FLAP's weighted input feature variance, WIFV)."""
    return lin.weight.detach().double().pow(2).sum(0).cpu() * variance.cpu()


def compensation(weight: torch.Tensor, mean: torch.Tensor, removed: list[int]) -> list[float] | None:
    """W[:, removed] · E[X_removed]: what the removed inputs added on average (FLAP's bias compensation)."""
    if not removed:
        return None
    idx = torch.tensor(removed, dtype=torch.long, device="cpu")
    return (weight.detach().double().cpu()[:, idx] @ mean.cpu()[idx]).tolist()


def _new_bias_params(ad: Adapter, i: int, kind: str) -> int:
    """Parameters a compensation bias adds to layer i's o_proj ("heads") or down_proj ("channels")."""
    lin = ad.attention(i).o_proj if kind == "heads" else ad.mlp(i).down_proj
    return 0 if lin.bias is not None else lin.out_features


def flap_entries(ad: Adapter, stats: InputStats, budget: int, heads: bool) -> dict[int, dict]:
    """FLAP's entries from calibration statistics of every layer's o_proj and down_proj inputs."""
    u = units(ad)
    candidates = []
    for i in range(ad.n_layers):
        chan_s = fluctuation(ad.mlp(i).down_proj, stats.var(f"{i}.down_proj"))
        candidates += [(float(s), i, "channels", j) for j, s in enumerate(standardise(chan_s))]
        if heads:
            head_s = per_unit(fluctuation(ad.attention(i).o_proj, stats.var(f"{i}.o_proj")), u)
            candidates += [(float(s), i, "heads", j) for j, s in enumerate(standardise(head_s))]
    costs = {"heads": u.head_params, "channels": u.channel_params}
    taken, added = [], 0
    while True:  # compensation creates a bias in each pruned module that had none: remove that much more
        taken = global_take(candidates, costs, budget + added)
        now = sum(_new_bias_params(ad, i, kind) for i, kind in {(c[1], c[2]) for c in taken})
        if now <= added:
            break
        added = now
    entries = {}
    for i in range(ad.n_layers):
        gone_c = sorted(c[3] for c in taken if c[1] == i and c[2] == "channels")
        entry = {"channels": kept(u.n_channels, gone_c),
                 "channels_bias": compensation(ad.mlp(i).down_proj.weight, stats.mean(f"{i}.down_proj"), gone_c)}
        if heads:
            gone_h = sorted(c[3] for c in taken if c[1] == i and c[2] == "heads")
            cols = [gone * u.head_width + w for gone in gone_h for w in range(u.head_width)]
            entry |= {"heads": kept(u.n_heads, gone_h),
                      "heads_bias": compensation(ad.attention(i).o_proj.weight, stats.mean(f"{i}.o_proj"), cols)}
        entries[i] = {k: v for k, v in entry.items() if v is not None}
    return entries


def flap(model: nn.Module, request: PruneRequest) -> Entries:
    """FLAP: one calibration pass on the unpruned model (the global ranking needs every layer's scores first)."""
    ad = get_adapter(model)
    watched = {f"{i}.down_proj": ad.mlp(i).down_proj for i in range(ad.n_layers)}
    if request.heads:
        watched |= {f"{i}.o_proj": ad.attention(i).o_proj for i in range(ad.n_layers)}
    stats = calibrate(model, request.windows, watched, request.batch_size)
    return flap_entries(ad, stats, request.budget, request.heads), False
