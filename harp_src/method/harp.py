"""HARP itself: delete W_Q/W_K of chosen layers, replace attention by its A = I bypass, rescale by α; the plan that
reproduces it.

Per pruned layer ℓ (paper eq. for H = H + α·H W_V W_O, GQA heads in `repeat_kv` order):
    h = h + α · o_proj(repeat_kv(v_proj(norm(h))))        (Gemma: α multiplies the post-attention-norm output)
α = 0 removes the whole attention sub-layer. Pruned layers get a no-storage slot in every KV cache.

`bypass="mean"` fixes the attention matrix to the uniform causal average instead of the identity (our extension,
not the paper's): h = h + α · o_proj(repeat_kv(cummean_t(v_proj(norm(h))))). It costs O(T · d) like the identity,
and decoding keeps one running sum and count per layer instead of K/V.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..model.adapter import Adapter, check_fingerprint, fingerprint, get_adapter, mark_kv_free, text_config
from ..model.modeling_harp import MIXINGS, BypassAttention, DroppedAttention, kind_of, mark_pruned
from ..model.modeling_harp_keep import keep_heads_attention
from ..model.weights import linear_with
from ..report.files import check_object, read_json, write_text
from .layers import check_layers, is_integer, is_number, parse_layer_key

# ---------------------------------------------------------------------------------------------- the plan
PLAN_KEYS = ("fingerprint", "alphas", "fold", "meta", "bypass", "keep_heads")
PLAN_MAX_BYTES = 1 << 20  # a plan of a 100-layer model with its provenance is a few kB


def check_alpha(layer, a) -> float:
    """α as a float, refused unless it is a finite number in [0, 1] (not a bool, a string or null)."""
    if not is_number(a) or not math.isfinite(a) or not 0.0 <= a <= 1.0:
        raise ValueError(f"α for layer {layer} is {a!r}: α must be a number in [0, 1]")
    return float(a)


def check_alpha_map(alphas) -> dict[int, float]:
    """A {layer: α} mapping, validated: a non-empty dict, integer layers >= 0, each α a number in [0, 1]."""
    if not isinstance(alphas, dict):
        raise ValueError(f"alphas must be a {{layer: α}} mapping, got {type(alphas).__name__} {alphas!r}")
    if not alphas:
        raise ValueError("alphas is empty: a plan prunes at least one layer")
    for layer in alphas:
        if not is_integer(layer) or layer < 0:
            raise ValueError(f"layer {layer!r} in alphas is not a layer index (an integer >= 0)")
    return {int(k): check_alpha(k, v) for k, v in sorted(alphas.items())}


def check_keep_heads(keep, alphas: dict[int, float]) -> dict[int, list[int]]:
    """{layer: [query head, ...]} validated against the plan's layers: a mapping, each layer one the plan bypasses,
    each list of distinct head indices >= 0 (sorted on return; layers with an empty list are left out). Whether the
    heads exist is checked against a model (`apply_harp`)."""
    if keep is None:
        return {}
    if not isinstance(keep, dict):
        raise ValueError(f"keep_heads must be a {{layer: [query head, ...]}} mapping, got {type(keep).__name__}")
    out = {}
    for layer, heads in keep.items():
        if not is_integer(layer) or layer not in alphas:
            raise ValueError(f"keep_heads names layer {layer!r}, which the plan does not bypass (it bypasses "
                             f"{sorted(alphas)}): keep heads only in bypassed layers")
        if not isinstance(heads, (list, tuple)) or not all(is_integer(h) and h >= 0 for h in heads):
            raise ValueError(f"keep_heads of layer {layer} must be a list of query head indices, got {heads!r}")
        if len(set(heads)) != len(heads):
            raise ValueError(f"keep_heads of layer {layer} lists a head twice: {list(heads)}")
        if heads:
            out[int(layer)] = sorted(int(h) for h in heads)
    return dict(sorted(out.items()))


@dataclass(frozen=True)
class HarpPlan:
    """Which layers are pruned with which α, for which model; reproducible from the base weights.

    Checked on construction: `fingerprint` names every field of `model.adapter.fingerprint`, `alphas` is a non-empty
    {layer: α in [0, 1]} dict, `fold` a bool, `meta` a dict, `bypass` one of `MIXINGS` (a plan written before the
    mean bypass existed has none and is the identity), `keep_heads` the query heads each bypassed layer keeps
    (`check_keep_heads`; a plan without it keeps none). Whether the layers and heads exist is checked against a model
    (`apply`, `param_report`).
    """

    fingerprint: dict
    alphas: dict[int, float]
    fold: bool = True
    meta: dict = field(default_factory=dict)
    bypass: str = "identity"
    keep_heads: dict[int, list[int]] = field(default_factory=dict)

    def __post_init__(self):
        check_fingerprint(self.fingerprint)
        object.__setattr__(self, "alphas", check_alpha_map(self.alphas))
        if not isinstance(self.fold, bool):
            raise ValueError(f"fold must be true or false, got {self.fold!r}")
        if not isinstance(self.meta, dict):
            raise ValueError(f"meta must be a mapping, got {type(self.meta).__name__}")
        check_bypass(self.bypass)
        object.__setattr__(self, "keep_heads", check_keep_heads(self.keep_heads, self.alphas))

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
        return apply_harp(model, self.layers, self.alphas, fold=self.fold, meta=self.meta, bypass=self.bypass,
                          keep_heads=self.keep_heads)

    def to_dict(self) -> dict:
        """The plan as JSON-able data; `keep_heads` only where some layer keeps heads (older readers see no change)."""
        out = {
            "fingerprint": self.fingerprint,
            "alphas": {str(k): v for k, v in sorted(self.alphas.items())},
            "fold": self.fold,
            "meta": self.meta,
            "bypass": self.bypass,
        }
        if self.keep_heads:
            out["keep_heads"] = {str(k): list(v) for k, v in self.keep_heads.items()}
        return out

    def to_json(self, path: str | Path) -> None:
        write_text(path, json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def from_dict(cls, d: dict, where: str = "plan") -> HarpPlan:
        """The plan a `to_dict()` wrote, checked strictly; every error names `where` (the file it came from).

        Layer keys must be plain decimal numbers ("28", not "028" or "28.0"), so no two keys name one layer.
        """
        try:
            check_object(d, "a plan", PLAN_KEYS[:2], PLAN_KEYS[2:])
            alphas, keep = d["alphas"], d.get("keep_heads", {})
            if isinstance(alphas, dict):
                alphas = {parse_layer_key(k): v for k, v in alphas.items()}
            if isinstance(keep, dict):
                keep = {parse_layer_key(k): v for k, v in keep.items()}
            return cls(d["fingerprint"], alphas, d.get("fold", True), d.get("meta", {}), d.get("bypass", "identity"),
                       keep)
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None

    @classmethod
    def from_json(cls, path: str | Path) -> HarpPlan:
        """Read a plan file (from `to_json`, `prune --out` or `search --out`), refusing anything malformed."""
        return cls.from_dict(read_json(path, "plan file", PLAN_MAX_BYTES), f"plan file {path}")


def check_bypass(bypass) -> str:
    """The bypass kind, refused unless it is one of `MIXINGS`."""
    if bypass not in MIXINGS:
        raise ValueError(f"unknown bypass {bypass!r}: choose one of {list(MIXINGS)}")
    return bypass


def check_kv_kept(adapter: Adapter, layers: list[int], bypass: str, keep: dict[int, list[int]] | None = None
                  ) -> None:
    """Refuse a mean bypass that would leave no layer with a K/V cache slot (its attention, or some of its heads
    kept): transformers builds the cache that holds the running sums beside at least one ordinary slot, so
    `generate()` could not run."""
    if bypass != "mean":
        return
    pruned = {i for i in range(adapter.n_layers) if kind_of(adapter.attention(i)) not in (None, "keep")}
    gone = sorted((set(layers) - set(keep or {})) | pruned)
    if len(gone) == adapter.n_layers:
        raise ValueError(f"the mean bypass needs at least one layer that keeps its attention or some of its heads "
                         f"(its K/V cache slot carries the running sums' cache), but pruning layers {sorted(layers)} "
                         f"would leave none of the model's {adapter.n_layers}: keep one layer's attention or some "
                         "heads, or use the identity bypass")


def check_heads_exist(adapter: Adapter, keep: dict[int, list[int]]) -> dict[int, list[int]]:
    """`keep` (checked by `check_keep_heads`), refused if a head index is not one of the model's query heads."""
    for layer, heads in keep.items():
        bad = [h for h in heads if not 0 <= h < adapter.n_heads]
        if bad:
            raise ValueError(f"keep_heads of layer {layer}: head {bad[0]} is out of range; this model has query "
                             f"heads 0..{adapter.n_heads - 1} per layer")
    return keep


