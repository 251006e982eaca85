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
    removed = N·(Q + K) + #{α = 0}·(V + O) (`paper_removed`, which also counts layers that keep heads).
    `removed_params` is what apply_harp really deletes (folding included), over the whole model. `kv_cache_cut` is the
    share of KV groups over all layers that no longer cache: N / L without kept heads.
    """
    config = getattr(model_or_config, "config", model_or_config)
    if fingerprint(config) != plan.fingerprint:
        raise ValueError("this plan was made for another model (fingerprints differ)")
    dense = _meta_model(config)
    adapter = get_adapter(dense)
    check_layers(adapter, plan.layers)
    total_before = n_params(dense)
    denom = sum(n_params(layer, linear=True) for layer in adapter.layers)
    removed_paper = sum(paper_removed(adapter, i, a, plan.keep_heads.get(i)) for i, a in plan.alphas.items())
    unfolded = _meta_model(config)
    HarpPlan(plan.fingerprint, plan.alphas, False, keep_heads=plan.keep_heads).apply(unfolded)
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
        "kv_cache_cut": sum(1 - kv_groups_kept(adapter, plan.keep_heads.get(i)) / adapter.n_kv_heads
                            for i in plan.alphas) / adapter.n_layers,
    }


def kv_groups_kept(adapter, heads: list[int] | None) -> int:
    """KV groups a bypassed layer still caches: those its kept query heads read (none without kept heads)."""
    return len({h // adapter.n_rep for h in heads or []})


def paper_removed(adapter, i: int, alpha: float, heads: list[int] | None) -> int:
    """Parameters of layer i's attention the paper's convention counts as removed: W_Q and W_K, and W_V and W_O when
    α = 0. With kept heads: the q rows of the other heads and the k rows of groups no kept head reads (and at α = 0
    their o columns and the v rows no head reads any more)."""
    attn = adapter.attention(i)
    q, k, v, o = (n_params(getattr(attn, name), linear=True) for name in ("q_proj", "k_proj", "v_proj", "o_proj"))
    if not heads:
        return q + k + (v + o if alpha == 0.0 else 0)
    heads_gone, groups_gone = adapter.n_heads - len(heads), adapter.n_kv_heads - kv_groups_kept(adapter, heads)
    removed = q * heads_gone // adapter.n_heads + k * groups_gone // adapter.n_kv_heads
    if alpha == 0.0:  # every row and column is one head's or one group's: these divisions are exact
        removed += v * groups_gone // adapter.n_kv_heads + attn.o_proj.weight.numel() * heads_gone // adapter.n_heads
    return removed
