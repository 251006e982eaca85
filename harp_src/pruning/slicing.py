"""Structural pruning: really remove attention heads and MLP channels from a layer's weights.

Units of attention, so that GQA and MQA stay valid attention layouts:
- GQA and MHA (more than one KV head): a *head group*, one KV head with the query heads that read it. Removing it
  slices q/k/v rows and o columns; the query-per-KV ratio (`num_key_value_groups`) is unchanged.
- MQA (one KV head shared by all): a *query head*. Removing it slices q rows and o columns; the KV head stays and
  the query-per-KV ratio shrinks.
In both cases unit u owns the contiguous o_proj input columns [u·w, (u+1)·w) (query heads are laid out in
`repeat_kv` order), with w = query heads per unit × head_dim.

Units of the MLP: a channel j (row j of gate and up, column j of down).

A sub-layer that keeps no unit reads nothing: it becomes `Constant` (what it still adds, e.g. a bias, or nothing) and
its norms go, exactly as HARP's α = 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..model.adapter import Adapter
from ..model.modeling_harp import Constant
from ..model.weights import linear_with, n_params


@dataclass(frozen=True)
class Units:
    """How layer attention and MLPs divide into prunable units, and what each unit costs in parameters."""

    n_heads: int  # attention units per layer
    head_width: int  # o_proj input columns per attention unit
    grouped: bool  # True: a unit is a KV group (slices k/v too); False: a query head of an MQA layer
    head_params: int
    n_channels: int
    channel_params: int


def _linear_row_params(lin: nn.Linear) -> int:
    return lin.in_features + (lin.bias is not None)


def units(adapter: Adapter, layer: int = 0) -> Units:
    """The unit layout of `layer` as it is now (all dense layers of these families share it). A layer whose
    attention is no longer dense (HARP-bypassed, dropped, sliced) has no attention units to prune."""
    attn, mlp = adapter.attention(layer), adapter.mlp(layer)
    grouped = adapter.n_kv_heads > 1
    n = adapter.n_kv_heads if grouped else adapter.n_heads
    width = (adapter.n_rep if grouped else 1) * adapter.head_dim
    kv_rows = adapter.head_dim if grouped else 0
    if adapter.attention_is_dense(layer):
        head_params = (width * _linear_row_params(attn.q_proj) + kv_rows * (_linear_row_params(attn.k_proj)
                       + _linear_row_params(attn.v_proj)) + width * attn.o_proj.out_features)
    else:
        n, head_params = 0, 0
    if adapter.mlp_is_dense(layer):
        channels = mlp.down_proj.in_features
        channel_params = (_linear_row_params(mlp.gate_proj) + _linear_row_params(mlp.up_proj)
                          + mlp.down_proj.out_features)
    else:
        channels, channel_params = 0, 0
    return Units(n, width, grouped, head_params, channels, channel_params)


def unit_columns(u: Units, unit: int) -> slice:
    """The o_proj input columns (= q_proj output rows) of attention unit `unit`."""
    return slice(unit * u.head_width, (unit + 1) * u.head_width)


def _index(keep: list[int], width: int, device) -> torch.Tensor:
    return torch.tensor([k * width + j for k in keep for j in range(width)], dtype=torch.long, device=device)


def slice_linear(lin: nn.Linear, rows: torch.Tensor | None = None, cols: torch.Tensor | None = None) -> nn.Linear:
    """A new Linear with only `rows` (outputs) and `cols` (inputs) of `lin`; its bias follows the rows."""
    w = lin.weight
    if rows is not None:
        w = w.index_select(0, rows)
    if cols is not None:
        w = w.index_select(1, cols)
    bias = lin.bias if lin.bias is None or rows is None else lin.bias.index_select(0, rows)
    return linear_with(w, bias)


def add_bias(lin: nn.Linear, delta: torch.Tensor) -> nn.Linear:
    """`lin` with `delta` added to its output bias (a bias is created if it had none)."""
    with torch.no_grad():
        base = lin.bias if lin.bias is not None else lin.weight.new_zeros(lin.out_features)
        return linear_with(lin.weight, base + delta.to(base))


def _constant(delta: torch.Tensor | None, bias: torch.Tensor | None, out_norm: nn.Module | None) -> torch.Tensor | None:
    """What a sub-layer with no unit left adds: out_norm(its output bias + compensation), or None where it has
    neither. Which one depends on the record and the layout alone, not on the values, so a checkpoint's structure
    follows from its record (checked on the meta device, without weights)."""
    parts = [t for t in (bias, delta) if t is not None]
    if not parts:
        return None
    value = sum(p.detach().to(parts[0].dtype) for p in parts)
    with torch.no_grad():
        return value if out_norm is None else out_norm(value[None, None])[0, 0]


def _attention_to_constant(adapter: Adapter, i: int, delta: torch.Tensor | None) -> None:
    """Layer i's attention with no unit left: what it still adds (bias + `delta`, through its output norm)."""
    value = _constant(delta, adapter.attention(i).o_proj.bias, adapter.attn_out_norm(i))
    adapter.set_attention(i, Constant(value, adapter.hidden, attention=True))
    adapter.remove_attention_norms(i)


def _norm_params(norms: list[nn.Module]) -> int:
    return sum(n_params(n) for n in norms)