def check_keep_for(adapter: Adapter, layers: list[int], keep) -> dict[int, list[int]]:
    """Kept heads for pruning (or searching) `layers`, checked before anything runs: only in those layers, heads the
    model has."""
    return check_heads_exist(adapter, check_keep_heads(keep, dict.fromkeys(layers, 1.0)))


def _check_alphas(layers: list[int], alphas: float | dict[int, float]) -> dict[int, float]:
    if not isinstance(alphas, dict):
        alphas = {i: check_alpha(i, alphas) for i in layers}
    alphas = check_alpha_map(alphas)
    missing, extra = set(layers) - set(alphas), set(alphas) - set(layers)
    if missing or extra:
        raise ValueError(f"alphas must give one α per pruned layer: missing {sorted(missing)}, extra {sorted(extra)}")
    return alphas


# ---------------------------------------------------------------------------------------------- pruning
def _folded_o_proj(adapter: Adapter, o_proj: nn.Linear, scale: float) -> nn.Linear:
    """o_proj over KV heads: W'[:, kv] = scale · Σ_{g : g // n_rep = kv} W[:, g] (exact, fewer FLOPs)."""
    w = o_proj.weight.unflatten(1, (adapter.n_kv_heads, adapter.n_rep, adapter.head_dim)).sum(dim=2).flatten(1)
    with torch.no_grad():
        return linear_with(w * scale, None if o_proj.bias is None else o_proj.bias * scale)


