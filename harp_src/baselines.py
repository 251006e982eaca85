"""Structured-pruning baselines at a parameter budget, written for GQA/MQA: Mag-sp, Wanda-sp, FLAP, LLM-Pruner,
ShortGPT, attention-layer drop, and unstructured Wanda as the contrast.

`prune(model, method, budget_params, calib_windows, scope)` scores units on calibration windows (enwiki train),
chooses what to remove, and really removes it (`slicing`): weights are sliced, a sub-layer left with nothing becomes
a `Constant` and stops using the KV cache. It returns a `PruneRecord`, a JSON-serialisable list of what each layer
keeps, which re-applies to the base model bit for bit.

Methods (units: attention head groups or MQA query heads, and MLP channels; see `slicing`):
- mag-sp: ‖W_out[:, unit]‖₂ of the output projection the unit feeds (o_proj / down_proj). Uniform ratio, no data.
- wanda-sp: Σ_{j ∈ unit} mean_rows |W_out[:, j]| · ‖X_j‖₂. Uniform ratio; layer by layer, each scored on the
  outputs of the already-pruned layers below.
- flap: Σ_{j ∈ unit} Var(X_j) · ‖W_out[:, j]‖² (WIFV), standardised per layer and module, one global ranking; units
  are taken from the bottom of the ranking while they fit the budget, so each costs the parameters it frees.
  Removed inputs' calibration mean is folded into the output bias (W_out[:, removed] · E[X_removed]). Scored in one
  pass on the unpruned model (the global ranking needs every layer's scores before anything is removed).
- llm-pruner: block-wise, first-order Taylor Σ |w · ∂L/∂w| over a unit's weights (q/k/v rows and o columns; gate/up
  rows and down column), L = summed next-token NLL of the calibration windows. Uniform ratio over layers
  [round(4/32·L), L − round(2/32·L)): its Llama-7B defaults (layers 4..29 of 32) scaled to the model's depth.
- shortgpt: remove whole blocks with the lowest block importance BI = 1 − cos(x_in, x_out) (`analysis`).
- attn-drop-top / attn-drop-sim: remove whole attention sub-layers, the top N (= HARP with α = 0) or the N whose
  input and output are most alike (lowest BI of the attention sub-layer, as LLM-Drop).
- wanda: unstructured; in every decoder linear, per output row, the |W|·‖X‖-lowest weights are zeroed (the same
  share in every row), layer by layer. Nothing is removed: dense kernels run as before.

Uniform-ratio methods round the head share per layer: with 3 (SmolLM2) or 4 (Gemma-3) attention units per layer,
a ratio under 1/6 or 1/8 removes no head, and "heads+mlp" then equals "mlp".

Scopes: "heads+mlp" (the methods' original form) or "mlp" (MLP channels only, as the HARP authors' copies of FLAP,
Wanda-sp and Mag-sp run). Block and attention-layer methods have one scope each ("blocks", "attention"); wanda has
"linear".
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from .analysis import layer_metrics
from .evaluate import check_windows
from .files import read_json, write_text
from .harp import HarpPlan, mark_kv_free, param_report, parse_layer_key
from .modeling_harp import mark_pruned
from .models import Adapter, check_fingerprint, fingerprint, get_adapter
from .slicing import Units, attention_is_dense, keep_channels, keep_heads, mlp_is_dense, units

FINE = ("mag-sp", "wanda-sp", "flap", "llm-pruner")
SCOPES: dict[str, tuple[str, ...]] = {
    **{m: ("heads+mlp", "mlp") for m in FINE},
    "shortgpt": ("blocks",),
    "attn-drop-top": ("attention",),
    "attn-drop-sim": ("attention",),
    "wanda": ("linear",),
}
METHODS = tuple(SCOPES)
DATA_FREE = ("mag-sp", "attn-drop-top")
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
        _finish(model, self)
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
            if not isinstance(d, dict):
                raise ValueError(f"a record is a JSON object, got {type(d).__name__}")
            required = ("method", "scope", "budget", "fingerprint", "layers", "params_removed")
            unknown = sorted(set(d) - set(required) - {"weights_zeroed", "meta"})
            missing = [k for k in required if k not in d]
            if unknown or missing:
                raise ValueError(f"a record has the keys {list(required)} (weights_zeroed and meta optional); "
                                 f"unknown {unknown}, missing {missing}")
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


def _linears(ad: Adapter, i: int) -> dict[str, nn.Linear]:
    attn, mlp = ad.attention(i), ad.mlp(i)
    return {**{p: getattr(attn, p) for p in ATTENTION_PROJ}, **{p: getattr(mlp, p) for p in MLP_PROJ}}


def _check_kept(kept, n: int, what: str, i: int) -> None:
    if list(kept) != sorted(set(kept)) or any(not 0 <= k < n for k in kept):
        raise ValueError(f"layer {i}: kept {what} must be distinct sorted indices in 0..{n - 1}")


def _check_entry(ad: Adapter, i: int, entry: dict) -> None:
    ad.check_layer(i)
    if "heads" in entry or "zeroed" in entry:
        if not attention_is_dense(ad, i):
            raise ValueError(f"layer {i}'s attention is already pruned; apply the record to the base model")
    if "channels" in entry or "zeroed" in entry:
        if not mlp_is_dense(ad, i):
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
            lin = _linears(ad, i)[proj]
            with torch.no_grad():
                lin.weight.masked_fill_(decode_mask(code, tuple(lin.weight.shape)).to(lin.weight.device), 0.0)
    if "heads" in entry:
        o = ad.attention(i).o_proj.weight
        keep_heads(ad, i, list(entry["heads"]), _vector(entry.get("heads_bias"), o))
    if "channels" in entry:
        d = ad.mlp(i).down_proj.weight
        keep_channels(ad, i, list(entry["channels"]), _vector(entry.get("channels_bias"), d))


def _finish(model: nn.Module, record: PruneRecord) -> None:
    gone = [i for i, e in record.layers.items() if e.get("heads") == []]
    if gone:
        mark_kv_free(model, gone)  # an attention sub-layer with no head left keeps no KV cache
    model.prune_record = record
    mark_pruned(model)  # model.save_pretrained now writes a pruned checkpoint


# ---------------------------------------------------------------------------------------------- budgets
def budgets(model_or_config, plan: HarpPlan) -> dict[str, int]:
    """The two budgets of a HARP plan (parameters of nn.Linear weights, the paper's convention).

    "harp": what HARP itself removes, N·(Q + K) + #{α = 0}·(V + O).
    "release": all attention weights of the plan's layers, what the authors' release scripts fill with FLAP.
    """
    release = HarpPlan(plan.fingerprint, {i: 0.0 for i in plan.layers}, plan.fold)
    return {"harp": param_report(model_or_config, plan)["removed_paper"],
            "release": param_report(model_or_config, release)["removed_paper"]}


def llm_pruner_layers(n_layers: int) -> list[int]:
    """LLM-Pruner's default layer range (4..29 of Llama-7B's 32), scaled to `n_layers`."""
    return list(range(round(4 / 32 * n_layers), n_layers - round(2 / 32 * n_layers)))


def _scoped_layers(method: str, n_layers: int) -> list[int]:
    return llm_pruner_layers(n_layers) if method == "llm-pruner" else list(range(n_layers))


def _module_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _attention_params(ad: Adapter, i: int) -> int:
    return _module_params(ad.attention(i)) + sum(_module_params(n) for n in ad.attention_norms(i))


def _block_params(ad: Adapter, i: int) -> int:
    return _module_params(ad.layers[i])


def capacity(model: nn.Module, method: str, scope: str) -> int:
    """The most parameters `method` can remove from `model` (weights it can zero, for wanda)."""
    ad = get_adapter(model)
    if method == "shortgpt":
        return sum(_block_params(ad, i) for i in range(ad.n_layers))
    if method.startswith("attn-drop"):
        return sum(_attention_params(ad, i) for i in range(ad.n_layers))
    if method == "wanda":
        return sum(lin.weight.numel() for i in range(ad.n_layers) for lin in _linears(ad, i).values())
    u = units(ad)
    per_layer = u.n_channels * u.channel_params + (u.n_heads * u.head_params if scope == "heads+mlp" else 0)
    return len(_scoped_layers(method, ad.n_layers)) * per_layer


def uniform_counts(u: Units, layers: list[int], budget: int, heads: bool) -> tuple[int, dict[int, int]]:
    """(attention units removed in every layer, {layer: MLP channels removed}) for ≈ `budget` parameters at one
    ratio in every layer: the head count is the ratio rounded (never over budget), channels fill the rest to
    within one channel."""
    n = len(layers)
    per_layer = u.n_channels * u.channel_params + (u.n_heads * u.head_params if heads else 0)
    h = min(round(budget / (n * per_layer) * u.n_heads), u.n_heads) if heads else 0
    while h and n * h * u.head_params > budget:
        h -= 1
    total = min(round((budget - n * h * u.head_params) / u.channel_params), n * u.n_channels)
    base, extra = divmod(total, n)
    return h, {layer: base + (k < extra) for k, layer in enumerate(layers)}


def _closest_count(budget: int, each: int, most: int) -> int:
    return int(min(max(1, round(budget / each)), most))


# ---------------------------------------------------------------------------------------------- calibration
class _Stop(Exception):
    """Raised by a hook to end a calibration forward once the layer of interest has run."""


class _InputStats:
    """Per input column of some Linear modules: Σx, Σx² (float64) and the token count, from forward pre-hooks."""

    def __init__(self, modules: dict[str, nn.Linear]):
        self.sum: dict[str, torch.Tensor] = {}
        self.sq: dict[str, torch.Tensor] = {}
        self.n: dict[str, int] = {}
        self.handles = [m.register_forward_pre_hook(self._hook(k)) for k, m in modules.items()]

    def _hook(self, key: str):
        def hook(mod, args):
            x = args[0].detach().flatten(0, -2).double()
            self.sum[key] = self.sum.get(key, 0) + x.sum(0)
            self.sq[key] = self.sq.get(key, 0) + (x * x).sum(0)
            self.n[key] = self.n.get(key, 0) + x.shape[0]
        return hook

    def norm(self, key: str) -> torch.Tensor:
        return self.sq[key].sqrt()

    def mean(self, key: str) -> torch.Tensor:
        return self.sum[key] / self.n[key]

    def var(self, key: str) -> torch.Tensor:
        return (self.sq[key] / self.n[key] - self.mean(key) ** 2).clamp_min(0)

    def close(self) -> None:
        for h in self.handles:
            h.remove()


@torch.no_grad()
def _calibrate(model: nn.Module, windows: torch.Tensor, modules: dict[str, nn.Linear], batch_size: int,
               stop_at: int | None = None) -> _InputStats:
    """Run the decoder over `windows` (no LM head), collecting input statistics of `modules`; with `stop_at`, each
    forward ends after that layer."""
    ad, device = get_adapter(model), next(model.parameters()).device
    stats = _InputStats(modules)
    stop = None
    if stop_at is not None:
        def halt(mod, args, out):
            raise _Stop
        stop = ad.layers[stop_at].register_forward_hook(halt)
    try:
        for start in range(0, len(windows), batch_size):
            try:
                model.get_decoder()(input_ids=windows[start:start + batch_size].to(device), use_cache=False)
            except _Stop:
                pass
    finally:
        stats.close()
        if stop is not None:
            stop.remove()
    return stats


# ---------------------------------------------------------------------------------------------- unit scores
def _per_unit(columns: torch.Tensor, u: Units) -> torch.Tensor:
    """Column scores of an o_proj input [n_heads·width] summed per attention unit."""
    return columns.view(u.n_heads, u.head_width).sum(1)


def magnitude_scores(ad: Adapter, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(per attention unit, per MLP channel) L2 norm of the output-projection columns each feeds."""
    u = units(ad, i)
    o = ad.attention(i).o_proj.weight.detach().double()
    down = ad.mlp(i).down_proj.weight.detach().double()
    return _per_unit(o.pow(2).sum(0), u).sqrt(), down.norm(dim=0)


