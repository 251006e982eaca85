"""What each head attends to: entropy, sink and self mass per head; JS divergence and output cosine per pair."""

from __future__ import annotations

import math

import pandas as pd
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..eval.perplexity import check_windows
from ..model.adapter import attention_backend, get_adapter


# ---------------------------------------------------------------------------------------------- attention patterns
def entropy_rows(p: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of each attention row p [..., n]: −Σ p log p (0 log 0 = 0)."""
    p = p.float()
    return -(p * torch.log(p.clamp_min(1e-30))).sum(-1)


def js_divergence(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Jensen–Shannon divergence in bits (0 = identical, 1 = disjoint) of rows p, q [..., n]."""
    m = 0.5 * (p + q)

    def kl(a):
        return (a * (torch.log(a.clamp_min(1e-30)) - torch.log(m.clamp_min(1e-30)))).sum(-1)
    return (0.5 * kl(p) + 0.5 * kl(q)) / math.log(2)


def pattern_stats(weights: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per head of one window's attention weights [H, T, T] (rows causal, queries t >= 1 only: row 0 is trivial).

    Returns:
        entropy [H] (nats), entropy_norm [H] (entropy / log of the keys the row can see), sink [H] (mass on the
        first token), self [H] (mass on the query token itself), js [H, H] (bits, mean over queries).
    """
    a = weights[:, 1:].double()  # queries 1..T-1
    t = torch.arange(1, weights.shape[-1], device=weights.device)
    seen = (a > 0).sum(-1).clamp_min(2).double()  # keys each row can see (causal, and the sliding window)
    ent = entropy_rows(a).double()
    js = js_divergence(a[:, None], a[None]).mean(-1)
    return {"entropy": ent.mean(-1), "entropy_norm": (ent / seen.log()).mean(-1), "sink": a[..., 0].mean(-1),
            "self": a[:, torch.arange(len(t), device=t.device), t].mean(-1), "js": js}


def output_cosines(x: torch.Tensor, o_weight: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Mean over tokens of the cosine between heads' output contributions W_O[:, h] x_h: x [T, H·hd] → [H, H]."""
    xs = x.double().unflatten(-1, (-1, head_dim))  # [T, H, hd]
    w = o_weight.double().unflatten(1, (-1, head_dim))  # [d, H, hd]
    out = F.normalize(torch.einsum("thk,dhk->htd", xs, w), dim=-1)  # [H, T, d]
    return torch.einsum("atd,btd->abt", out, out).mean(-1)


@torch.no_grad()
def head_statistics(model, windows: torch.Tensor, progress: bool = True) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Attention-pattern statistics of every dense layer's heads, averaged over `windows`.

    The model runs with eager attention for this (sdpa returns no weights) and is switched back afterwards.

    Returns:
        (heads, pairs): heads has layer, head, entropy, entropy_norm, sink, self; pairs has layer, head_a, head_b
        (a < b), js (bits) and cos (output contributions).
    """
    check_windows(model, windows)
    ad = get_adapter(model)
    device = next(model.parameters()).device
    layers = [i for i in range(ad.n_layers) if ad.attention_is_dense(i)]
    sums: dict[tuple[int, str], torch.Tensor] = {}
    inputs: dict[int, torch.Tensor] = {}

    def add(key, value):
        sums[key] = sums.get(key, 0) + value.cpu()

    def keep_input(i):
        def hook(module, args):
            inputs[i] = args[0]
        return hook

    def on_attention(i):
        def hook(module, args, kwargs, out):
            for name, v in pattern_stats(out[1][0]).items():
                add((i, name), v)
            add((i, "cos"), output_cosines(inputs[i][0], module.o_proj.weight, ad.head_dim))
        return hook

    handles = []
    with attention_backend(model, "eager"):
        try:
            for i in layers:
                attn = ad.attention(i)
                handles.append(attn.o_proj.register_forward_pre_hook(keep_input(i)))
                handles.append(attn.register_forward_hook(on_attention(i), with_kwargs=True))
            for x in tqdm(windows, desc="head statistics", leave=False, disable=not progress):
                model(input_ids=x[None].to(device), use_cache=False)
        finally:
            for h in handles:
                h.remove()
    n = len(windows)
    head_rows, pair_rows = [], []
    for i in layers:
        for h in range(ad.n_heads):
            head_rows.append({"layer": i, "head": h, **{k: float(sums[(i, k)][h]) / n
                                                        for k in ("entropy", "entropy_norm", "sink", "self")}})
            for b in range(h + 1, ad.n_heads):
                pair_rows.append({"layer": i, "head_a": h, "head_b": b, "js": float(sums[(i, "js")][h, b]) / n,
                                  "cos": float(sums[(i, "cos")][h, b]) / n})
    return pd.DataFrame(head_rows), pd.DataFrame(pair_rows)


def most_redundant(pairs: pd.DataFrame) -> pd.DataFrame:
    """Per layer (and model, if present) the pair of heads with the most similar attention (lowest JS) and, apart,
    the highest output cosine."""
    by = [c for c in ("model", "layer") if c in pairs]
    js = pairs.loc[pairs.groupby(by).js.idxmin(), by + ["head_a", "head_b", "js"]]
    cos = pairs.loc[pairs.groupby(by).cos.idxmax(), by + ["head_a", "head_b", "cos"]]
    return js.merge(cos, on=by, suffixes=("_js", "_cos")).reset_index(drop=True)
