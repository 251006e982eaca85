"""What a baseline removed, per layer (`PruneRecord`, JSON), and how an entry is applied: slicing heads and channels,
adding FLAP's compensation biases, zeroing unstructured weights."""

from __future__ import annotations

import base64
import binascii
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..method.harp import check_kv_kept
from ..method.layers import parse_layer_key
from ..model.adapter import Adapter, check_fingerprint, fingerprint, get_adapter, mark_kv_free
from ..model.modeling_harp import mark_pruned
from ..report.files import check_object, read_json, write_text
from .methods import METHODS, SCOPES
from .slicing import channels_removed, heads_removed, keep_channels, keep_heads, units

ATTENTION_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj")


MLP_PROJ = ("gate_proj", "up_proj", "down_proj")


# ---------------------------------------------------------------------------------------------- the record
@dataclass(frozen=True)
class PruneRecord:
    """What a baseline removed, per layer; re-applies to the base model.

    `layers[i]` may hold "heads" (attention units kept), "channels" (MLP channels kept), "heads_bias" /
    "channels_bias" (FLAP's compensation added to the o_proj / down_proj bias) and "zeroed" ({projection: packed
    bit mask of zeroed weights}, unstructured).
    """

    method: str
    scope: str
    budget: int
    fingerprint: dict
    layers: dict[int, dict]
    params_removed: int
    weights_zeroed: int = 0
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.method not in SCOPES:
            raise ValueError(f"unknown method {self.method!r}; records are made by {', '.join(METHODS)}")
        if self.scope not in SCOPES[self.method]:
            raise ValueError(f"method {self.method!r} has no scope {self.scope!r}; valid: {SCOPES[self.method]}")
        for name in ("budget", "params_removed", "weights_zeroed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
                raise ValueError(f"{name} must be a whole number >= 0, got {value!r}")
        check_fingerprint(self.fingerprint)
        if not isinstance(self.layers, dict):
            raise ValueError(f"layers must be a {{layer: entry}} mapping, got {type(self.layers).__name__}")
        if not self.layers:
            raise ValueError("layers is empty: a record prunes at least one layer")
        for i, entry in self.layers.items():
            _check_record_entry(i, entry)
        if not isinstance(self.meta, dict):
            raise ValueError(f"meta must be a mapping, got {type(self.meta).__name__}")

    def apply(self, model: nn.Module) -> PruneRecord:
        """Prune `model` in place as recorded. All or nothing: the whole record is checked against the model first
        (every layer, index, bias and mask, and the parameters and weights it claims to remove), and a record that
        does not fit is refused with the model unchanged."""
        found = fingerprint(model.config)
        if found != self.fingerprint:
            diff = {k: (self.fingerprint.get(k), found.get(k)) for k in found if self.fingerprint.get(k) != found[k]}
            raise ValueError(f"this record was made for another model: (record, model) differ in {diff}")
        ad = get_adapter(model)
        for i, entry in self.layers.items():
            _check_entry(ad, i, entry)
        removed = sum(entry_removed(ad, i, e) for i, e in self.layers.items())
        if removed != self.params_removed:
            raise ValueError(f"the record claims params_removed={self.params_removed}, but its layers remove "
                             f"{removed} parameters of this model; regenerate the record")
        mean = getattr(getattr(model, "harp_plan", None), "bypass", "identity")
        check_kv_kept(ad, [i for i, e in self.layers.items() if e.get("heads") == []], mean)
        zeroed = zeroed_count(self.layers, ad)
        if zeroed != self.weights_zeroed:
            raise ValueError(f"the record claims weights_zeroed={self.weights_zeroed}, but its masks zero {zeroed} "
                             "weights; regenerate the record")
        # all checks passed: from here on the model changes
        for i in sorted(self.layers):
            apply_entry(ad, i, self.layers[i])
        finish(model, self)
        return self

    def to_dict(self) -> dict:
        return {"method": self.method, "scope": self.scope, "budget": self.budget, "fingerprint": self.fingerprint,
                "layers": {str(i): e for i, e in sorted(self.layers.items())}, "params_removed": self.params_removed,
                "weights_zeroed": self.weights_zeroed, "meta": self.meta}

    def to_json(self, path: str | Path) -> None:
        write_text(path, json.dumps(self.to_dict()) + "\n")

    @classmethod
    def from_dict(cls, d: dict, where: str = "record") -> PruneRecord:
        """The record a `to_dict()` wrote, checked strictly; every error names `where` (the file it came from)."""
        try:
            check_object(d, "a record", ("method", "scope", "budget", "fingerprint", "layers", "params_removed"),
                         ("weights_zeroed", "meta"))
            layers = d["layers"]
            if isinstance(layers, dict):
                layers = {parse_layer_key(i): e for i, e in layers.items()}
            return cls(d["method"], d["scope"], d["budget"], d["fingerprint"], layers, d["params_removed"],
                       d.get("weights_zeroed", 0), d.get("meta", {}))
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None

    @classmethod
    def from_json(cls, path: str | Path) -> PruneRecord:
        """Read a record file (from `to_json`), refusing anything malformed."""
        return cls.from_dict(read_json(path, "record file"), f"record file {path}")


ENTRY_KEYS = ("heads", "channels", "heads_bias", "channels_bias", "zeroed")


def _index_list(values, what: str, i: int) -> None:
    if not isinstance(values, list) or any(isinstance(k, bool) or not isinstance(k, int) for k in values):
        raise ValueError(f"layer {i}: {what} must be a list of indices, got {values!r}")


def _check_record_entry(i, entry) -> None:
    """The types of one layer's record entry (whether its indices fit a model is `_check_entry`'s question)."""
    if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or i < 0:
        raise ValueError(f"layer {i!r} is not a layer index (an integer >= 0)")
    if not isinstance(entry, dict) or not set(entry) <= set(ENTRY_KEYS):
        raise ValueError(f"layer {i}: an entry is a mapping with keys among {list(ENTRY_KEYS)}, got {entry!r}")
    for key in ("heads", "channels"):
        if key in entry:
            _index_list(entry[key], key, i)
    for key in ("heads_bias", "channels_bias"):
        bias = entry.get(key)
        if bias is None:
            continue
        if not isinstance(bias, list) or not all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in bias):
            raise ValueError(f"layer {i}: {key} must be a list of numbers, got {type(bias).__name__}")
        if not all(_finite(b) for b in bias):
            raise ValueError(f"layer {i}: {key} holds a value that is not a finite number (NaN or infinity)")
        if key.removesuffix("_bias") not in entry:
            raise ValueError(f"layer {i}: {key} compensates {key.removesuffix('_bias')} that are removed, but the "
                             f"entry has no {key.removesuffix('_bias')!r}")
    zeroed = entry.get("zeroed", {})
    if not isinstance(zeroed, dict) or not all(isinstance(c, str) for c in zeroed.values()):
        raise ValueError(f"layer {i}: zeroed must map projections to packed masks (strings)")