def wanda_sp_scores(ad: Adapter, i: int, stats: _InputStats) -> tuple[torch.Tensor, torch.Tensor]:
    """(per attention unit, per MLP channel) Σ_{j ∈ unit} mean over output rows of |W[:, j]|·‖X_j‖₂."""
    o = ad.attention(i).o_proj.weight.detach().double().abs().mean(0) * stats.norm(f"{i}.o_proj")
    down = ad.mlp(i).down_proj.weight.detach().double().abs().mean(0) * stats.norm(f"{i}.down_proj")
    return _per_unit(o, units(ad, i)), down


def fluctuation(lin: nn.Linear, variance: torch.Tensor) -> torch.Tensor:
    """Per input column j: Var(X_j)·‖W[:, j]‖² (FLAP's weighted input feature variance, WIFV)."""
    return lin.weight.detach().double().pow(2).sum(0).cpu() * variance.cpu()


def _taylor(lin: nn.Linear, dim: int) -> torch.Tensor:
    """Σ |w·∂L/∂w| over dimension `dim` of the weight (rows: dim=1, columns: dim=0), bias included for rows."""
    out = (lin.weight.detach() * lin.weight.grad).double().abs().sum(dim)
    if dim == 1 and lin.bias is not None:
        out = out + (lin.bias.detach() * lin.bias.grad).double().abs()
    return out


