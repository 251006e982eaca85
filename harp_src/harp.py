"""HARP itself: delete W_Q/W_K of chosen layers, replace attention by its A = I bypass, rescale by α.

Per pruned layer ℓ (paper eq. for H = H + α·H W_V W_O, GQA heads in `repeat_kv` order):
    h = h + α · o_proj(repeat_kv(v_proj(norm(h))))        (Gemma: α multiplies the post-attention-norm output)
α = 0 removes the whole attention sub-layer. Pruned layers get a no-storage slot in every KV cache.
"""

from __future__ import annotations

import copy
import json
import math
import numbers
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from .files import read_json, write_text
from .modeling_harp import BypassAttention, DroppedAttention, kind_of, mark_pruned
from .models import Adapter, check_fingerprint, fingerprint, get_adapter, text_config


# ---------------------------------------------------------------------------------------------- modules
def is_pruned(attention: nn.Module) -> bool:
    """Whether a layer's attention module (`Adapter.attention(i)`) is a HARP bypass or dropped."""
    return kind_of(attention) in ("bypass", "dropped")


# ---------------------------------------------------------------------------------------------- the plan
PLAN_KEYS = ("fingerprint", "alphas", "fold", "meta")


def _is_number(x) -> bool:
    return isinstance(x, (numbers.Real, np.floating, np.integer)) and not isinstance(x, (bool, np.bool_))


def _is_integer(x) -> bool:
    return isinstance(x, (numbers.Integral, np.integer)) and not isinstance(x, (bool, np.bool_))


def check_alpha(layer, a) -> float:
    """α as a float, refused unless it is a finite number in [0, 1] (not a bool, a string or null)."""
    if not _is_number(a) or not math.isfinite(a) or not 0.0 <= a <= 1.0:
        raise ValueError(f"α for layer {layer} is {a!r}: α must be a number in [0, 1]")
    return float(a)


def check_alpha_map(alphas) -> dict[int, float]:
    """A {layer: α} mapping, validated: a non-empty dict, integer layers >= 0, each α a number in [0, 1]."""
    if not isinstance(alphas, dict):
        raise ValueError(f"alphas must be a {{layer: α}} mapping, got {type(alphas).__name__} {alphas!r}")
    if not alphas:
        raise ValueError("alphas is empty: a plan prunes at least one layer")
    for layer in alphas:
        if not _is_integer(layer) or layer < 0:
            raise ValueError(f"layer {layer!r} in alphas is not a layer index (an integer >= 0)")
    return {int(k): check_alpha(k, v) for k, v in sorted(alphas.items())}


