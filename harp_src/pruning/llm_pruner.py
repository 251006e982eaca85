"""LLM-Pruner: first-order Taylor Σ |w·∂L/∂w| over a unit's weights, over its layer range; MLP channels at a uniform
ratio (block-wise, scope "mlp"), or heads and channels ranked together (its global mode, scope "heads+mlp")."""

from __future__ import annotations

import torch
from torch import nn
from tqdm.auto import tqdm

from ..model.adapter import Adapter, get_adapter
from ..model.nll import next_token_nll
from ..model.weights import only_trainable
from .budgets import scoped_layers, uniform_counts
from .methods import Entries, PruneRequest
from .record import ATTENTION_PROJ, MLP_PROJ, linears
from .selection import global_entries, per_unit, uniform_entry
from .slicing import units


def _taylor(lin: nn.Linear, dim: int) -> torch.Tensor:
    """Σ |w·∂L/∂w| over dimension `dim` of the weight (rows: dim=1, columns: dim=0), bias included for rows."""
    out = (lin.weight.detach() * lin.weight.grad).double().abs().sum(dim)
    if dim == 1 and lin.bias is not None:
        out = out + (lin.bias.detach() * lin.bias.grad).double().abs()
    return out


def taylor_scores(ad: Adapter, i: int, heads: bool = True) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(per attention unit, per MLP channel) Σ |w·g| over the unit's weights, from gradients already accumulated;
    without `heads`, (None, per MLP channel) from the MLP's gradients alone."""
    u, attn, mlp = units(ad, i), ad.attention(i), ad.mlp(i)
    channels = _taylor(mlp.gate_proj, 1) + _taylor(mlp.up_proj, 1) + _taylor(mlp.down_proj, 0)
    if not heads:
        return None, channels
    per_head = per_unit(_taylor(attn.q_proj, 1) + _taylor(attn.o_proj, 0), u)
    if u.grouped:
        kv = _taylor(attn.k_proj, 1) + _taylor(attn.v_proj, 1)
        per_head = per_head + kv.view(u.n_heads, ad.head_dim).sum(1)
    return per_head, channels


def accumulate_gradients(model: nn.Module, windows: torch.Tensor, params: list[nn.Parameter], batch_size: int,
                          progress: bool) -> None:
    """∂(summed next-token NLL)/∂p into `params`' .grad (every other parameter frozen meanwhile)."""
    device = next(model.parameters()).device
    for p in params:
        p.grad = None
    with only_trainable(model, params):
        for start in tqdm(range(0, len(windows), batch_size), desc="llm-pruner gradients", disable=not progress,
                          leave=False):
            ids = windows[start:start + batch_size].to(device)
            next_token_nll(model(input_ids=ids, use_cache=False).logits, ids, "sum").backward()


def llm_pruner(model: nn.Module, request: PruneRequest) -> Entries:
    """LLM-Pruner: Taylor scores from the gradient of the calibration NLL over its layer range; MLP channels at a
    uniform ratio, or (heads+mlp) heads and channels by one global ranking of standardised scores."""
    ad = get_adapter(model)
    u, layers = units(ad), scoped_layers(request.method, ad.n_layers)
    # gradients only where scores are read: the MLP scope skips the attention's (a tenth of a 1.5B layer's)
    scored = (*ATTENTION_PROJ, *MLP_PROJ) if request.heads else MLP_PROJ
    params = [p for i in layers for name, lin in linears(ad, i).items() if name in scored for p in lin.parameters()]
    try:
        accumulate_gradients(model, request.windows, params, request.batch_size, request.progress)
        scores = {i: taylor_scores(ad, i, request.heads) for i in layers}
    finally:
        model.zero_grad(set_to_none=True)  # the model is left without gradients, as it came, even on an error
    if request.heads:
        return global_entries(u, scores, request.budget)[0], False
    _, n_channels = uniform_counts(u, layers, request.budget, False)
    return {i: uniform_entry(u, scores[i], 0, n_channels[i], False) for i in layers}, False