def taylor_scores(ad: Adapter, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(per attention unit, per MLP channel) Σ |w·g| over the unit's weights, from gradients already accumulated."""
    u, attn, mlp = units(ad, i), ad.attention(i), ad.mlp(i)
    heads = _per_unit(_taylor(attn.q_proj, 1) + _taylor(attn.o_proj, 0), u)
    if u.grouped:
        kv = _taylor(attn.k_proj, 1) + _taylor(attn.v_proj, 1)
        heads = heads + kv.view(u.n_heads, ad.head_dim).sum(1)
    channels = _taylor(mlp.gate_proj, 1) + _taylor(mlp.up_proj, 1) + _taylor(mlp.down_proj, 0)
    return heads, channels


def _accumulate_gradients(model: nn.Module, windows: torch.Tensor, layers: list[int], batch_size: int,
                          progress: bool) -> list[nn.Parameter]:
    """∂(summed next-token NLL)/∂w for the linears of `layers` (other parameters frozen meanwhile)."""
    ad, device = get_adapter(model), next(model.parameters()).device
    params = [p for i in layers for lin in _linears(ad, i).values() for p in lin.parameters()]
    flags = {p: p.requires_grad for p in model.parameters()}
    for p in model.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
        p.grad = None
    try:
        for start in tqdm(range(0, len(windows), batch_size), desc="llm-pruner gradients", disable=not progress,
                          leave=False):
            ids = windows[start:start + batch_size].to(device)
            logits = model(input_ids=ids, use_cache=False).logits
            F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten(), reduction="sum").backward()
    finally:
        for p, flag in flags.items():
            p.requires_grad_(flag)
    return params


