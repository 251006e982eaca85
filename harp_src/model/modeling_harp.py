"""The modules a pruned model is made of, and the model classes that rebuild a pruned checkpoint.

This file imports only torch and transformers. It is the one definition of HARP's bypass and dropped attention
(and of the baselines' constant sub-layers): the library uses it, and `save_pretrained` copies this very file into
every pruned checkpoint, whose config.json points `AutoModelForCausalLM` at it (`auto_map`). So
`AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)` works where this repository is not installed.

A checkpoint carries its structure in config.json (`harp_structure`): one entry per module that differs from the
dense model the config describes, keyed by its module path (as `named_modules` gives it). The entries are written by
walking the pruned model (`describe`), so this file needs no knowledge of any family's layout.
"""

from __future__ import annotations

import copy
import json
import shutil
import warnings
from pathlib import Path

import torch
from torch import nn
from transformers import (
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    LlamaForCausalLM,
    MistralForCausalLM,
    PretrainedConfig,
    Qwen2ForCausalLM,
)

from .modeling_harp_checks import FOLDED, FORMAT, MIXINGS, PLAN, STRUCTURE, first_problem, folded_problem
from .modeling_harp_keep import keep_heads_attention
from .modeling_harp_mean import causal_mean, mean_state, real_tokens

ATTRIBUTES = ("num_heads", "num_key_value_heads", "num_key_value_groups")  # head counts attention modules read


def repeat_heads(v: torch.Tensor, head_dim: int, n_rep: int) -> torch.Tensor:
    """[..., kv·hd] -> [..., kv·n_rep·hd]; query head g reads KV head g // n_rep, as `repeat_kv` does."""
    if n_rep == 1:
        return v
    return v.unflatten(-1, (-1, head_dim)).repeat_interleave(n_rep, dim=-2).flatten(-2)


class BypassAttention(nn.Module):
    """Attention with a fixed attention matrix: the identity (each token mixed only with itself; `mixing="identity"`)
    or the uniform causal average (each token reads the mean value of the positions up to it; `mixing="mean"`,
    whose decoding state is a running sum per layer, see `modeling_harp_mean.RunningMean`).

    `n_rep > 1` repeats KV heads before o_proj (unfolded form); folded, o_proj already sums the repeated
    heads and `n_rep == 1`. `scale` is α when it is not folded into the weights. `alpha` is the layer's α wherever
    it went (here, into o_proj or into Gemma's output norm): folded weights cannot show it, so it is also kept as
    the buffer `folded_alpha`, saved with the weights, and a checkpoint's config is checked against it. `layer_idx`
    names the layer's cache slot (the mean's running sum).
    """

    harp_kind = "bypass"  # how `describe` recognises it, also as a class from a checkpoint's copy of this file

    def __init__(self, v_proj: nn.Linear, o_proj: nn.Linear, head_dim: int, n_rep: int, scale: float | None,
                 alpha: float | None = None, *, mixing: str = "identity", layer_idx: int | None = None):
        super().__init__()
        if mixing not in MIXINGS:
            raise ValueError(f"unknown bypass {mixing!r}: choose one of {list(MIXINGS)}")
        self.v_proj, self.o_proj = v_proj, o_proj
        self.head_dim, self.n_rep, self.scale, self.alpha = head_dim, n_rep, scale, alpha
        self.mixing, self.layer_idx = mixing, layer_idx
        if alpha is not None:
            weight = o_proj.weight
            self.register_buffer(FOLDED, torch.tensor(float(alpha), dtype=weight.dtype, device=weight.device))

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, None]:
        v = self.v_proj(hidden_states)
        if self.mixing == "mean":
            cache = kwargs.get("cache", kwargs.get("past_key_values"))
            real = real_tokens(kwargs.get("attention_mask"), v.shape[1])
            v = causal_mean(v, real, mean_state(cache, self.layer_idx))
        out = self.o_proj(repeat_heads(v, self.head_dim, self.n_rep))
        if self.scale is not None:
            out = out * self.scale
        return out, None  # no attention weights exist: output_attentions cannot bring attention back

    def extra_repr(self) -> str:
        return f"n_rep={self.n_rep}, scale={self.scale}, alpha={self.alpha}, mixing={self.mixing}"