def _prune_layer(adapter: Adapter, i: int, alpha: float, fold: bool, bypass: str) -> None:
    if alpha == 0.0:
        adapter.set_attention(i, DroppedAttention())
        adapter.remove_attention_norms(i)
        return
    attn = adapter.attention(i)
    # α goes where it is not undone by a norm: after the attention-output norm if there is one, else into o_proj
    in_o_proj = not adapter.scale_after_norm(i, alpha, fold)
    if fold:
        module = BypassAttention(attn.v_proj, _folded_o_proj(adapter, attn.o_proj, alpha if in_o_proj else 1.0),
                                 adapter.head_dim, 1, None, alpha, mixing=bypass, layer_idx=i)
    else:
        module = BypassAttention(attn.v_proj, attn.o_proj, adapter.head_dim, adapter.n_rep,
                                 alpha if in_o_proj else None, alpha, mixing=bypass, layer_idx=i)
    adapter.set_attention(i, module)


def apply_harp(
    model: nn.Module,
    layers: Iterable[int] | str,
    alphas: float | dict[int, float] = 1.0,
    fold: bool = True,
    meta: dict | None = None,
    bypass: str = "identity",
    *,
    keep_heads: dict[int, list[int]] | None = None,
) -> HarpPlan:
    """Turn `model` into a HARP model in place and return the plan that reproduces it.

    Args:
        model: a loaded causal LM of a supported family.
        layers: 0-based layer indices, or a spec such as "top:8", "bottom:8", "3,5,7", "20-29".
        alphas: {layer: α} with α in [0, 1], or one α for all layers. α = 0 drops the attention sub-layer.
        fold: fold the KV-head repeat and α into the weights (exact; fewer parameters and FLOPs).
        meta: free-form provenance stored in the plan (e.g. how α was chosen).
        bypass: "identity" (HARP: each token reads its own value) or "mean" (each token reads the mean value of the
            positions up to it; decoding keeps a running sum per layer, no K/V).
        keep_heads: {layer: [query head, ...]}: in those bypassed layers these heads attend exactly as in the dense
            model and α scales only the other heads' bypass (`model.modeling_harp_keep`); only their KV groups keep K
            and a cache; the other heads take `bypass`.
    Returns:
        The HarpPlan; `model.harp_plan` holds the union of all plans applied so far.
    """
    adapter = get_adapter(model)
    layers = check_layers(adapter, layers)
    if meta is not None and not isinstance(meta, dict):
        raise ValueError(f"meta must be a mapping, got {type(meta).__name__}")
    plan = HarpPlan(fingerprint(model.config), _check_alphas(layers, alphas), fold, dict(meta or {}),
                    check_bypass(bypass), keep_heads)
    check_heads_exist(adapter, plan.keep_heads)
    check_kv_kept(adapter, layers, bypass, plan.keep_heads)
    previous = getattr(model, "harp_plan", None)
    for name in ("fold", "bypass"):
        if previous is not None and getattr(previous, name) != getattr(plan, name):
            was = getattr(previous, name)
            raise ValueError(f"this model's layers {previous.layers} were pruned with {name}={was!r}; prune the "
                             f"others with the same {name}, so one plan describes the model")
    union = plan if previous is None else HarpPlan(
        plan.fingerprint, {**previous.alphas, **plan.alphas}, fold, {**previous.meta, **plan.meta}, bypass,
        {**previous.keep_heads, **plan.keep_heads})
    # all checks passed: from here on the model changes
    for i in layers:
        if i in plan.keep_heads:
            adapter.set_attention(i, keep_heads_attention(adapter.attention(i), plan.keep_heads[i], plan.alphas[i],
                                                          fold, bypass))
        else:
            _prune_layer(adapter, i, plan.alphas[i], fold, bypass)
    mark_kv_free(model, [i for i in layers if i not in plan.keep_heads])
    model.harp_plan = union
    mark_pruned(model)  # model.save_pretrained now writes a pruned checkpoint
    return plan