# ---------------------------------------------------------------------------------------------- selection
def lowest(scores: torch.Tensor, k: int) -> list[int]:
    """Indices of the k lowest scores (ties: the lower index first)."""
    order = torch.sort(scores, stable=True).indices
    return sorted(order[:k].tolist())


def _kept(n: int, removed: Iterable[int]) -> list[int]:
    gone = set(removed)
    return [j for j in range(n) if j not in gone]


def standardise(scores: torch.Tensor) -> torch.Tensor:
    """(s − mean) / std over one layer's units of one module (0 where all are equal)."""
    std = scores.std(unbiased=False)
    return torch.zeros_like(scores) if std == 0 else (scores - scores.mean()) / std


def global_take(candidates: list[tuple[float, int, str, int]], costs: dict[str, int], budget: int) -> list:
    """FLAP's global selection: walk the units from the lowest score up, taking each that still fits the budget.

    Args:
        candidates: (score, layer, kind, unit) with kind "heads" or "channels".
        costs: parameters one unit of each kind frees.
    Returns:
        The taken candidates; their cost is within one channel of `budget`.
    """
    taken, spent = [], 0
    for c in sorted(candidates):
        cost = costs[c[2]]
        if spent + cost <= budget:
            taken.append(c)
            spent += cost
    return taken


