"""Attention heads one by one: gates, Taylor masking confidence, attention-pattern statistics, real removal.

- `HeadGates`: a gate ξ[layer, query head] multiplied into each head's slice of the `o_proj` input (transformers 5
  has no `head_mask`). Gate 1 is the model itself; gate 0 removes the head's contribution.
- `taylor_head_scores`: Michel et al. (2019), I_h = E_x |∂L(x)/∂ξ_h| at ξ = 1, on the language-modelling loss,
  normalised per layer by the L2 norm over its heads.
- `head_statistics`: per head (eager attention, causal positions) the attention entropy, the mass on the first
  token (attention sink) and on the token itself; per pair of heads in a layer the Jensen–Shannon divergence of
  their attention rows and the cosine of their output contributions.
- `slice_off_heads`: really removes a set of gated heads (q rows and o columns) under the GQA rule of
  `slicing.keep_query_heads`, so parameters and (for emptied layers) KV bytes really drop.
"""

from __future__ import annotations

import math

import pandas as pd
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from .analysis import attention_backend
from .evaluate import check_windows
from .harp import mark_kv_free
from .models import Adapter, get_adapter
from .slicing import attention_is_dense, balanced_groups, keep_query_heads


def check_heads(adapter: Adapter, heads: dict[int, list[int]]) -> dict[int, list[int]]:
    """`heads` ({layer: [query head, ...]}) checked against the model: layers and head indices in range, distinct."""
    out = {}
    for layer, hs in heads.items():
        adapter.check_layer(layer)
        hs = list(hs)
        bad = [h for h in hs if isinstance(h, bool) or not isinstance(h, int) or not 0 <= h < adapter.n_heads]
        if bad:
            raise ValueError(f"head index {bad[0]!r} of layer {layer} is out of range: this model has heads "
                             f"0..{adapter.n_heads - 1} per layer")
        if len(set(hs)) != len(hs):
            raise ValueError(f"layer {layer} lists a head twice: {hs}")
        out[layer] = sorted(hs)
    return out


def _dtype(model) -> torch.dtype:
    return torch.promote_types(next(model.parameters()).dtype, torch.float32)


class HeadGates:
    """Gates [n_layers, n_heads] at every dense layer's o_proj input; use as a context manager or call `remove()`.

    Args:
        model: a causal LM of a supported family.
        requires_grad: make the gates a leaf tensor with gradients (for Taylor scores).
    """

    def __init__(self, model, requires_grad: bool = False):
        self.adapter = ad = get_adapter(model)
        device = next(model.parameters()).device
        self.values = torch.ones(ad.n_layers, ad.n_heads, dtype=_dtype(model), device=device,
                                 requires_grad=requires_grad)
        self.handles = [ad.attention(i).o_proj.register_forward_pre_hook(self._hook(i))
                        for i in range(ad.n_layers) if attention_is_dense(ad, i)]

    def _hook(self, i: int):
        hd = self.adapter.head_dim

        def hook(module, args):
            x = args[0]
            gated = x.unflatten(-1, (-1, hd)) * self.values[i][:, None].to(x.dtype)
            return (gated.flatten(-2),) + args[1:]
        return hook

    def close_heads(self, heads: dict[int, list[int]]) -> HeadGates:
        """Set the gates of `heads` ({layer: [head, ...]}) to 0, all others to 1."""
        heads = check_heads(self.adapter, heads)
        with torch.no_grad():
            self.values.fill_(1.0)
            for layer, hs in heads.items():
                self.values[layer, hs] = 0.0
        return self

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def __enter__(self) -> HeadGates:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def window_loss(model, ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (fp32) of each window [B, T] → [B]."""
    logits = model(input_ids=ids, use_cache=False).logits[:, :-1]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    nll = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="none")
    return nll.view(ids.shape[0], -1).mean(-1)


def gate_gradients(model, windows: torch.Tensor, progress: bool = True) -> torch.Tensor:
    """∂L(x)/∂ξ at ξ = 1 for every window x (L = its mean token NLL): [n_windows, n_layers, n_heads], signed."""
    check_windows(model, windows)
    device = next(model.parameters()).device
    grads = []
    flags = {p: p.requires_grad for p in model.parameters()}
    try:
        for p in flags:
            p.requires_grad_(False)  # only the gates need gradients
        with HeadGates(model, requires_grad=True) as gates, torch.enable_grad():
            for x in tqdm(windows, desc="Taylor scores", leave=False, disable=not progress):
                gates.values.grad = None
                window_loss(model, x[None].to(device)).sum().backward()
                grads.append(gates.values.grad.detach().cpu().clone())
    finally:
        for p, flag in flags.items():
            p.requires_grad_(flag)
    return torch.stack(grads)


def taylor_head_scores(model, windows: torch.Tensor, normalise: bool = True, progress: bool = True
                       ) -> torch.Tensor:
    """Masking confidence E_x |∂L(x)/∂ξ_h| [n_layers, n_heads]; with `normalise`, each layer divided by its L2 norm."""
    scores = gate_gradients(model, windows, progress).abs().mean(0).double()
    return per_layer_l2(scores) if normalise else scores


def per_layer_l2(scores: torch.Tensor) -> torch.Tensor:
    """Each layer's row of head scores [n_layers, n_heads] divided by its L2 norm (Michel et al.'s normalisation)."""
    return scores / scores.norm(dim=1, keepdim=True).clamp_min(1e-30)


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
            "self": a[:, torch.arange(len(t)), t].mean(-1), "js": js}


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
    layers = [i for i in range(ad.n_layers) if attention_is_dense(ad, i)]
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


# ---------------------------------------------------------------------------------------------- real removal
def slice_off_heads(model, heads: dict[int, list[int]]) -> int:
    """Remove `heads` ({layer: [query head, ...]}) from the weights in place; returns the parameters removed.

    Every layer must lose the same number of query heads from each of its KV groups (`slicing.balanced_groups`),
    the only removals that keep a valid GQA layout; a layer that loses all its heads becomes a constant sub-layer
    with no KV cache. Checked for every layer before anything changes.
    """
    ad = get_adapter(model)
    heads = {i: hs for i, hs in check_heads(ad, heads).items() if hs}
    for i, hs in heads.items():
        if not attention_is_dense(ad, i):
            raise ValueError(f"layer {i}'s attention is no longer dense (bypassed, dropped or sliced); "
                             "slice heads off a dense model")
        balanced_groups(ad, i, hs)
    before = sum(p.numel() for p in model.parameters())
    for i, hs in heads.items():
        keep_query_heads(ad, i, [h for h in range(ad.n_heads) if h not in hs])
    emptied = [i for i, hs in heads.items() if len(hs) == ad.n_heads]
    if emptied:
        mark_kv_free(model, emptied)
    return before - sum(p.numel() for p in model.parameters())