@dataclass(frozen=True)
class HarpPlan:
    """Which layers are pruned with which α, for which model; reproducible from the base weights.

    Checked on construction: `fingerprint` names every field of `models.fingerprint`, `alphas` is a non-empty
    {layer: α in [0, 1]} dict, `fold` a bool, `meta` a dict. Whether the layers exist is checked against a model
    (`apply`, `param_report`).
    """

    fingerprint: dict
    alphas: dict[int, float]
    fold: bool = True
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        check_fingerprint(self.fingerprint)
        object.__setattr__(self, "alphas", check_alpha_map(self.alphas))
        if not isinstance(self.fold, bool):
            raise ValueError(f"fold must be true or false, got {self.fold!r}")
        if not isinstance(self.meta, dict):
            raise ValueError(f"meta must be a mapping, got {type(self.meta).__name__}")

    @property
    def layers(self) -> list[int]:
        return sorted(self.alphas)

    def apply(self, model: nn.Module) -> HarpPlan:
        """Prune `model` in place by this plan (refused, with the model unchanged, if it was made for another model
        or names a layer the model does not have)."""
        found = fingerprint(model.config)
        if found != self.fingerprint:
            diff = {k: (self.fingerprint.get(k), found.get(k)) for k in found if self.fingerprint.get(k) != found[k]}
            raise ValueError(f"this plan was made for another model: (plan, model) differ in {diff}")
        return apply_harp(model, self.layers, self.alphas, fold=self.fold, meta=self.meta)

    def to_dict(self) -> dict:
        return {
            "fingerprint": self.fingerprint,
            "alphas": {str(k): v for k, v in sorted(self.alphas.items())},
            "fold": self.fold,
            "meta": self.meta,
        }

    def to_json(self, path: str | Path) -> None:
        write_text(path, json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def from_dict(cls, d: dict, where: str = "plan") -> HarpPlan:
        """The plan a `to_dict()` wrote, checked strictly; every error names `where` (the file it came from).

        Layer keys must be plain decimal numbers ("28", not "028" or "28.0"), so no two keys name one layer.
        """
        try:
            if not isinstance(d, dict):
                raise ValueError(f"a plan is a JSON object, got {type(d).__name__}")
            unknown = sorted(set(d) - set(PLAN_KEYS))
            missing = [k for k in ("fingerprint", "alphas") if k not in d]
            if unknown or missing:
                raise ValueError(f"a plan has the keys {list(PLAN_KEYS)} (fold and meta optional); "
                                 f"unknown {unknown}, missing {missing}")
            alphas = d["alphas"]
            if isinstance(alphas, dict):
                alphas = {parse_layer_key(k): v for k, v in alphas.items()}
            return cls(d["fingerprint"], alphas, d.get("fold", True), d.get("meta", {}))
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None

    @classmethod
    def from_json(cls, path: str | Path) -> HarpPlan:
        """Read a plan file (from `to_json`, `prune --out` or `search --out`), refusing anything malformed."""
        return cls.from_dict(read_json(path, "plan file"), f"plan file {path}")


def parse_layer_key(key) -> int:
    if not isinstance(key, str) or not key.isdecimal() or str(int(key)) != key:
        raise ValueError(f"layer key {key!r} is not a plain layer number such as \"28\"")
    return int(key)


def _layer_number(x, spec) -> int:
    if not _is_integer(x):
        raise ValueError(f"layers must be integers (0-based indices), got {x!r} in {spec!r}")
    return int(x)


def parse_layers(spec: str | Iterable[int], n_layers: int) -> list[int]:
    """'top:8', 'bottom:4', '3,5,7', '20-29' or an iterable of ints -> list of 0-based layers (not yet range-checked:
    `check_layers` does that)."""
    if spec is None or not isinstance(spec, (str, Iterable)):
        raise ValueError(f"layers must be a spec such as 'top:8' or a list of layer indices, got {spec!r}")
    if not isinstance(spec, str):
        return [_layer_number(i, spec) for i in spec]
    spec = spec.strip()
    try:
        if ":" in spec:
            where, n = spec.split(":", 1)
            n = int(n)
            if not 0 <= n <= n_layers:
                raise ValueError(f"N must be in 0..{n_layers}")
            if where == "top":
                return list(range(n_layers - n, n_layers))
            if where == "bottom":
                return list(range(n))
            raise ValueError("unknown selection")
        out: list[int] = []
        for part in filter(None, (p.strip() for p in spec.split(","))):
            lo, _, hi = part.partition("-")
            out += list(range(int(lo), int(hi) + 1)) if hi else [int(lo)]
        return out
    except ValueError as err:
        raise ValueError(f"layers {spec!r} ({err}): use top:N, bottom:N, a range a-b or a list a,b,c") from None


def _check_alphas(layers: list[int], alphas: float | dict[int, float]) -> dict[int, float]:
    if not isinstance(alphas, dict):
        alphas = {i: check_alpha(i, alphas) for i in layers}
    alphas = check_alpha_map(alphas)
    missing, extra = set(layers) - set(alphas), set(alphas) - set(layers)
    if missing or extra:
        raise ValueError(f"alphas must give one α per pruned layer: missing {sorted(missing)}, extra {sorted(extra)}")
    return alphas


def check_layers(adapter: Adapter, layers: str | Iterable[int]) -> list[int]:
    """The one validation of a layer set (pruning and α search): parsed, not empty, in range, each once, none pruned
    yet.

    Args:
        layers: 0-based indices or a spec such as "top:8" (see parse_layers).
    Returns:
        The layers, sorted ascending.
    """
    layers = parse_layers(layers, adapter.n_layers)
    if not layers:
        raise ValueError("no layers given: name at least one layer, e.g. 'top:8' or [28, 29]")
    for i in layers:
        adapter.check_layer(i)
    if len(set(layers)) != len(layers):
        raise ValueError(f"layers {layers} contain duplicates; give each layer once")
    already = [i for i in layers if is_pruned(adapter.attention(i))]
    if already:
        raise ValueError(f"layers {already} are already pruned; start again from the base model to re-prune them")
    return sorted(layers)


def quarter_depth(n_layers: int) -> int:
    """The paper's N = 8 of 32 layers, scaled to this depth."""
    return max(1, round(n_layers * 8 / 32))


def n_values(n_layers: int, n_max_frac: float = 0.5, count: int = 8) -> list[int]:
    """About `count` values of N from 1 to n_layers · n_max_frac, always with 1, the maximum and the paper's
    N = depth · 8/32 (for sweeps over the number of pruned layers)."""
    top = max(1, round(n_layers * n_max_frac))
    values = {max(1, round(1 + k * (top - 1) / max(count - 1, 1))) for k in range(count)}
    return sorted(values | {min(quarter_depth(n_layers), top)})


# ---------------------------------------------------------------------------------------------- pruning
def _folded_o_proj(adapter: Adapter, o_proj: nn.Linear, scale: float) -> nn.Linear:
    """o_proj over KV heads: W'[:, kv] = scale · Σ_{g : g // n_rep = kv} W[:, g] (exact, fewer FLOPs)."""
    w = o_proj.weight.unflatten(1, (adapter.n_kv_heads, adapter.n_rep, adapter.head_dim)).sum(dim=2).flatten(1)
    new = nn.Linear(w.shape[1], w.shape[0], bias=o_proj.bias is not None, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        new.weight.copy_(w * scale)
        if o_proj.bias is not None:
            new.bias.copy_(o_proj.bias * scale)
    return new


def _prune_layer(adapter: Adapter, i: int, alpha: float, fold: bool) -> None:
    if alpha == 0.0:
        adapter.set_attention(i, DroppedAttention())
        adapter.remove_attention_norms(i)
        return
    attn = adapter.attention(i)
    # α goes where it is not undone by a norm: after the attention-output norm if there is one, else into o_proj
    in_o_proj = not adapter.scale_after_norm(i, alpha, fold)
    if fold:
        bypass = BypassAttention(attn.v_proj, _folded_o_proj(adapter, attn.o_proj, alpha if in_o_proj else 1.0),
                                 adapter.head_dim, 1, None, alpha)
    else:
        bypass = BypassAttention(attn.v_proj, attn.o_proj, adapter.head_dim, adapter.n_rep,
                                 alpha if in_o_proj else None, alpha)
    adapter.set_attention(i, bypass)


def mark_kv_free(model: nn.Module, layers: list[int]) -> None:
    """Give pruned layers a no-storage cache slot.

    transformers builds each cache layer from the config; a layer whose `kv_sharing_modes` entry is "reuse"
    gets a `DummyLayer` (stores nothing, skipped by sequence-length and mask bookkeeping). That keeps
    cache indexing right for any layer set, bottom and middle included.
    """
    cfg = text_config(model.config)
    modes = list(getattr(cfg, "kv_sharing_modes", None) or [None] * cfg.num_hidden_layers)
    for i in layers:
        modes[i] = "reuse"
    if all(m == "reuse" for m in modes):
        # every layer bypassed: transformers needs one ordinary slot to ask for the sequence length; it stays
        # empty (nothing calls update), which is harmless because no layer uses positions or masks any more
        modes[0] = None
    cfg.kv_sharing_modes = modes


def apply_harp(
    model: nn.Module,
    layers: Iterable[int] | str,
    alphas: float | dict[int, float] = 1.0,
    fold: bool = True,
    meta: dict | None = None,
) -> HarpPlan:
    """Turn `model` into a HARP model in place and return the plan that reproduces it.

    Args:
        model: a loaded causal LM of a supported family.
        layers: 0-based layer indices, or a spec such as "top:8", "bottom:8", "3,5,7", "20-29".
        alphas: {layer: α} with α in [0, 1], or one α for all layers. α = 0 drops the attention sub-layer.
        fold: fold the KV-head repeat and α into the weights (exact; fewer parameters and FLOPs).
        meta: free-form provenance stored in the plan (e.g. how α was chosen).
    Returns:
        The HarpPlan; `model.harp_plan` holds the union of all plans applied so far.
    """
    adapter = get_adapter(model)
    layers = check_layers(adapter, layers)
    if meta is not None and not isinstance(meta, dict):
        raise ValueError(f"meta must be a mapping, got {type(meta).__name__}")
    plan = HarpPlan(fingerprint(model.config), _check_alphas(layers, alphas), fold, dict(meta or {}))
    previous = getattr(model, "harp_plan", None)
    if previous is not None and previous.fold != fold:
        raise ValueError(f"this model's layers {previous.layers} were pruned with fold={previous.fold}; prune the "
                         f"others with the same fold, so one plan describes the model")
    union = plan if previous is None else HarpPlan(
        plan.fingerprint, {**previous.alphas, **plan.alphas}, fold, {**previous.meta, **plan.meta})
    # all checks passed: from here on the model changes
    for i in layers:
        _prune_layer(adapter, i, plan.alphas[i], fold)
    mark_kv_free(model, layers)
    model.harp_plan = union
    mark_pruned(model)  # model.save_pretrained now writes a pruned checkpoint
    return plan


# ---------------------------------------------------------------------------------------------- accounting
def _linear_params(module: nn.Module) -> int:
    return sum(p.numel() for m in module.modules() if isinstance(m, nn.Linear) for p in m.parameters())


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
    total_before = sum(p.numel() for p in dense.parameters())
    denom = sum(_linear_params(layer) for layer in adapter.layers)
    removed_paper = 0
    for i, a in plan.alphas.items():
        attn = adapter.attention(i)
        removed_paper += _linear_params(attn.q_proj) + _linear_params(attn.k_proj)
        if a == 0.0:
            removed_paper += _linear_params(attn.v_proj) + _linear_params(attn.o_proj)
    unfolded = _meta_model(config)
    HarpPlan(plan.fingerprint, plan.alphas, False).apply(unfolded)
    removed_unfolded = total_before - sum(p.numel() for p in unfolded.parameters())
    plan.apply(dense)
    total_after = sum(p.numel() for p in dense.parameters())
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


def kv_bytes_per_layer(cache) -> list[int]:
    """Bytes of K/V tensors each layer of a transformers cache holds (a pruned layer's DummyLayer: 0)."""
    return [sum(t.numel() * t.element_size() for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
                if isinstance(t, torch.Tensor)) for layer in cache.layers]


def kv_cache_bytes(cache) -> int:
    """Bytes of K/V tensors a transformers cache holds (pruned layers hold none)."""
    return sum(kv_bytes_per_layer(cache))
