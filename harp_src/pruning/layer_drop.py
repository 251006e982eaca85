"""Whole-layer methods: ShortGPT (the blocks with the lowest block influence) and attention-layer drop (the top N
attention sub-layers, or the N whose input and output are most alike, as LLM-Drop)."""

from __future__ import annotations

from torch import nn

from ..eval.smoothing import layer_metrics
from ..model.adapter import get_adapter
from .budgets import attention_params, block_params, closest_count
from .methods import Entries, PruneRequest


def _lowest_influence(model: nn.Module, request: PruneRequest, metric: str, n: int) -> list[int]:
    """The n layers with the lowest block influence `metric` ("bi_block" or "bi_attn") on the calibration windows."""
    bi = layer_metrics(model, request.windows, "calib", request.batch_size, entropy=False)
    return bi[bi.metric == metric].set_index("layer").value.nsmallest(n).index.tolist()


def shortgpt(model: nn.Module, request: PruneRequest) -> Entries:
    """ShortGPT: remove the whole blocks whose output is most like their input (the count nearest the budget)."""
    ad = get_adapter(model)
    n = closest_count(request.budget, block_params(ad, 0), ad.n_layers)
    return {i: {"heads": [], "channels": []} for i in sorted(_lowest_influence(model, request, "bi_block", n))}, False


def attention_drop_top(model: nn.Module, request: PruneRequest) -> Entries:
    """Drop the attention sub-layers of the top N layers (HARP with α = 0, without the search)."""
    ad = get_adapter(model)
    n = closest_count(request.budget, attention_params(ad, 0), ad.n_layers)
    return {i: {"heads": []} for i in range(ad.n_layers - n, ad.n_layers)}, False


def attention_drop_similar(model: nn.Module, request: PruneRequest) -> Entries:
    """Drop the N attention sub-layers whose input and output are most alike (lowest attention block influence)."""
    ad = get_adapter(model)
    n = closest_count(request.budget, attention_params(ad, 0), ad.n_layers)
    return {i: {"heads": []} for i in sorted(_lowest_influence(model, request, "bi_attn", n))}, False
