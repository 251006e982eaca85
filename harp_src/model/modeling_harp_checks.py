"""What a pruned checkpoint's config.json must say before its weights are believed.

Its module structure (`harp_structure`) is checked against the dense model of its config and against its plan
(`harp_plan`): every entry is well formed and names a module of that model, a bypass sits in place of an attention
with the `layer_idx` of its position, its mixing and α are the plan's, the plan's bypassed layers are exactly the
structure's, and a baseline record's kept heads and channels are the widths the structure declares. After the weights
load, each bypass's α is checked against the α its weights were folded at (`folded_alpha`, stored beside them).

Like modeling_harp.py, which imports it, this file imports only torch and transformers and travels inside every pruned
checkpoint, so plain `from_pretrained(..., trust_remote_code=True)` refuses what `harp_src.load_model` refuses. Layers
are told apart by their attention modules' own `layer_idx`, and sub-modules by the names every supported family shares
(`mlp`, `o_proj`, `v_proj`, `down_proj`), so no family's layout is needed here.
"""

from __future__ import annotations

import torch
from torch import nn

STRUCTURE = "harp_structure"  # config.json key: the modules that differ from the dense model
PLAN = "harp_plan"  # config.json key: how the model was pruned ({"harp": plan} and/or {"baseline": record})
MIXINGS = ("identity", "mean")  # the bypass's fixed attention matrix: A = I, or the uniform causal average
FOLDED = "folded_alpha"  # a bypass's buffer: the α its weights were built with, saved with them
FORMAT = "harp_format"  # config.json key: 2 from when every bypass saves its `folded_alpha` (absent before)
TOLERANCE = 2.0 ** -7  # relative: α survives a round trip through bf16 (8 significant bits) within it
NUMBER = (int, float)
FIELDS = {  # the fields each kind of entry must carry, and their types
    "bypass": {"v_proj": list, "o_proj": list, "head_dim": int, "n_rep": int},
    "dropped": {},
    "identity": {},
    "constant": {"hidden": int, "attention": bool, "has_value": bool},
    "scaled": {"scale": NUMBER},
    "keep": {"heads": list, "alpha": NUMBER, "fold": bool},
    "linear": {"shape": list},
    "attributes": {"values": dict},
}
HARP_KINDS = ("bypass", "dropped", "scaled", "keep")
BYPASSED = ("bypass", "dropped", "keep")  # the kinds an attention takes in a layer the HARP plan prunes


def is_number(value) -> bool:
    return isinstance(value, NUMBER) and not isinstance(value, bool)


def is_linear(spec) -> bool:
    """Whether a structure entry's Linear shape is [out, in, has bias]."""
    return (isinstance(spec, list) and len(spec) == 3 and all(isinstance(n, int) and not isinstance(n, bool) and n > 0
                                                              for n in spec[:2]) and isinstance(spec[2], bool))


def shape(lin: nn.Module) -> list:
    """[out, in, has bias]: how the structure writes a Linear."""
    return [lin.out_features, lin.in_features, lin.bias is not None]


class Layout:
    """Where each layer's modules sit in the dense model of a config, found from the attention modules' `layer_idx`."""

    def __init__(self, dense: nn.Module):
        self.modules = dict(dense.named_modules())
        self.attention = {path: m.layer_idx for path, m in self.modules.items()
                          if hasattr(m, "o_proj") and isinstance(getattr(m, "layer_idx", None), int)}
        self.of_layer = {i: path for path, i in self.attention.items()}
        self.prefix = {i: path.rpartition(".")[0] for path, i in self.attention.items()}

    def layer(self, path: str) -> int | None:
        """The layer a module path belongs to (None outside the decoder layers)."""
        return next((i for i, prefix in self.prefix.items() if path.startswith(prefix + ".")), None)