class DroppedAttention(nn.Module):
    """α = 0: the attention sub-layer is gone; it adds nothing to the residual stream."""

    harp_kind = "dropped"

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, None]:
        return torch.zeros_like(hidden_states), None


class Scaled(nn.Module):
    """Multiply a module's output by α (Gemma's unfolded form: α after the post-attention norm)."""

    harp_kind = "scaled"

    def __init__(self, inner: nn.Module, scale: float):
        super().__init__()
        self.inner, self.scale = inner, scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) * self.scale


class Constant(nn.Module):
    """A sub-layer pruned to nothing: it adds the same vector to every token (zeros when nothing is left).

    `attention=True` returns (out, None) as attention modules do.
    """

    harp_kind = "constant"

    def __init__(self, value: torch.Tensor | None, hidden: int, attention: bool):
        super().__init__()
        self.attention, self.hidden = attention, hidden
        self.value = None if value is None else nn.Parameter(value.detach().clone(), requires_grad=False)

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        out = torch.zeros_like(hidden_states) if self.value is None else self.value.expand_as(hidden_states)
        return (out, None) if self.attention else out

    def extra_repr(self) -> str:
        return f"attention={self.attention}, constant={'none' if self.value is None else 'bias'}"


# ---------------------------------------------------------------------------------------------- structure
def _linear(lin: nn.Linear) -> list:
    return [lin.out_features, lin.in_features, lin.bias is not None]


def kind_of(module: nn.Module) -> str | None:
    """"bypass", "dropped", "constant", "scaled", "keep" for this file's modules (whichever copy of the file
    defined them), "identity" for a removed norm, None for an ordinary module."""
    return "identity" if isinstance(module, nn.Identity) else getattr(module, "harp_kind", None)


def _entry(path: str, module: nn.Module) -> dict | None:
    """The structure entry of a replaced module, or None for an ordinary one."""
    kind = kind_of(module)
    if kind == "bypass":
        mean = {} if module.mixing == "identity" else dict(mixing=module.mixing, layer_idx=module.layer_idx)
        return dict(path=path, kind=kind, v_proj=_linear(module.v_proj), o_proj=_linear(module.o_proj),
                    head_dim=module.head_dim, n_rep=module.n_rep, scale=module.scale, alpha=module.alpha, **mean)
    if kind == "constant":
        return dict(path=path, kind=kind, hidden=module.hidden, attention=module.attention,
                    has_value=module.value is not None)
    if kind == "scaled":
        return dict(path=path, kind=kind, scale=module.scale)
    if kind == "keep":
        mean = {} if module.mixing == "identity" else dict(mixing=module.mixing)  # older readers see no change
        return dict(path=path, kind=kind, heads=module.heads, alpha=module.alpha, fold=module.fold,
                    layer_idx=module.layer_idx, **mean)
    return None if kind is None else dict(path=path, kind=kind)


def dense_class(model: nn.Module | type) -> type:
    """The stock transformers class under a pruned-checkpoint class or model (the class itself for a stock one)."""
    cls = model if isinstance(model, type) else type(model)
    return next(c for c in cls.__mro__ if not getattr(c, "_harp", False))


def dense_skeleton(model: nn.Module) -> nn.Module:
    """The dense model its config describes, on the meta device (no memory, no weights)."""
    with torch.device("meta"):
        return dense_class(model)(copy.deepcopy(model.config))


def describe(model: nn.Module) -> list[dict]:
    """Every module of `model` that differs from the dense model of its config, as JSON-able entries in the order
    `rebuild` applies them (parents first): replaced modules, Linear layers of another shape, head counts."""
    dense = dict(dense_skeleton(model).named_modules())
    entries, inside = [], []
    for path, module in model.named_modules():
        if any(path.startswith(p + ".") for p in inside):
            continue  # rebuilt with its parent
        entry = _entry(path, module)
        if entry is not None:
            entries.append(entry)
            inside.append(path)
            continue
        ref = dense.get(path)
        if isinstance(module, nn.Linear) and (not isinstance(ref, nn.Linear) or _linear(module) != _linear(ref)):
            entries.append(dict(path=path, kind="linear", shape=_linear(module)))
        changed = {a: getattr(module, a) for a in ATTRIBUTES
                   if hasattr(module, a) and getattr(module, a) != getattr(ref, a, None)}
        if changed:
            entries.append(dict(path=path, kind="attributes", values=changed))
    return entries