def heads_removed(adapter: Adapter, i: int, keep: list[int], compensated: bool) -> int:
    """Parameters `keep_heads(adapter, i, keep, delta)` removes from layer i; a compensation bias (`compensated`)
    that o_proj did not have counts as added."""
    u, attn = units(adapter, i), adapter.attention(i)
    has_bias = attn.o_proj.bias is not None
    if not keep:
        return n_params(attn) + _norm_params(adapter.attention_norms(i)) - adapter.hidden * (has_bias or compensated)
    return (u.n_heads - len(keep)) * u.head_params - attn.o_proj.out_features * (compensated and not has_bias)


def channels_removed(adapter: Adapter, i: int, keep: list[int], compensated: bool) -> int:
    """Parameters `keep_channels(adapter, i, keep, delta)` removes from layer i (as `heads_removed`)."""
    u, mlp = units(adapter, i), adapter.mlp(i)
    has_bias = mlp.down_proj.bias is not None
    if not keep:
        return n_params(mlp) + _norm_params(adapter.mlp_norms(i)) - adapter.hidden * (has_bias or compensated)
    return (u.n_channels - len(keep)) * u.channel_params - mlp.down_proj.out_features * (compensated and not has_bias)


def keep_heads(adapter: Adapter, i: int, keep: list[int], delta: torch.Tensor | None = None) -> None:
    """Keep only attention units `keep` of layer i (sorted, distinct); add `delta` to the o_proj bias.

    An empty `keep` replaces the attention sub-layer (and its norms) by a `Constant`.
    """
    u, attn = units(adapter, i), adapter.attention(i)
    if not keep:
        _attention_to_constant(adapter, i, delta)
        return
    device = attn.o_proj.weight.device
    cols = _index(keep, u.head_width, device)
    attn.q_proj = slice_linear(attn.q_proj, rows=cols)
    attn.o_proj = slice_linear(attn.o_proj, cols=cols)
    if u.grouped:
        kv = _index(keep, adapter.head_dim, device)
        attn.k_proj = slice_linear(attn.k_proj, rows=kv)
        attn.v_proj = slice_linear(attn.v_proj, rows=kv)
        attn.num_key_value_heads = len(keep)
        attn.num_heads = len(keep) * adapter.n_rep
    else:
        attn.num_key_value_groups = len(keep)  # the one KV head now serves len(keep) query heads
        attn.num_key_value_heads = adapter.n_kv_heads
        attn.num_heads = len(keep)
    if delta is not None:
        attn.o_proj = add_bias(attn.o_proj, delta)


def keep_channels(adapter: Adapter, i: int, keep: list[int], delta: torch.Tensor | None = None) -> None:
    """Keep only MLP channels `keep` of layer i (sorted, distinct); add `delta` to the down_proj bias.

    An empty `keep` replaces the MLP (and its norms) by a `Constant`.
    """
    mlp = adapter.mlp(i)
    if not keep:
        value = _constant(delta, mlp.down_proj.bias, adapter.mlp_out_norm(i))
        adapter.set_mlp(i, Constant(value, adapter.hidden, attention=False))
        adapter.remove_mlp_norms(i)
        return
    idx = torch.tensor(keep, dtype=torch.long, device=mlp.down_proj.weight.device)
    mlp.gate_proj = slice_linear(mlp.gate_proj, rows=idx)
    mlp.up_proj = slice_linear(mlp.up_proj, rows=idx)
    mlp.down_proj = slice_linear(mlp.down_proj, cols=idx)
    if delta is not None:
        mlp.down_proj = add_bias(mlp.down_proj, delta)


def balanced_groups(adapter: Adapter, i: int, removed: list[int]) -> int:
    """How many query heads each KV group of layer i loses when `removed` go; a ValueError unless every group loses
    the same number (query head h reads KV head h // n_rep, so only such removals keep one query-per-KV ratio)."""
    per_group = [sum(1 for h in removed if h // adapter.n_rep == g) for g in range(adapter.n_kv_heads)]
    if len(set(per_group)) > 1:
        raise ValueError(f"layer {i}: removing heads {sorted(removed)} takes {per_group} query heads from its "
                         f"{adapter.n_kv_heads} KV groups; remove the same number from each group (see "
                         "head_pruning.choose_heads), or whole layers")
    return per_group[0]


def keep_query_heads(adapter: Adapter, i: int, keep: list[int]) -> None:
    """Keep only query heads `keep` of layer i's dense attention: q rows and o columns; K and V stay.

    Each KV group must keep the same number of query heads (`balanced_groups`); `num_key_value_groups` becomes that
    number. An empty `keep` replaces the sub-layer by a `Constant`, as `keep_heads` does.
    """
    keep = sorted(keep)
    per_group = adapter.n_rep - balanced_groups(adapter, i, [h for h in range(adapter.n_heads) if h not in keep])
    attn = adapter.attention(i)
    if not keep:
        _attention_to_constant(adapter, i, None)
        return
    cols = _index(keep, adapter.head_dim, attn.o_proj.weight.device)
    attn.q_proj = slice_linear(attn.q_proj, rows=cols)
    attn.o_proj = slice_linear(attn.o_proj, cols=cols)
    attn.num_key_value_groups = per_group
    attn.num_heads = len(keep)
