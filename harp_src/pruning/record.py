"""What a baseline removed, per layer (`PruneRecord`, JSON), and how an entry is applied: slicing heads and channels,
adding FLAP's compensation biases, zeroing unstructured weights."""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..method.layers import parse_layer_key
from ..model.adapter import Adapter, check_fingerprint, fingerprint, get_adapter, mark_kv_free
from ..model.modeling_harp import mark_pruned
from ..report.files import check_object, read_json, write_text
from .methods import METHODS, SCOPES
from .slicing import keep_channels, keep_heads, units

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
        for i, entry in self.layers.items():
            _check_record_entry(i, entry)
        if not isinstance(self.meta, dict):
            raise ValueError(f"meta must be a mapping, got {type(self.meta).__name__}")

    def apply(self, model: nn.Module) -> PruneRecord:
        """Prune `model` in place as recorded (refused, with the model unchanged, if it does not fit the record)."""
        found = fingerprint(model.config)
        if found != self.fingerprint:
            diff = {k: (self.fingerprint.get(k), found.get(k)) for k in found if self.fingerprint.get(k) != found[k]}
            raise ValueError(f"this record was made for another model: (record, model) differ in {diff}")
        ad = get_adapter(model)
        for i, entry in self.layers.items():
            _check_entry(ad, i, entry)
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
        if bias is not None and (not isinstance(bias, list) or not all(isinstance(b, (int, float)) for b in bias)):
            raise ValueError(f"layer {i}: {key} must be a list of numbers, got {type(bias).__name__}")
    zeroed = entry.get("zeroed", {})
    if not isinstance(zeroed, dict) or not all(isinstance(c, str) for c in zeroed.values()):
        raise ValueError(f"layer {i}: zeroed must map projections to packed masks (strings)")


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
    if "channels" in entry:
        _check_kept(entry["channels"], u.n_channels, "MLP channels", i)
    for proj in entry.get("zeroed", {}):
        if proj not in ATTENTION_PROJ + MLP_PROJ:
            raise ValueError(f"layer {i}: unknown projection '{proj}' in the record")


def _vector(values, like: torch.Tensor) -> torch.Tensor | None:
    return None if values is None else torch.tensor(values, dtype=torch.float64).to(like)


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
