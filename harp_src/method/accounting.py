"""What a HARP plan removes: parameters in the paper's convention and for real, and the KV-cache cut."""

from __future__ import annotations

import copy

import torch
from transformers import AutoModelForCausalLM

from ..model.adapter import fingerprint, get_adapter
from ..model.weights import n_params
from .harp import HarpPlan
from .layers import check_layers


# ---------------------------------------------------------------------------------------------- accounting
def _meta_model(config):
    with torch.device("meta"):  # a copy: pruning the meta model must not touch the caller's config
        return AutoModelForCausalLM.from_config(copy.deepcopy(config))


def param_report(model_or_config, plan: HarpPlan) -> dict:
    """Parameters HARP removes, computed on a weightless (meta-device) copy of the dense model.

    Paper convention (official code): denominator = all nn.Linear parameters inside decoder layers;
    removed = N·(Q + K) + #{α = 0}·(V + O). `removed_params` is what apply_harp really deletes (folding
    included), over the whole model. `kv_cache_cut` = N / L.
    """
    config = getattr(model_or_config, "config", model_or_config)
    if fingerprint(config) != plan.fingerprint:
        raise ValueError("this plan was made for another model (fingerprints differ)")
    dense = _meta_model(config)
    adapter = get_adapter(dense)
    check_layers(adapter, plan.layers)
    total_before = n_params(dense)
    denom = sum(n_params(layer, linear=True) for layer in adapter.layers)
    removed_paper = 0
    for i, a in plan.alphas.items():
        attn = adapter.attention(i)
        removed_paper += n_params(attn.q_proj, linear=True) + n_params(attn.k_proj, linear=True)
        if a == 0.0:
            removed_paper += n_params(attn.v_proj, linear=True) + n_params(attn.o_proj, linear=True)
    unfolded = _meta_model(config)
    HarpPlan(plan.fingerprint, plan.alphas, False).apply(unfolded)
    removed_unfolded = total_before - n_params(unfolded)
    plan.apply(dense)
    total_after = n_params(dense)
    return {
        "params_before": total_before,
        "params_after": total_after,
        "params_removed": total_before - total_after,
        "ratio_model": (total_before - total_after) / total_before,
        "ratio_paper": removed_paper / denom,
        "removed_paper": removed_paper,
        "denominator_paper": denom,
        "ratio_model_unfolded": removed_unfolded / total_before,
        "n_pruned": len(plan.alphas),
        "n_dropped": sum(a == 0.0 for a in plan.alphas.values()),
        "kv_cache_cut": len(plan.alphas) / adapter.n_layers,
    }