# ---------------------------------------------------------------------------------------------- each entry alone
def entry_problem(entry, layout: Layout) -> str | None:
    """What is wrong with one structure entry by itself (its form, its module, a bypass's fit), or None."""
    if not isinstance(entry, dict) or not isinstance(entry.get("path"), str):
        return "an entry of the structure that is not a module entry with a 'path'"
    path, kind = entry["path"], entry.get("kind")
    if kind not in FIELDS:
        return f"{path}: unknown kind {kind!r} (written by a newer version? update modeling_harp.py)"
    for key, kind_type in FIELDS[kind].items():
        value = entry.get(key)
        if not isinstance(value, kind_type) or (isinstance(value, bool) and kind_type is not bool):
            return f"{path}: its {key} is {value!r}, which a {kind} entry cannot have"
    shapes = [entry[key] for key in ("v_proj", "o_proj", "shape") if key in FIELDS[kind]]
    if not all(is_linear(spec) for spec in shapes):
        return f"{path}: a Linear's shape is not [out, in, has bias] (two whole numbers and true or false)"
    if path not in layout.modules:
        return f"{path}: no module of the dense model of this config has that path"
    if kind in BYPASSED and path not in layout.attention:
        return f"{path}: a {kind} attention in place of a module that is not an attention"
    if kind == "constant" and entry["attention"] != (path in layout.attention):
        return f"{path}: its attention flag is {entry['attention']}, but the module is {'not ' * entry['attention']}" \
               "an attention"
    if kind == "keep":
        return keep_problem(entry, layout)
    return bypass_problem(entry, layout) if kind == "bypass" else None


def keep_problem(entry: dict, layout: Layout) -> str | None:
    """A kept-heads entry must name distinct query heads of its attention, in order, an α in [0, 1], its layer and a
    known mixing."""
    path, dense, heads = entry["path"], layout.modules[entry["path"]], entry["heads"]
    n_heads = dense.q_proj.out_features // dense.head_dim
    if not heads or heads != sorted(set(heads)) or not all(
            isinstance(h, int) and not isinstance(h, bool) and 0 <= h < n_heads for h in heads):
        return f"{path}: its kept heads {heads!r} are not distinct ascending query heads of 0..{n_heads - 1}"
    if not 0 <= entry["alpha"] <= 1:
        return f"{path}: its alpha is {entry['alpha']!r}, not a number in [0, 1]"
    if entry.get("layer_idx") != layout.attention[path]:
        return f"{path}: its layer_idx is {entry.get('layer_idx')!r}, but it is the attention of layer " \
               f"{layout.attention[path]}"
    if entry.get("mixing", "identity") not in MIXINGS:
        return f"{path}: its mixing is {entry['mixing']!r}; known are {list(MIXINGS)}"
    return None


def bypass_problem(entry: dict, layout: Layout) -> str | None:
    """A bypass entry must fit the attention it replaces: its mixing, layer_idx, projections and α."""
    path, dense = entry["path"], layout.modules[entry["path"]]
    mixing, idx = entry.get("mixing", "identity"), entry.get("layer_idx")
    if mixing not in MIXINGS:
        return f"{path}: its mixing is {mixing!r}; known are {list(MIXINGS)}"
    if mixing == "mean" and idx is None:
        return f"{path}: a mean bypass without the layer_idx of its running sums' cache slot"
    if idx is not None and idx != layout.attention[path]:
        return f"{path}: its layer_idx is {idx!r}, but it is the attention of layer {layout.attention[path]}"
    v, o, n_rep = entry["v_proj"], entry["o_proj"], entry["n_rep"]
    if v != shape(dense.v_proj):
        return f"{path}: its v_proj is {v} in the structure, but the model's is {shape(dense.v_proj)}"
    groups = getattr(dense, "num_key_value_groups", 1)
    expected = [dense.o_proj.out_features, v[0] * n_rep, dense.o_proj.bias is not None]
    if n_rep not in (1, groups) or o != expected:
        return f"{path}: its o_proj {o} with n_rep {n_rep} does not fit its v_proj {v} (expected {expected})"
    alpha, scale = entry.get("alpha"), entry.get("scale")
    if not is_number(alpha) or not 0 < alpha <= 1:
        return f"{path}: its alpha is {alpha!r}, not a number in (0, 1]"
    if scale is not None and scale != alpha:
        return f"{path}: its scale is {scale!r}, but its alpha {alpha!r}"
    return None


