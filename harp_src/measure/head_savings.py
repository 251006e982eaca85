"""What really slicing attention heads off saves against the dense model, beside HARP at the same share of heads:
parameters, KV bytes, attention FLOPs (analytic) and prefill / decode latency measured interleaved with dense."""

from __future__ import annotations

import copy

import pandas as pd
import torch

from ..heads.gates import HeadGates
from ..heads.removal import slice_off_heads
from ..heads.sensitivity import HARP_SEARCHED
from ..method.harp import apply_harp
from ..model.adapter import get_adapter
from ..model.weights import n_params
from .flops import bypass_flops, heads_attention_flops
from .kv import prompt_kv_bytes
from .timing import latency_pair


def savings_row(dense, model, seq_len: int, repeats: int, dense_kv: int, dense_params: int) -> dict:
    """What one really pruned model saves against dense: parameters, KV bytes at `seq_len`, and prefill / decode
    latency there, interleaved with dense (`measure.timing.latency_pair`; `repeats` 0 skips the timing)."""
    lat = latency_pair(dense, model, seq_len, repeats=repeats) if repeats else {}
    kv = prompt_kv_bytes(model, seq_len)
    removed = dense_params - n_params(model)
    return dict(params_removed=removed, kv_bytes=kv, kv_ratio=kv / dense_kv, **lat)


def savings_table(dense, probe: torch.Tensor, heads_sets: dict[str, tuple[float, dict[int, list[int]]]],
                  alphas: dict[int, float], fractions: list[float], *, seq_len: int, repeats: int
                  ) -> tuple[pd.DataFrame, dict]:
    """Slice each head set ({label: (fraction of heads, {layer: heads})}) off a copy of `dense` (checked on the
    `probe` windows: the same logits as the gated model), build HARP with `alphas` on the same share of layers (each
    of `fractions`: the top layers), and measure what each saves at `seq_len` tokens (timed `repeats` times, 0: not
    timed). Returns the table and the largest |sliced − gated| logit difference."""
    ad = get_adapter(dense)
    cfg = dense.config
    dense_params = n_params(dense)
    dense_kv = prompt_kv_bytes(dense, seq_len)
    prefill_dense, decode_dense = bypass_flops(cfg, {}, seq_len), bypass_flops(cfg, {}, 1, seq_len)
    rows, worst = [], 0.0
    for label, (frac, heads) in heads_sets.items():
        with HeadGates(dense) as gates:
            gates.close_heads(heads)
            with torch.no_grad():
                gated = dense(input_ids=probe).logits
        model = copy.deepcopy(dense)
        slice_off_heads(model, heads)
        with torch.no_grad():
            worst = max(worst, float((model(input_ids=probe).logits - gated).abs().max()))
        kept = {i: ad.n_heads - len(heads.get(i, [])) for i in range(ad.n_layers)}
        row = dict(config=label, frac_heads_removed=frac)
        row |= savings_row(dense, model, seq_len, repeats, dense_kv, dense_params)
        row |= dict(attn_prefill_flop_ratio=prefill_dense / heads_attention_flops(cfg, kept, seq_len),
                    attn_decode_flop_ratio=decode_dense / heads_attention_flops(cfg, kept, 1, seq_len))
        rows.append(row)
        del model
    for frac in fractions:
        n = max(1, round(frac * ad.n_layers))
        plan = {i: alphas[i] for i in range(ad.n_layers - n, ad.n_layers)}
        model = copy.deepcopy(dense)
        apply_harp(model, sorted(plan), plan)
        row = dict(config=f"{HARP_SEARCHED}, top {frac:.0%} of layers", frac_heads_removed=n / ad.n_layers)
        row |= savings_row(dense, model, seq_len, repeats, dense_kv, dense_params)
        row |= dict(attn_prefill_flop_ratio=prefill_dense / bypass_flops(cfg, plan, seq_len),
                    attn_decode_flop_ratio=decode_dense / bypass_flops(cfg, plan, 1, seq_len))
        rows.append(row)
        del model
    return pd.DataFrame(rows), {"max_abs_logit_diff_sliced_vs_gated": worst}