def compensation(weight: torch.Tensor, mean: torch.Tensor, removed: list[int]) -> list[float] | None:
    """W[:, removed] · E[X_removed]: what the removed inputs added on average (FLAP's bias compensation)."""
    if not removed:
        return None
    idx = torch.tensor(removed, dtype=torch.long)
    return (weight.detach().double().cpu()[:, idx] @ mean.cpu()[idx]).tolist()


def _new_bias_params(ad: Adapter, i: int, kind: str) -> int:
    """Parameters a compensation bias adds to layer i's o_proj ("heads") or down_proj ("channels")."""
    lin = ad.attention(i).o_proj if kind == "heads" else ad.mlp(i).down_proj
    return 0 if lin.bias is not None else lin.out_features


def _flap_entries(ad: Adapter, stats: _InputStats, budget: int, heads: bool) -> dict[int, dict]:
    u = units(ad)
    candidates = []
    for i in range(ad.n_layers):
        chan_s = fluctuation(ad.mlp(i).down_proj, stats.var(f"{i}.down_proj"))
        candidates += [(float(s), i, "channels", j) for j, s in enumerate(standardise(chan_s))]
        if heads:
            head_s = _per_unit(fluctuation(ad.attention(i).o_proj, stats.var(f"{i}.o_proj")), u)
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
        entry = {"channels": _kept(u.n_channels, gone_c),
                 "channels_bias": compensation(ad.mlp(i).down_proj.weight, stats.mean(f"{i}.down_proj"), gone_c)}
        if heads:
            gone_h = sorted(c[3] for c in taken if c[1] == i and c[2] == "heads")
            cols = [gone * u.head_width + w for gone in gone_h for w in range(u.head_width)]
            entry |= {"heads": _kept(u.n_heads, gone_h),
                      "heads_bias": compensation(ad.attention(i).o_proj.weight, stats.mean(f"{i}.o_proj"), cols)}
        entries[i] = {k: v for k, v in entry.items() if v is not None}
    return entries


def _uniform_entry(u: Units, scores: tuple[torch.Tensor, torch.Tensor], n_heads: int, n_channels: int,
                   heads: bool) -> dict:
    entry = {"channels": _kept(u.n_channels, lowest(scores[1], n_channels))}
    if heads:
        entry["heads"] = _kept(u.n_heads, lowest(scores[0], n_heads))
    return entry


def _row_counts(total: int, rows: int) -> torch.Tensor:
    base, extra = divmod(total, rows)
    return torch.full((rows,), base, dtype=torch.long) + (torch.arange(rows) < extra)


def _matrix_counts(sizes: dict[tuple[int, str], int], total: int) -> dict[tuple[int, str], int]:
    """Split `total` over matrices in proportion to their sizes (largest remainder), so the sum is exact."""
    all_w = sum(sizes.values())
    exact = {k: total * n / all_w for k, n in sizes.items()}
    counts = {k: int(v) for k, v in exact.items()}
    for k in sorted(exact, key=lambda k: counts[k] - exact[k])[: total - sum(counts.values())]:
        counts[k] += 1
    return counts


def wanda_mask(weight: torch.Tensor, norms: torch.Tensor, per_row: torch.Tensor) -> torch.Tensor:
    """True for the per_row[r] lowest |W[r, j]|·‖X_j‖ of each row r."""
    score = weight.detach().double().abs().cpu() * norms.cpu()[None, :]
    order = torch.sort(score, dim=1, stable=True).indices
    rank_ok = torch.arange(weight.shape[1])[None, :] < per_row[:, None]
    return torch.zeros_like(rank_ok).scatter_(1, order, rank_ok)


