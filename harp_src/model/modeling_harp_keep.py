"""HARP with a layer's retrieval heads kept: the kept query heads attend as in the dense model, every other head
passes its own token's value through, scaled by the layer's α (or, with the mean bypass, the mean value of the
positions up to it).

Per layer with kept heads K (query heads g read KV group g // n_rep, as `repeat_kv` orders them):
    out = Σ_{g ∈ K} o_g(softmax(q_g k_{g//n_rep}ᵀ) v_{g//n_rep})  +  α · Σ_{g ∉ K} o_g(A v_{g//n_rep})
with A = I (identity bypass) or the uniform causal average (mean bypass, whose running sums the layer's K/V slot
carries while decoding).
Only the KV groups of kept heads keep K projections and a cache slot; V rows stay for every group some head still
reads; Q rows of bypassed heads and o columns are deleted. α multiplies the bypassed heads' branch only, so in
families with an attention-output norm (Gemma) it sits before that norm, where it sets the mix of the two branches.

The kept heads run through the family's own attention module (rotary embeddings, q/k norms, soft-capping, sliding
windows, eager or sdpa, the cache), its projections sliced. A family module needs the same number of query heads per
KV group, so kept heads are placed in `slots` per kept group; unused slots get zero queries and their outputs are never
read. Like modeling_harp.py this file imports only torch and transformers and travels in every pruned checkpoint.
"""

from __future__ import annotations

import torch
from torch import nn

from .modeling_harp_checks import FOLDED
from .modeling_harp_mean import carried_mean_state, causal_mean, real_tokens