def _new_linear(spec: list) -> nn.Linear:
    out_features, in_features, bias = spec
    return nn.Linear(in_features, out_features, bias=bias)


def _built(entry: dict, current: nn.Module) -> nn.Module:
    kind = entry["kind"]
    if kind == "bypass":
        return BypassAttention(_new_linear(entry["v_proj"]), _new_linear(entry["o_proj"]), entry["head_dim"],
                               entry["n_rep"], entry["scale"], entry.get("alpha"),
                               mixing=entry.get("mixing", "identity"), layer_idx=entry.get("layer_idx"))
    if kind == "dropped":
        return DroppedAttention()
    if kind == "constant":
        return Constant(torch.zeros(entry["hidden"]) if entry["has_value"] else None, entry["hidden"],
                        entry["attention"])
    if kind == "scaled":
        return Scaled(current, entry["scale"])
    if kind == "keep":
        return keep_heads_attention(current, entry["heads"], entry["alpha"], entry["fold"],
                                    entry.get("mixing", "identity"))
    if kind == "identity":
        return nn.Identity()
    if kind == "linear":
        return _new_linear(entry["shape"])
    raise ValueError(f"unknown structure entry kind {kind!r} at {entry.get('path')!r}: this checkpoint was written "
                     "by a newer version; update modeling_harp.py")


def rebuild(model: nn.Module, structure: list[dict]) -> None:
    """Turn the dense model of a config into the pruned one its `structure` describes (weights to be loaded)."""
    for entry in structure:
        parent_path, _, name = entry["path"].rpartition(".")
        try:
            parent = model.get_submodule(parent_path)
            current = getattr(parent, name)
        except AttributeError as err:
            raise ValueError(f"structure entry {entry['path']!r} names no module of this {type(model).__name__}: "
                             "the checkpoint's config does not match its structure") from err
        if entry["kind"] == "attributes":
            for attr, value in entry["values"].items():
                setattr(current, attr, value)
        else:
            setattr(parent, name, _built(entry, current))


# ---------------------------------------------------------------------------------------------- the classes
class _HarpCheckpoint:
    """Mixed into a family's CausalLM class: builds the pruned structure from the config, refuses checkpoints whose
    weights do not fit it, and saves only the weights that exist (plus this file, the plan and the tokenizer)."""

    _harp = True

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        rebuild(self, getattr(config, STRUCTURE, None) or [])

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """Load a pruned checkpoint, refusing (one ValueError naming config.json) a structure that does not fit the
        dense model of its config or its plan (`modeling_harp_checks`), weights that do not fit the structure, and a
        bypass whose α is not the one its weights were folded at."""
        want_info = kwargs.pop("output_loading_info", False)
        source = str(args[0] if args else kwargs.get("pretrained_model_name_or_path", "this checkpoint"))
        where = str(Path(source, "config.json")) if Path(source).is_dir() else f"{source} (config.json)"
        config = kwargs.get("config")
        if not isinstance(config, PretrainedConfig):
            hub = {k: kwargs[k] for k in ("revision", "subfolder", "token", "cache_dir", "local_files_only")
                   if k in kwargs}
            config = cls.config_class.from_pretrained(source, **hub)
        with torch.device("meta"):
            problem = first_problem(config, dense_class(cls)(copy.deepcopy(config)))
        if problem:
            raise ValueError(f"{where}: {problem}; re-save the checkpoint from the pruned model")
        kwargs.setdefault("ignore_mismatched_sizes", True)  # reported below, naming the tensor
        model, info = super().from_pretrained(*args, output_loading_info=True, **kwargs)
        missing = set(info.get("missing_keys", []))
        # only a checkpoint saved before α was kept with the weights may lack it; deleting it does not skip the check
        unrecorded = {k for k in missing if k.endswith(f".{FOLDED}")} if getattr(config, FORMAT, 1) < 2 else set()
        problems = [(k, "is missing") for k in sorted(missing - unrecorded)]
        problems += [(k[0] if isinstance(k, tuple) else str(k), "has the wrong shape")
                     for k in sorted(info.get("mismatched_keys", []), key=str)]
        problems += [(k, "is not part of the pruned model") for k in sorted(info.get("unexpected_keys", []))]
        if problems:
            raise ValueError(f"{source}: the pruned checkpoint's weights do not match its structure in config.json: "
                             f"{problems[0][0]} {problems[0][1]} ({len(problems)} tensors in all); re-save it from "
                             "the pruned model")
        problem = folded_problem(model, unrecorded)
        if problem:
            raise ValueError(f"{where}: {problem}; re-save the checkpoint from the pruned model")
        return (model, info) if want_info else model

    def save_pretrained(self, save_directory, *args, **kwargs):
        """An ordinary checkpoint of the pruned model: only its weights, its structure and plan in config.json,
        `auto_map` pointing at a copy of this file, and the tokenizer if the model carries one. The model's own
        config is left as it was."""
        structure, plan, config = describe(self), _plan_of(self), self.config
        keys = (STRUCTURE, PLAN, FORMAT, "auto_map")
        saved = {key: config.__dict__.pop(key) for key in keys if key in config.__dict__}
        directory = Path(save_directory)
        try:
            if plan:  # also for pruning that keeps every shape (unstructured Wanda's zeros)
                setattr(config, PLAN, plan)
            if structure:
                setattr(config, STRUCTURE, structure)
                setattr(config, FORMAT, 2)
                config.auto_map = {"AutoModelForCausalLM": f"{Path(__file__).stem}.{type(self).__name__}"}
            elif not plan:
                warnings.warn("this model has no pruned module: saving an ordinary dense checkpoint", stacklevel=2)
            directory.mkdir(parents=True, exist_ok=True)  # the extra files first, so a Hub push carries them
            if structure:  # this file and the three it imports
                for source in (Path(__file__), *(Path(__file__).with_name(f"modeling_harp_{part}.py")
                                                 for part in ("checks", "keep", "mean"))):
                    shutil.copyfile(source, directory / source.name)
            tokenizer = getattr(self, "harp_tokenizer", None)
            if tokenizer is not None:
                tokenizer.save_pretrained(directory)
            super().save_pretrained(save_directory, *args, **kwargs)
            if not structure:  # the stock class reads it: name that one, not ours
                path = directory / "config.json"
                written = json.loads(path.read_text())
                written["architectures"] = [dense_class(self).__name__]
                path.write_text(json.dumps(written, indent=2, sort_keys=True) + "\n")
        finally:
            for key in keys:
                config.__dict__.pop(key, None)
            config.__dict__.update(saved)