# ---------------------------------------------------------------------------------------------- methods
def _sequential(model, windows, batch_size, progress, desc, layer_entry) -> dict[int, dict]:
    """Layer by layer from the bottom: calibrate layer i on the already-pruned layers below, prune it."""
    ad = get_adapter(model)
    entries = {}
    for i in tqdm(range(ad.n_layers), desc=desc, disable=not progress, leave=False):
        lin = _linears(ad, i)
        watched = {f"{i}.{p}": lin[p] for p in ("q_proj", "o_proj", "gate_proj", "down_proj")}
        stats = _calibrate(model, windows, watched, batch_size, stop_at=i)
        entries[i] = layer_entry(i, stats)
        apply_entry(ad, i, entries[i])
    return entries


def _wanda_entries(model, windows, budget, batch_size, progress) -> dict[int, dict]:
    ad = get_adapter(model)
    sizes = {(i, p): lin.weight.numel() for i in range(ad.n_layers) for p, lin in _linears(ad, i).items()}
    counts = _matrix_counts(sizes, budget)
    reads = {"q_proj": "q_proj", "k_proj": "q_proj", "v_proj": "q_proj", "o_proj": "o_proj",
             "gate_proj": "gate_proj", "up_proj": "gate_proj", "down_proj": "down_proj"}  # shared inputs

    def entry(i, stats):
        zeroed = {}
        for p, lin in _linears(ad, i).items():
            per_row = _row_counts(counts[(i, p)], lin.weight.shape[0])
            zeroed[p] = encode_mask(wanda_mask(lin.weight, stats.norm(f"{i}.{reads[p]}"), per_row))
        return {"zeroed": zeroed}

    return _sequential(model, windows, batch_size, progress, "wanda", entry)


def _entries(model, method: str, scope: str, budget: int, windows, batch_size: int, progress: bool
             ) -> tuple[dict[int, dict], bool]:
    """The record entries of `method`, and whether they are already applied to `model` (layer-sequential ones)."""
    ad = get_adapter(model)
    u, heads = units(ad), scope == "heads+mlp"
    if method == "shortgpt":
        bi = layer_metrics(model, windows, "calib", batch_size, entropy=False)
        bi = bi[bi.metric == "bi_block"].set_index("layer").value
        n = _closest_count(budget, _block_params(ad, 0), ad.n_layers)
        return {i: {"heads": [], "channels": []} for i in sorted(bi.nsmallest(n).index.tolist())}, False
    if method.startswith("attn-drop"):
        n = _closest_count(budget, _attention_params(ad, 0), ad.n_layers)
        if method == "attn-drop-top":
            chosen = list(range(ad.n_layers - n, ad.n_layers))
        else:
            bi = layer_metrics(model, windows, "calib", batch_size, entropy=False)
            chosen = bi[bi.metric == "bi_attn"].set_index("layer").value.nsmallest(n).index.tolist()
        return {i: {"heads": []} for i in sorted(chosen)}, False
    if method == "wanda":
        return _wanda_entries(model, windows, budget, batch_size, progress), True
    if method == "flap":
        watched = {f"{i}.down_proj": ad.mlp(i).down_proj for i in range(ad.n_layers)}
        if heads:
            watched |= {f"{i}.o_proj": ad.attention(i).o_proj for i in range(ad.n_layers)}
        stats = _calibrate(model, windows, watched, batch_size)
        return _flap_entries(ad, stats, budget, heads), False
    layers = _scoped_layers(method, ad.n_layers)
    n_heads, n_channels = uniform_counts(u, layers, budget, heads)
    if method == "mag-sp":
        return {i: _uniform_entry(u, magnitude_scores(ad, i), n_heads, n_channels[i], heads) for i in layers}, False
    if method == "llm-pruner":
        _accumulate_gradients(model, windows, layers, batch_size, progress)
        entries = {i: _uniform_entry(u, taylor_scores(ad, i), n_heads, n_channels[i], heads) for i in layers}
        model.zero_grad(set_to_none=True)
        return entries, False

    def entry(i, stats):  # wanda-sp
        return _uniform_entry(u, wanda_sp_scores(ad, i, stats), n_heads, n_channels[i], heads)

    return _sequential(model, windows, batch_size, progress, "wanda-sp", entry), True


