"""Analytic FLOP model of a decoder-only LM, dense or under a HARP plan (2 FLOPs per multiply-add).

Per layer and token: Q, K, V, O projections and the MLP; per layer and sequence: attention scores Q·Kᵀ and the
weighted sum A·V over the causal triangle (T(T+1)/2 query-key pairs; with `past` cached tokens each new token
also sees those, which gives the decode cost). A bypassed layer keeps V and O (O over
KV heads when folded) and the MLP; an α = 0 layer keeps only the MLP. The LM head costs d·V per scored token.
"""

from __future__ import annotations

from ..model.adapter import head_dim, text_config


def _shape(config) -> dict:
    cfg = text_config(config)
    return dict(d=cfg.hidden_size, h=cfg.num_attention_heads, kv=cfg.num_key_value_heads, hd=head_dim(cfg),
                ff=cfg.intermediate_size, vocab=cfg.vocab_size, L=cfg.num_hidden_layers)


def layer_flops(config, seq_len: int, alpha: float | None = None, fold: bool = True, past: int = 0) -> float:
    """FLOPs of one decoder layer over `seq_len` new tokens of a causal sequence (batch 1).

    Args:
        alpha: None for a dense layer; the HARP α for a pruned one (0 drops the attention sub-layer).
        past: tokens already in the KV cache (0 = prefill; seq_len=1, past=c = one decode step at context c).
    """
    s = _shape(config)
    d, h, kv, hd, t = s["d"], s["h"], s["kv"], s["hd"], seq_len
    mlp = 3 * d * s["ff"]
    if alpha is None:
        return attention_flops(config, t, past) + 2 * mlp * t
    if alpha == 0.0:
        return 2 * mlp * t
    o_in = kv * hd if fold else h * hd
    return 2 * (d * kv * hd + o_in * d + mlp) * t


def attention_flops(config, seq_len: int, past: int = 0, n_heads: int | None = None, n_kv_heads: int | None = None
                    ) -> float:
    """FLOPs of one attention sub-layer over `seq_len` new tokens: Q, K, V, O projections, scores and A·V.

    `n_heads` / `n_kv_heads`: query and KV heads kept (default: the config's), e.g. after head pruning.
    """
    s = _shape(config)
    d, hd, t = s["d"], s["hd"], seq_len
    h = s["h"] if n_heads is None else n_heads
    kv = s["kv"] if n_kv_heads is None else n_kv_heads
    per_token = d * h * hd + 2 * d * kv * hd + h * hd * d
    pairs = t * past + t * (t + 1) / 2  # causal: new query i sees the past and keys 0..i
    return 2 * (per_token * t + 2 * h * hd * pairs)


def head_flops(config, tokens: int) -> float:
    s = _shape(config)
    return 2 * s["d"] * s["vocab"] * tokens


def model_flops(config, seq_len: int, alphas: dict[int, float] | None = None, fold: bool = True, *,
                from_layer: int = 0, head_tokens: int | None = None, past: int = 0) -> float:
    """FLOPs of layers from_layer..L-1 plus the LM head on `head_tokens` tokens (default: all of them)."""
    alphas = alphas or {}
    L = _shape(config)["L"]
    body = sum(layer_flops(config, seq_len, alphas.get(i), fold, past) for i in range(from_layer, L))
    return body + head_flops(config, seq_len if head_tokens is None else head_tokens)


def speedup_bound(config, seq_len: int, alphas: dict[int, float], fold: bool = True,
                  head_tokens: int | None = None, past: int = 0) -> float:
    """FLOPs_dense / FLOPs_HARP: the speed-up if time were proportional to FLOPs.

    Prefill as generation runs it: `head_tokens=1`; one decode step at context c: `seq_len=1, past=c`.
    """
    dense = model_flops(config, seq_len, None, fold, head_tokens=head_tokens, past=past)
    return dense / model_flops(config, seq_len, alphas, fold, head_tokens=head_tokens, past=past)


def search_flops(config, layers: list[int], grid_size: int, seq_len: int) -> dict:
    """Predicted FLOPs of the greedy α search, naive (whole model per candidate) vs cached prefix (one dense pass
    of the decoder, then per candidate only the searched layer, the layers above and the head).

    α = 1 candidates are counted for every layer (the α value barely changes the cost of a bypassed layer).
    """
    order = sorted(layers, reverse=True)
    naive = cached = 0.0
    chosen: dict[int, float] = {}
    cached += model_flops(config, seq_len, None, True, head_tokens=0)  # boundaries: decoder only
    for layer in order:
        plan = {**chosen, layer: 1.0}
        naive += grid_size * model_flops(config, seq_len, plan)
        cached += grid_size * model_flops(config, seq_len, plan, from_layer=layer)
        chosen[layer] = 1.0
    return {"naive_flops": naive, "cached_flops": cached, "predicted_ratio": naive / cached}


# ---------------------------------------------------------------------------------------------- heads and bypasses
def heads_attention_flops(config, kept: dict[int, int], seq_len: int, past: int = 0) -> float:
    """Attention FLOPs of all layers when layer i keeps kept[i] query heads (KV heads stay unless none is kept)."""
    kv = text_config(config).num_key_value_heads
    return sum(attention_flops(config, seq_len, past, h, kv) if h else 0.0 for h in kept.values())


def bypass_flops(config, alphas: dict[int, float], seq_len: int, past: int = 0) -> float:
    """Attention FLOPs of all layers under a HARP plan: dense layers in full, bypassed ones V and O only (an empty
    plan gives the dense model's attention FLOPs)."""
    total = 0.0
    for i in range(text_config(config).num_hidden_layers):
        if i in alphas:
            total += layer_flops(config, seq_len, alphas[i]) - layer_flops(config, seq_len, 0.0)
        else:
            total += attention_flops(config, seq_len, past)
    return total


def half_heads_bound(config, seq_len: int) -> dict:
    """The background's "50 % of heads → 2× in attention", computed: dense attention FLOPs over those with half the
    query heads of every layer (K and V stay, as GQA requires), at prefill of `seq_len` and one decode step there."""
    cfg = text_config(config)
    h, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    out = {}
    for phase, t, past in (("prefill", seq_len, 0), ("decode", 1, seq_len)):
        out[f"{phase}_attention_flop_ratio"] = (attention_flops(config, t, past)
                                                / attention_flops(config, t, past, h / 2, kv))
    return out
