"""The one per-family adapter: the only place that knows how an architecture is laid out (module names, norms,
Gemma's norm fold, soft-capping, head_dim) and whether a layer's sub-layers are dense, bypassed or cut."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from .modeling_harp import Scaled, kind_of, repeat_heads


# ---------------------------------------------------------------------------------------------- the adapter
@dataclass(frozen=True)
class FamilySpec:
    """What differs between families. `sandwich`: attention output goes through its own norm (Gemma)."""

    sandwich: bool = False
    norm_offset: float = 0.0  # Gemma's RMSNorm multiplies by (1 + w)


FAMILIES: dict[str, FamilySpec] = {
    "llama": FamilySpec(),
    "mistral": FamilySpec(),
    "qwen2": FamilySpec(),
    "gemma2": FamilySpec(sandwich=True, norm_offset=1.0),
    "gemma3_text": FamilySpec(sandwich=True, norm_offset=1.0),
}


def text_config(config):
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def family_of(config) -> str:
    family = text_config(config).model_type
    if family not in FAMILIES:
        raise ValueError(f"model family '{family}' is not supported; supported families: {sorted(FAMILIES)}")
    return family


def fingerprint(config) -> dict:
    """What a pruning plan must match: family and shapes."""
    cfg = text_config(config)
    return {
        "family": family_of(cfg),
        "num_layers": cfg.num_hidden_layers,
        "hidden_size": cfg.hidden_size,
        "num_heads": cfg.num_attention_heads,
        "num_kv_heads": cfg.num_key_value_heads,
    }


FINGERPRINT_TYPES = {"family": str, "num_layers": int, "hidden_size": int, "num_heads": int, "num_kv_heads": int}


def check_fingerprint(found) -> dict:
    """Refuse a fingerprint (as a plan or record stores it) that lacks a field or has one of the wrong type."""
    if not isinstance(found, dict):
        raise ValueError(f"fingerprint must be a mapping of {sorted(FINGERPRINT_TYPES)}, got {found!r}")
    for key, kind in FINGERPRINT_TYPES.items():
        value = found.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ValueError(f"fingerprint needs {key!r} as {kind.__name__}, got {value!r}; "
                             "plans and records carry the fingerprint of the model they were made for")
    extra = sorted(set(found) - set(FINGERPRINT_TYPES))
    if extra:
        raise ValueError(f"fingerprint has unknown fields {extra}; it has {sorted(FINGERPRINT_TYPES)}")
    return found


def head_dim(config) -> int:
    """Width of one attention head: the config's `head_dim` where it sets one (Gemma), else hidden / heads."""
    cfg = text_config(config)
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