@contextmanager
def harp_applied(model: nn.Module, layers: Iterable[int], alphas: float | dict[int, float], fold: bool = True,
                 bypass: str = "identity", *, keep_heads: dict[int, list[int]] | None = None
                 ) -> Iterator[HarpPlan | None]:
    """Prune copies of `layers` while inside (none: the model as it is, yielding None); on exit the model is
    exactly as before: its layers, KV-cache modes, class and plan. Yields the plan `apply_harp` returned.
    `keep_heads` may name other layers too; only those of `layers` are kept."""
    layers = sorted(layers)
    if not layers:
        yield None
        return
    adapter = get_adapter(model)
    originals = {i: adapter.layers[i] for i in layers}
    cfg = text_config(model.config)
    saved = (getattr(cfg, "kv_sharing_modes", None), type(model), model.__dict__.get("harp_plan"))
    try:
        for i in layers:
            adapter.layers[i] = copy.deepcopy(originals[i])
        keep = {i: hs for i, hs in (keep_heads or {}).items() if i in originals}  # a search's map names more layers
        yield apply_harp(model, layers, alphas, fold=fold, bypass=bypass, keep_heads=keep)
    finally:
        for i, layer in originals.items():
            adapter.layers[i] = layer
        cfg.kv_sharing_modes, model.__class__ = saved[0], saved[1]  # apply_harp set both
        if saved[2] is None:
            model.__dict__.pop("harp_plan", None)
        else:
            model.harp_plan = saved[2]