def _check_call(model, method: str, scope: str | None, budget_params, calib_windows) -> str:
    if method not in SCOPES:
        raise ValueError(f"unknown method '{method}'; choose one of {', '.join(METHODS)}")
    scope = scope or SCOPES[method][0]
    if scope not in SCOPES[method]:
        raise ValueError(f"method '{method}' has no scope '{scope}'; valid: {', '.join(SCOPES[method])}")
    if isinstance(budget_params, bool) or not isinstance(budget_params, (int, np.integer)) or budget_params <= 0:
        raise ValueError(f"budget_params must be a positive number of parameters, got {budget_params!r}")
    ad = get_adapter(model)
    needs = {"heads+mlp": (True, True), "mlp": (False, True), "blocks": (True, True), "attention": (True, False),
             "linear": (True, True)}[scope]
    for i in _scoped_layers(method, ad.n_layers):
        if (needs[0] and not attention_is_dense(ad, i)) or (needs[1] and not mlp_is_dense(ad, i)):
            raise ValueError(f"layer {i} is already pruned; {method} (scope {scope}) needs the unpruned layers")
    if method not in DATA_FREE:
        if calib_windows is None or len(calib_windows) == 0:
            raise ValueError(f"{method} scores units on calibration data: pass calib_windows, e.g. "
                             "data.ppl_windows(tok, 'enwiki', 'train', n_windows=8)")
        check_windows(model, calib_windows)
    most = capacity(model, method, scope)
    if budget_params > most:
        raise ValueError(f"a budget of {budget_params:,} parameters exceeds the {most:,} that {method} "
                         f"(scope {scope}) can remove from this model; choose a smaller budget")
    return scope


def _windows_meta(windows) -> dict:
    if windows is None:
        return {}
    arr = np.ascontiguousarray(windows.cpu().numpy())
    return {"calib_windows": list(arr.shape), "calib_sha256": hashlib.sha256(arr.tobytes()).hexdigest()}


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def prune(model: nn.Module, method: str, budget_params: int, calib_windows: torch.Tensor | None = None,
          scope: str | None = None, batch_size: int = 2, progress: bool = True) -> PruneRecord:
    """Prune `model` in place with a baseline method at a parameter budget.

    Args:
        model: a loaded causal LM of a supported family, unpruned where the method prunes.
        method: one of METHODS.
        budget_params: parameters to remove (weights to zero, for "wanda"); see `budgets` for HARP's two budgets.
        calib_windows: [n, T] token windows from calibration text (enwiki train) for the data-driven methods.
        scope: "heads+mlp" (default) or "mlp" for the fine-grained methods; the others have one scope.
    Returns:
        The PruneRecord (`model.prune_record`); `params_removed` is the model's real parameter drop.
    """
    scope = _check_call(model, method, scope, budget_params, calib_windows)
    before = n_params(model)
    was_training = model.training
    model.eval()
    try:
        entries, applied = _entries(model, method, scope, int(budget_params), calib_windows, batch_size, progress)
    finally:
        model.train(was_training)
    ad = get_adapter(model)
    if not applied:
        for i in sorted(entries):
            apply_entry(ad, i, entries[i])
    zeroed = _zeroed(entries, ad)
    record = PruneRecord(method, scope, int(budget_params), fingerprint(model.config), entries,
                         before - n_params(model), zeroed, _windows_meta(calib_windows))
    _finish(model, record)
    return record


def _zeroed(entries: dict[int, dict], ad: Adapter) -> int:
    total = 0
    for i, e in entries.items():
        for p, code in e.get("zeroed", {}).items():
            total += int(decode_mask(code, tuple(_linears(ad, i)[p].weight.shape)).sum())
    return total