def head_layout(n_heads: int, n_kv: int, heads: list[int], bypass: bool) -> dict:
    """Where each head's weights go when query heads `heads` are kept (the one definition; building a model and
    rebuilding a checkpoint both read it).

    Returns:
        kept_groups: KV groups that keep K and a cache slot; bypassed: query heads in the bypass branch (none when
        `bypass` is False, i.e. α = 0); value_groups: groups whose V rows stay (ascending); slots: query slots per
        kept group; slot_of: each kept head's slot.
    """
    n_rep = n_heads // n_kv
    kept_groups = sorted({h // n_rep for h in heads})
    bypassed = [h for h in range(n_heads) if h not in heads] if bypass else []
    per_group = [sum(h // n_rep == g for h in heads) for g in kept_groups]
    slots = max(per_group)
    slot_of, seen = [], {}
    for h in sorted(heads):
        j = kept_groups.index(h // n_rep)
        slot_of.append(j * slots + seen.get(j, 0))
        seen[j] = seen.get(j, 0) + 1
    value_groups = sorted(set(kept_groups) | {h // n_rep for h in bypassed})
    return dict(n_rep=n_rep, kept_groups=kept_groups, bypassed=bypassed, value_groups=value_groups, slots=slots,
                slot_of=slot_of)


def units(indices: list[int], width: int) -> list[int]:
    """Feature positions of whole heads or groups: [i · width, …, i · width + width − 1] for each index."""
    return [i * width + j for i in indices for j in range(width)]


def _sliced(lin: nn.Linear, rows: list[int] | None = None, cols: list[int] | None = None, *, bias: bool = True
            ) -> nn.Linear:
    """A new Linear with only `rows` (outputs) and `cols` (inputs) of `lin`; its bias follows the rows (none if
    `bias` is False)."""
    w = lin.weight
    if rows is not None:
        w = w[torch.tensor(rows, device=w.device)]
    if cols is not None:
        w = w[:, torch.tensor(cols, device=w.device)]
    bias = None if not bias else lin.bias if lin.bias is None or rows is None else \
        lin.bias[torch.tensor(rows, device=w.device)]
    # skip_init: no random initialisation, the weights are copied over it below
    new = nn.utils.skip_init(nn.Linear, w.shape[1], w.shape[0], bias=bias is not None, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        new.weight.copy_(w)
        if bias is not None:
            new.bias.copy_(bias)
    return new


class Positions(nn.Module):
    """A fixed list of feature positions; the index tensor is made per device on first use (not a buffer, so a
    checkpoint's weights need none and meta-device initialisation cannot leave it empty)."""

    def __init__(self, positions: list[int]):
        super().__init__()
        self.positions, self._made = list(positions), {}

    def on(self, device) -> torch.Tensor:
        if device not in self._made:
            self._made[device] = torch.tensor(self.positions, dtype=torch.long, device=device)
        return self._made[device]


class HeadSlots(Positions):
    """The kept heads' q rows, written into the query slots the family attention reads (unused slots stay 0)."""

    def __init__(self, linear: nn.Linear, positions: list[int], width: int):
        super().__init__(positions)
        self.linear, self.width = linear, width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.linear(x)
        return q.new_zeros(*q.shape[:-1], self.width).index_copy(-1, self.on(q.device), q)


class SlotHeads(Positions):
    """The kept heads' o columns, reading only the slots that hold a kept head."""

    def __init__(self, linear: nn.Linear, positions: list[int]):
        super().__init__(positions)
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.index_select(-1, self.on(x.device)))


class GivenValue(nn.Module):
    """v_proj of the kept heads' attention: the value rows `KeepHeadsAttention` computed once for both branches."""

    def __init__(self):
        super().__init__()
        self.value = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.value is None or self.value.shape[:-1] != x.shape[:-1]:
            raise RuntimeError("this v_proj only serves the KeepHeadsAttention that holds it; call that module")
        return self.value


class KeepHeadsAttention(nn.Module):
    """A bypassed layer that keeps some query heads (see the module docstring). `attn` is the family's attention
    over the kept heads; `v_proj` holds the V rows of `value_groups`; `o_proj` the bypassed heads' o columns (folded:
    summed per KV group and multiplied by α; unfolded: per head, with `scale` = α), or None when α = 0. `mixing`
    is the bypassed heads' fixed attention matrix, "identity" or "mean"."""

    harp_kind = "keep"

    def __init__(self, attn: nn.Module, v_proj: nn.Linear, o_proj: nn.Linear | None, *, heads: list[int],
                 layout: dict, head_dim: int, fold: bool, alpha: float, layer_idx: int | None,
                 mixing: str = "identity"):
        super().__init__()
        self.attn, self.v_proj, self.o_proj = attn, v_proj, o_proj
        self.heads, self.fold, self.alpha, self.layer_idx = list(heads), fold, alpha, layer_idx
        self.mixing = mixing
        self.scale = None if fold or o_proj is None else alpha
        where = {g: k for k, g in enumerate(layout["value_groups"])}
        self.kept_values = Positions(units([where[g] for g in layout["kept_groups"]], head_dim))
        read = sorted({h // layout["n_rep"] for h in layout["bypassed"]}) if fold else \
            [h // layout["n_rep"] for h in layout["bypassed"]]
        self.bypass_values = Positions(units([where[g] for g in read], head_dim))
        if o_proj is not None:
            self.register_buffer(FOLDED, torch.tensor(float(alpha), dtype=o_proj.weight.dtype,
                                                      device=o_proj.weight.device))

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        v = self.v_proj(hidden_states)
        self.attn.v_proj.value = v.index_select(-1, self.kept_values.on(v.device))
        try:
            out, weights = self.attn(hidden_states, *args, **kwargs)
        finally:
            self.attn.v_proj.value = None
        if self.o_proj is not None:
            values = v.index_select(-1, self.bypass_values.on(v.device))
            if self.mixing == "mean":  # after the kept heads' attention, which made this layer's K/V slot
                cache = kwargs.get("cache", kwargs.get("past_key_values"))
                values = causal_mean(values, real_tokens(kwargs.get("attention_mask"), values.shape[1]),
                                     carried_mean_state(cache, self.layer_idx, values.shape[1]))
            bypass = self.o_proj(values)
            out = out + (bypass if self.scale is None else bypass * self.scale)
        return out, weights

    def extra_repr(self) -> str:
        return f"heads={self.heads}, alpha={self.alpha}, fold={self.fold}, mixing={self.mixing}"


def _bypass_o_proj(o_proj: nn.Linear, layout: dict, head_dim: int, fold: bool, alpha: float) -> nn.Linear | None:
    """The bypassed heads' o columns: per head (unfolded), or summed over the heads of each KV group and scaled by α
    (folded; exact, as repeat_kv then o_proj is a sum over a group's heads)."""
    bypassed = layout["bypassed"]
    if not bypassed:
        return None
    if not fold:
        return _sliced(o_proj, cols=units(bypassed, head_dim), bias=False)
    groups = sorted({h // layout["n_rep"] for h in bypassed})
    w = o_proj.weight
    blocks = [sum(w[:, h * head_dim:(h + 1) * head_dim] for h in bypassed if h // layout["n_rep"] == g)
              for g in groups]
    new = nn.utils.skip_init(nn.Linear, len(groups) * head_dim, w.shape[0], bias=False, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        new.weight.copy_(torch.cat(blocks, dim=1) * alpha)
    return new


def keep_heads_attention(attn: nn.Module, heads: list[int], alpha: float, fold: bool, mixing: str = "identity"
                         ) -> KeepHeadsAttention:
    """Layer attention `attn` (a dense family module, weights or not) turned into its kept-heads form; `attn` itself
    becomes the kept heads' attention, the others are bypassed with `mixing` ("identity" or "mean"). The o_proj bias,
    if any, stays once, in the kept branch (not scaled by α)."""
    head_dim = attn.head_dim
    n_heads, n_kv = attn.q_proj.out_features // head_dim, attn.k_proj.out_features // head_dim
    layout = head_layout(n_heads, n_kv, sorted(heads), alpha > 0)
    v_proj = _sliced(attn.v_proj, rows=units(layout["value_groups"], head_dim))
    o_bypass = _bypass_o_proj(attn.o_proj, layout, head_dim, fold, alpha)
    slots = layout["slots"] * len(layout["kept_groups"])
    attn.q_proj = HeadSlots(_sliced(attn.q_proj, rows=units(heads, head_dim)), units(layout["slot_of"], head_dim),
                            slots * head_dim)
    attn.k_proj = _sliced(attn.k_proj, rows=units(layout["kept_groups"], head_dim))
    attn.v_proj = GivenValue()
    attn.o_proj = SlotHeads(_sliced(attn.o_proj, cols=units(heads, head_dim)), units(layout["slot_of"], head_dim))
    attn.num_key_value_groups = layout["slots"]
    for name, value in (("num_heads", slots), ("num_key_value_heads", len(layout["kept_groups"]))):
        if hasattr(attn, name):
            setattr(attn, name, value)
    return KeepHeadsAttention(attn, v_proj, o_bypass, heads=sorted(heads), layout=layout, head_dim=head_dim,
                              fold=fold, alpha=alpha, layer_idx=getattr(attn, "layer_idx", None), mixing=mixing)