def _plan_of(model: nn.Module) -> dict:
    """How the model was pruned, as recorded by whoever pruned it (`to_dict()` of a plan or record)."""
    out = {}
    if getattr(model, "harp_plan", None) is not None:
        out["harp"] = model.harp_plan.to_dict()
    if getattr(model, "prune_record", None) is not None:
        out["baseline"] = model.prune_record.to_dict()
    return out


def _harp_class(base: type) -> type:
    cls = type(f"Harp{base.__name__}", (_HarpCheckpoint, base), {"__module__": __name__,
                                                              "__doc__": f"A pruned {base.__name__}."})
    return cls


HarpLlamaForCausalLM = _harp_class(LlamaForCausalLM)
HarpMistralForCausalLM = _harp_class(MistralForCausalLM)
HarpQwen2ForCausalLM = _harp_class(Qwen2ForCausalLM)
HarpGemma2ForCausalLM = _harp_class(Gemma2ForCausalLM)
HarpGemma3ForCausalLM = _harp_class(Gemma3ForCausalLM)
CLASSES = {c.__name__: c for c in (HarpLlamaForCausalLM, HarpMistralForCausalLM, HarpQwen2ForCausalLM,
                                   HarpGemma2ForCausalLM, HarpGemma3ForCausalLM)}


def checkpoint_class(model: nn.Module) -> type | None:
    """The pruned-checkpoint class for this model's class, or None where there is none (e.g. a multimodal
    Gemma-3 wrapper, a user's subclass)."""
    if getattr(type(model), "_harp", False):
        return type(model)
    return next((c for c in CLASSES.values() if type(model) in c.__bases__), None)


def mark_pruned(model: nn.Module) -> bool:
    """Give a pruned model its checkpoint class (the same class plus `_HarpCheckpoint`), so `save_pretrained`
    writes a pruned checkpoint. Idempotent; modules and weights are untouched. False where no such class exists."""
    cls = checkpoint_class(model)
    if cls is not None:
        model.__class__ = cls
    return cls is not None