def _finite(value: int | float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer beyond any float
        return False


def linears(ad: Adapter, i: int) -> dict[str, nn.Linear]:
    attn, mlp = ad.attention(i), ad.mlp(i)
    return {**{p: getattr(attn, p) for p in ATTENTION_PROJ}, **{p: getattr(mlp, p) for p in MLP_PROJ}}


def _check_kept(kept, n: int, what: str, i: int) -> None:
    if list(kept) != sorted(set(kept)) or any(not 0 <= k < n for k in kept):
        raise ValueError(f"layer {i}: kept {what} must be distinct sorted indices in 0..{n - 1}")


def _check_entry(ad: Adapter, i: int, entry: dict) -> None:
    ad.check_layer(i)
    if "heads" in entry or "zeroed" in entry:
        if not ad.attention_is_dense(i):
            raise ValueError(f"layer {i}'s attention is already pruned; apply the record to the base model")
    if "channels" in entry or "zeroed" in entry:
        if not ad.mlp_is_dense(i):
            raise ValueError(f"layer {i}'s MLP is already pruned; apply the record to the base model")
    u = units(ad, i)
    if "heads" in entry:
        _check_kept(entry["heads"], u.n_heads, "attention units", i)
        _check_bias(entry.get("heads_bias"), ad.attention(i).o_proj, "heads_bias", i, ad.n_layers)
    if "channels" in entry:
        _check_kept(entry["channels"], u.n_channels, "MLP channels", i)
        _check_bias(entry.get("channels_bias"), ad.mlp(i).down_proj, "channels_bias", i, ad.n_layers)
    for proj, code in entry.get("zeroed", {}).items():
        if proj not in ATTENTION_PROJ + MLP_PROJ:
            raise ValueError(f"layer {i}: unknown projection '{proj}' in the record")
        _check_mask(code, tuple(linears(ad, i)[proj].weight.shape), f"layer {i}: the zeroed mask of {proj}")


def bias_limit(lin: nn.Linear, n_layers: int) -> float:
    """The largest compensation bias a record may add: small enough that the biases of all `n_layers` layers added
    up stay within the layer's dtype (fp16: 65,504), and that the next RMSNorm squares the residual stream in float32
    without overflow; beyond either the logits become NaN."""
    dtype = lin.weight.dtype if lin.weight.dtype.is_floating_point else torch.float32
    return min(torch.finfo(dtype).max / (2 * n_layers), math.sqrt(torch.finfo(torch.float32).max / lin.out_features))


def _check_bias(bias: list | None, lin: nn.Linear, key: str, i: int, n_layers: int) -> None:
    """A compensation bias has one finite value per output of `lin`, small enough to stay finite once added."""
    if bias is None:
        return
    if len(bias) != lin.out_features:
        raise ValueError(f"layer {i}: {key} has {len(bias)} values, but the projection it compensates has "
                         f"{lin.out_features} outputs")
    total = torch.tensor(bias, dtype=torch.float64, device="cpu")
    if lin.bias is not None and not lin.bias.is_meta:
        total = total + lin.bias.detach().double().cpu()
    limit = bias_limit(lin, n_layers)
    if total.abs().max() > limit:
        raise ValueError(f"layer {i}: {key} reaches {total.abs().max():.3g}, beyond {limit:.3g}, where the model "
                         "would compute infinities and NaN; regenerate the record")


def _check_mask(code: str, shape: tuple[int, ...], what: str) -> None:
    """A packed bit mask holds exactly one bit per weight of `shape` (rounded up to whole bytes)."""
    try:
        n_bytes = len(base64.b64decode(code, validate=True))
    except (binascii.Error, ValueError):
        raise ValueError(f"{what} is not base64 text") from None
    expected = (math.prod(shape) + 7) // 8
    if n_bytes != expected:
        raise ValueError(f"{what} holds {n_bytes} bytes, but a {'x'.join(map(str, shape))} weight needs {expected} "
                         "(one bit per weight); the mask is truncated or belongs to another projection")


def entry_removed(ad: Adapter, i: int, entry: dict) -> int:
    """Parameters one checked record entry removes from layer i (compensation biases it creates count as added)."""
    removed = 0
    if "heads" in entry:
        removed += heads_removed(ad, i, list(entry["heads"]), entry.get("heads_bias") is not None)
    if "channels" in entry:
        removed += channels_removed(ad, i, list(entry["channels"]), entry.get("channels_bias") is not None)
    return removed


def _vector(values, like: torch.Tensor) -> torch.Tensor | None:
    return None if values is None else torch.tensor(values, dtype=torch.float64, device=like.device).to(like)


def encode_mask(mask: torch.Tensor) -> str:
    """A boolean tensor as base64 of its packed bits (row-major)."""
    return base64.b64encode(np.packbits(mask.cpu().numpy().ravel()).tobytes()).decode("ascii")


def decode_mask(code: str, shape: tuple[int, ...]) -> torch.Tensor:
    n = int(np.prod(shape))
    bits = np.unpackbits(np.frombuffer(base64.b64decode(code), dtype=np.uint8), count=n)
    return torch.from_numpy(bits.astype(bool)).reshape(shape)


def apply_entry(ad: Adapter, i: int, entry: dict) -> None:
    """Apply one layer's record entry (already checked)."""
    if "zeroed" in entry:
        for proj, code in entry["zeroed"].items():
            lin = linears(ad, i)[proj]
            with torch.no_grad():
                lin.weight.masked_fill_(decode_mask(code, tuple(lin.weight.shape)).to(lin.weight.device), 0.0)
    if "heads" in entry:
        o = ad.attention(i).o_proj.weight
        keep_heads(ad, i, list(entry["heads"]), _vector(entry.get("heads_bias"), o))
    if "channels" in entry:
        d = ad.mlp(i).down_proj.weight
        keep_channels(ad, i, list(entry["channels"]), _vector(entry.get("channels_bias"), d))


def edits_in_place(entry: dict) -> bool:
    """Whether `apply_entry` changes a layer's existing weights in place (unstructured zeroing) rather than replacing
    its projections by new, sliced ones."""
    return "zeroed" in entry


def finish(model: nn.Module, record: PruneRecord) -> None:
    gone = [i for i, e in record.layers.items() if e.get("heads") == []]
    if gone:
        mark_kv_free(model, gone)  # an attention sub-layer with no head left keeps no KV cache
    model.prune_record = record
    mark_pruned(model)  # model.save_pretrained now writes a pruned checkpoint


def zeroed_count(entries: dict[int, dict], ad: Adapter) -> int:
    total = 0
    for i, e in entries.items():
        for p, code in e.get("zeroed", {}).items():
            total += int(decode_mask(code, tuple(linears(ad, i)[p].weight.shape)).sum())
    return total