# ---------------------------------------------------------------------------------------------- against the plan
def harp_problem(structure: list[dict], harp, layout: Layout) -> str | None:
    """The HARP plan and the structure must bypass the same layers, with the same α, mixing and folding."""
    entries = {layout.attention[e["path"]]: e for e in structure if e["kind"] in BYPASSED}
    scaled = {layout.layer(e["path"]): e for e in structure if e["kind"] == "scaled"}
    if harp is None:
        first = next(iter(sorted(entries.items()) or scaled.items()), None)
        return None if first is None else (f"{first[1]['path']}: the structure makes it a {first[1]['kind']} "
                                           "module, but no HARP plan names its layer")
    alphas = harp.get("alphas") if isinstance(harp, dict) else None
    if not isinstance(alphas, dict) or not all(isinstance(k, str) and k.isdigit() for k in alphas):
        return "its HARP plan has no {layer: α} alphas"
    alphas = {int(k): a for k, a in alphas.items()}
    bypass, fold, keep = harp.get("bypass", "identity"), harp.get("fold", True), harp.get("keep_heads") or {}
    if not isinstance(keep, dict):
        return "its HARP plan's keep_heads is not a {layer: [query head, ...]} mapping"
    lost = next((k for k in keep if not isinstance(k, str) or not k.isdigit()
                 or entries.get(int(k), {}).get("kind") != "keep"), None)
    if lost is not None:
        return f"layer {lost}: the plan keeps heads {keep[lost]!r} there, but the structure keeps no head in it"
    for i in sorted(set(alphas) | set(entries)):
        a, e = alphas.get(i), entries.get(i)
        if e is None:
            return f"{layout.of_layer.get(i, f'layer {i}')}: the plan bypasses it (α {a!r}), the structure keeps it"
        if a is None:
            return f"{e['path']}: the structure makes it a {e['kind']} module, the plan leaves layer {i} unpruned"
        if e["kind"] != "keep" and (a == 0) != (e["kind"] == "dropped"):
            return f"{e['path']}: its α is {a!r} by the plan, but the structure makes it a {e['kind']} module"
        problem = bypass_plan_problem(e, a, bypass, fold) if e["kind"] == "bypass" else \
            keep_plan_problem(e, a, keep.get(str(i)), bypass, fold) if e["kind"] == "keep" else None
        if problem:
            return problem
    wrong = next((e for i, e in scaled.items() if e["scale"] != alphas.get(i)), None)
    if wrong is not None:
        return f"{wrong['path']}: its scale is {wrong['scale']!r}, but the plan's α for its layer is " \
               f"{alphas.get(layout.layer(wrong['path']))!r}"
    return None


def bypass_plan_problem(entry: dict, alpha, bypass: str, fold) -> str | None:
    path, mixing = entry["path"], entry.get("mixing", "identity")
    if entry["alpha"] != alpha:
        return f"{path}: its alpha is {alpha!r} by the plan but {entry['alpha']!r} in the structure"
    if mixing != bypass:
        return f"{path}: its mixing is {bypass!r} by the plan but {mixing!r} in the structure"
    if fold and (entry["n_rep"] != 1 or entry.get("scale") is not None):
        return f"{path}: the plan folds α and the KV-head repeat into the weights, the structure does not"
    return None


def keep_plan_problem(entry: dict, alpha, heads, bypass: str, fold) -> str | None:
    path, mixing = entry["path"], entry.get("mixing", "identity")
    if heads != entry["heads"]:
        said = "no head" if heads is None else f"heads {heads!r}"
        return f"{path}: the plan keeps {said} in its layer, the structure keeps heads {entry['heads']!r}"
    if entry["alpha"] != alpha or entry["fold"] != fold:
        return f"{path}: its alpha and fold are {entry['alpha']!r}, {entry['fold']!r} in the structure but " \
               f"{alpha!r}, {fold!r} by the plan"
    if mixing != bypass:
        return f"{path}: its mixing is {bypass!r} by the plan but {mixing!r} in the structure"
    return None