class Adapter:
    """Uniform view of a decoder-only model: layers, attention projections, norms, head counts and the LM head.

    Every module name (`self_attn`, `input_layernorm`, `post_attention_layernorm`) and every family difference
    (Gemma's sandwich norm and its (1 + w) weights, Gemma-2's logit soft-capping) is known here and nowhere else.
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self.config = text_config(model.config)
        self.family = family_of(self.config)
        self.spec = FAMILIES[self.family]
        cfg = self.config
        self.n_layers = cfg.num_hidden_layers
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = cfg.num_key_value_heads
        self.head_dim = head_dim(cfg)
        self.hidden = cfg.hidden_size
        self.n_rep = self.n_heads // self.n_kv_heads

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.get_decoder().layers

    @property
    def final_norm(self) -> nn.Module:
        return self.model.get_decoder().norm

    def attention(self, i: int) -> nn.Module:
        """Layer i's attention module (or what replaced it)."""
        return self.layers[i].self_attn

    def set_attention(self, i: int, module: nn.Module) -> None:
        """Put `module` in place of layer i's attention; it is called as the attention was and returns (out, None)."""
        self.layers[i].self_attn = module

    def attn_out_norm(self, i: int) -> nn.Module | None:
        """The norm applied to the attention output before the residual add (Gemma's sandwich norm)."""
        return self.layers[i].post_attention_layernorm if self.spec.sandwich else None

    def attention_norms(self, i: int) -> list[nn.Module]:
        """The norms that serve only layer i's attention sub-layer: its input norm (and Gemma's output norm)."""
        layer = self.layers[i]
        return [layer.input_layernorm] + ([layer.post_attention_layernorm] if self.spec.sandwich else [])

    def remove_attention_norms(self, i: int) -> None:
        """Replace `attention_norms(i)` by identities (for a dropped attention sub-layer, which reads none)."""
        layer = self.layers[i]
        layer.input_layernorm = nn.Identity()
        if self.spec.sandwich:
            layer.post_attention_layernorm = nn.Identity()

    def mlp(self, i: int) -> nn.Module:
        """Layer i's MLP (or what replaced it); its projections are `gate_proj`, `up_proj`, `down_proj`."""
        return self.layers[i].mlp

    def set_mlp(self, i: int, module: nn.Module) -> None:
        """Put `module` in place of layer i's MLP; it is called as the MLP was, on the normed hidden states."""
        self.layers[i].mlp = module

    def mlp_norms(self, i: int) -> list[nn.Module]:
        """The norms that serve only layer i's MLP: its input norm (and Gemma's output norm)."""
        layer = self.layers[i]
        if self.spec.sandwich:
            return [layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm]
        return [layer.post_attention_layernorm]  # Llama-style naming: the norm after attention feeds the MLP

    def mlp_out_norm(self, i: int) -> nn.Module | None:
        """The norm applied to the MLP output before the residual add (Gemma's sandwich norm)."""
        return self.layers[i].post_feedforward_layernorm if self.spec.sandwich else None

    def remove_mlp_norms(self, i: int) -> None:
        """Replace `mlp_norms(i)` by identities (for an MLP that reads nothing: dropped or constant)."""
        layer = self.layers[i]
        if self.spec.sandwich:
            layer.pre_feedforward_layernorm = nn.Identity()
            layer.post_feedforward_layernorm = nn.Identity()
        else:
            layer.post_attention_layernorm = nn.Identity()

    def branch_module(self, i: int) -> nn.Module:
        """The module whose output is what layer i's attention adds to the residual stream."""
        return self.attn_out_norm(i) if self.spec.sandwich else self.attention(i)

    def scale_after_norm(self, i: int, alpha: float, fold: bool) -> bool:
        """Scale layer i's attention-output norm by α, if the family has one; a scale inside o_proj would be undone
        by that RMSNorm. Folded into its weight, (1 + w') = α (1 + w) for Gemma's (1 + w) norms, or wrapped.

        Returns:
            True if the norm now carries α; False if there is no such norm (then α belongs in o_proj).
        """
        if not self.spec.sandwich:
            return False
        layer = self.layers[i]
        if fold:
            offset, norm = self.spec.norm_offset, layer.post_attention_layernorm
            with torch.no_grad():
                norm.weight.copy_(alpha * (offset + norm.weight) - offset)
        else:
            layer.post_attention_layernorm = Scaled(layer.post_attention_layernorm, alpha)
        return True

    def check_layer(self, i) -> int:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.n_layers:
            raise ValueError(f"layer {i!r} is out of range: this {self.family} model has layers 0..{self.n_layers - 1}")
        return i

    # ------------------------------------------------------------------ what state a layer is in (one answer each)
    def is_bypassed(self, i: int) -> bool:
        """Whether layer i's attention is HARP's: the A = I bypass, dropped (α = 0), or bypassed but for kept heads."""
        return kind_of(self.attention(i)) in ("bypass", "dropped", "keep")

    def attention_is_dense(self, i: int) -> bool:
        """Whether layer i's attention still has all its heads (nothing sliced, bypassed or dropped)."""
        attn = self.attention(i)
        if not all(isinstance(getattr(attn, p, None), nn.Linear) for p in ("q_proj", "k_proj", "v_proj", "o_proj")):
            return False
        return (attn.o_proj.in_features == self.n_heads * self.head_dim
                and attn.k_proj.out_features == self.n_kv_heads * self.head_dim)

    def intermediate(self, i: int) -> int:
        """The config's MLP width for layer i (the dense width)."""
        size = self.config.intermediate_size
        return size[i] if isinstance(size, (list, tuple)) else size

    def mlp_is_dense(self, i: int) -> bool:
        """Whether layer i's MLP still has all its channels."""
        mlp = self.mlp(i)
        if not all(isinstance(getattr(mlp, p, None), nn.Linear) for p in ("gate_proj", "up_proj", "down_proj")):
            return False
        return mlp.down_proj.in_features == self.intermediate(i)

    def value_path(self, attn: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """o_proj(repeat_kv(v_proj(x))): attention with A = I, KV heads repeated in `repeat_kv` order.

        Args:
            attn: an attention module holding `v_proj` and `o_proj`.
            x: normed hidden states [B, T, d].
        Returns:
            [B, T, d]
        """
        return attn.o_proj(repeat_heads(attn.v_proj(x), self.head_dim, self.n_rep))

    def residual_branch(self, i: int, attn_out: torch.Tensor) -> torch.Tensor:
        """What layer i actually adds to the residual stream, given its attention output."""
        norm = self.attn_out_norm(i)
        return attn_out if norm is None else norm(attn_out)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm, LM head and (Gemma-2) logit soft-capping of the last layer's output h [B, T, d], as the
        model's own forward does. Returns [B, T, vocab]."""
        return self.head_logits(self.final_norm(h))

    def head_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """LM head and (Gemma-2) logit soft-capping of final-normed states [..., d] (the decoder's output)."""
        logits = self.model.get_output_embeddings()(normed)
        cap = self.logit_softcap
        return torch.tanh(logits / cap) * cap if cap else logits

    @property
    def logit_softcap(self) -> float | None:
        """Gemma-2's final logit soft-capping c (logits → c · tanh(l / c)), or None where the family has none."""
        return getattr(self.config, "final_logit_softcapping", None) or None

    def norm_modules(self) -> list[nn.Module]:
        """Every RMSNorm of the model: layer norms (Gemma's sandwich and q/k norms included) and the final norm."""
        return [m for m in self.model.modules() if type(m).__name__.endswith("RMSNorm")]

    @property
    def sliding_window(self) -> int | None:
        """The attention window of the model's sliding-window layers, or None when every layer attends globally."""
        cfg = self.config
        layer_types = getattr(cfg, "layer_types", None)
        if layer_types is not None:
            return cfg.sliding_window if "sliding_attention" in layer_types else None
        return getattr(cfg, "sliding_window", None)


def get_adapter(model: nn.Module) -> Adapter:
    return Adapter(model)


def mark_kv_free(model: nn.Module, layers: list[int]) -> None:
    """Give layers whose attention is gone (bypassed, dropped, cut to nothing) a no-storage cache slot.

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


@contextlib.contextmanager
def attention_backend(model: nn.Module, name: str) -> Iterator[nn.Module]:
    """Temporarily switch the attention implementation (entropy and LRP need eager's attention weights)."""
    old = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield model
    finally:
        model.set_attn_implementation(old)