def record_problem(structure: list[dict], record, layout: Layout, config) -> str | None:
    """A baseline record and the structure must change the same layers, to the widths the record keeps (HARP's
    entries are the plan's, checked before: its bypasses, and the norms of the attention it drops)."""
    layers = record.get("layers") if isinstance(record, dict) else None
    if record is not None and (not isinstance(layers, dict) or not all(
            isinstance(k, str) and k.isdigit() and isinstance(e, dict) for k, e in layers.items())):
        return "its baseline record has no {layer: entry} layers"
    named = {int(k): e for k, e in (layers or {}).items()}
    harp_dropped = {layout.attention[e["path"]] for e in structure if e["kind"] == "dropped"}
    for e in structure:
        i = layout.layer(e["path"])
        own = e["kind"] in HARP_KINDS or (e["kind"] == "identity" and i in harp_dropped)
        if not own and i not in named:
            return f"{e['path']}: the structure makes it a {e['kind']} module, but no plan prunes its layer"
    by_path = {e["path"]: e for e in structure}
    for i, entry in sorted(named.items()):
        if i not in layout.prefix:
            return f"layer {i}: the baseline record names it, but the model has layers 0..{len(layout.prefix) - 1}"
        problem = kept_problem(entry, i, layout, by_path, config)
        if problem:
            return f"layer {i}: {problem}"
    return None


def kept_problem(entry: dict, i: int, layout: Layout, by_path: dict, config) -> str | None:
    """Whether the structure keeps as many attention units and MLP channels in layer i as the record does."""
    attention, prefix = layout.of_layer[i], layout.prefix[i]
    n_kv, n_heads = config.num_key_value_heads, config.num_attention_heads
    unit = layout.modules[attention].o_proj.in_features // (n_kv if n_kv > 1 else n_heads)
    for key, sub, proj, per in (("heads", attention, "o_proj", unit), ("channels", f"{prefix}.mlp", "down_proj", 1)):
        if key not in entry:
            continue
        kept = len(entry[key]) if isinstance(entry[key], list) else -1
        gone = by_path.get(sub, {}).get("kind") == "constant"
        if kept == 0 or gone:
            if kept != 0 or not gone:
                return f"the record keeps {kept} {key}, but the structure makes {sub} a " \
                       f"{by_path.get(sub, {}).get('kind', 'dense')} module"
            continue
        declared = by_path.get(f"{sub}.{proj}", {}).get("shape") or shape(layout.modules[f"{sub}.{proj}"])
        if declared[1] != kept * per:
            return f"{sub}.{proj} reads {declared[1]} inputs in the structure, but the record keeps {kept} {key} " \
                   f"({kept * per} inputs)"
    return None


def first_problem(config, dense: nn.Module) -> str | None:
    """The first thing about a config's structure and plan that does not hold, in words; None when all do.

    Args:
        config: the checkpoint's config (with `harp_structure` and `harp_plan`); dense: the dense model it
            describes (on the meta device).
    """
    structure, plans = getattr(config, STRUCTURE, None) or [], getattr(config, PLAN, None) or {}
    if not isinstance(structure, list):
        return f"its {STRUCTURE} is not a list of module entries"
    if not isinstance(plans, dict):
        return f"its {PLAN} is not a mapping of plans"
    layout = Layout(dense)
    for entry in structure:
        problem = entry_problem(entry, layout)
        if problem:
            return problem
    if structure and not plans:
        return f"its {STRUCTURE} prunes modules, but it carries no {PLAN} that says how"
    return (harp_problem(structure, plans.get("harp"), layout)
            or record_problem(structure, plans.get("baseline"), layout, config))


def folded_problem(model: nn.Module, unrecorded: set[str]) -> str | None:
    """After loading: the first bypass whose α (config.json) differs from the α its weights were folded at, or None.
    The two may differ by the rounding of the dtype the checkpoint was saved in (`TOLERANCE`: a bf16 checkpoint
    loaded in float32 holds 0.30078125 for 0.3). Buffers in `unrecorded` (checkpoints written before α was stored
    with the weights) are set from config.json."""
    for path, module in model.named_modules():
        folded = getattr(module, FOLDED, None)
        if not isinstance(folded, torch.Tensor):
            continue
        if f"{path}.{FOLDED}" in unrecorded:
            with torch.no_grad():
                folded.fill_(module.alpha)
        elif abs(folded.item() - module.alpha) > TOLERANCE * abs(module.alpha):
            return f"{path}: its alpha is {module.alpha!r} in config.json, but its weights were folded at " \
                   f"{folded.item():.4g}"
    return None
