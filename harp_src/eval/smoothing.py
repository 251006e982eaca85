"""Over-smoothing metrics per layer, from forward hooks on the decoder layers (never the post-norm output).

- similarity: Sim(H) = 2/(N(N-1)) Σ_{i<j} cos(h_i, h_j) of the hidden state entering each layer (+ the final one)
- bi_block / bi_attn: 1 - mean_t cos(x_in, x_out) of the whole block / of x_in vs x_in + attention branch
- entropy: attention entropy (nats) per layer and head, mean over query positions (eager attention)
- bypass_error: ‖a - b‖ / ‖a‖, a = the layer's attention branch, b = the same with A = I; alpha_star = ⟨a, b⟩/‖b‖²
  and bypass_error_rescaled = ‖a - α* b‖ / ‖a‖ (all pooled over every token of every window)
"""

from __future__ import annotations

from collections import defaultdict

import pandas as pd
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..model.adapter import attention_backend, get_adapter


def mean_pairwise_cosine(h: torch.Tensor) -> torch.Tensor:
    """Sim(H) for each sequence. h: [B, T, d] -> [B]; uses ‖Σ u_i‖² = T + 2 Σ_{i<j} cos(h_i, h_j)."""
    u = F.normalize(h.float(), dim=-1)
    t = h.shape[1]
    return (u.sum(1).pow(2).sum(-1) - t) / (t * (t - 1))


def one_minus_cos(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """1 - mean_t cos(x_t, y_t), per sequence. [B, T, d] x2 -> [B]."""
    return 1 - F.cosine_similarity(x.float(), y.float(), dim=-1).mean(-1)


def attention_entropy(weights: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of each attention row, mean over queries. weights: [B, H, T, T] -> [B, H]."""
    p = weights.float()
    return -(p * torch.log(p.clamp_min(1e-30))).sum(-1).mean(-1)




class _Collector:
    """Hooks that turn each forward into per-layer sums; pooled into metrics at the end."""

    def __init__(self, model, entropy: bool):
        self.ad = get_adapter(model)
        self.sums = defaultdict(float)
        self.entropy = defaultdict(lambda: torch.zeros(self.ad.n_heads, device="cpu"))
        self.n_seq = 0
        self.handles = []
        for i, layer in enumerate(self.ad.layers):
            self.handles.append(layer.register_forward_pre_hook(self._enter(i), with_kwargs=True))
            self.handles.append(layer.register_forward_hook(self._leave(i), with_kwargs=True))
            attn = self.ad.attention(i)
            if self.ad.attention_is_dense(i):  # HARP-bypassed, dropped or sliced attention has no A to compare
                self.handles.append(attn.register_forward_hook(self._attn(i, entropy), with_kwargs=True))
        self.handles.append(self.ad.final_norm.register_forward_pre_hook(self._final))
        self.x_in: dict[int, torch.Tensor] = {}

    def _enter(self, i):
        def hook(mod, args, kwargs):
            h = args[0] if args else kwargs["hidden_states"]
            self.x_in[i] = h
            self.sums[("similarity", i)] += mean_pairwise_cosine(h).sum().item()
        return hook

    def _leave(self, i):
        def hook(mod, args, kwargs, out):
            out = out[0] if isinstance(out, tuple) else out
            self.sums[("bi_block", i)] += one_minus_cos(self.x_in[i], out).sum().item()
        return hook

    def _attn(self, i, entropy):
        def hook(mod, args, kwargs, out):
            x = kwargs["hidden_states"]
            a = self.ad.residual_branch(i, out[0]).double()  # float64: the rescaled error subtracts sums
            b = self.ad.residual_branch(i, self.ad.value_path(mod, x)).double()
            self.sums[("bi_attn", i)] += one_minus_cos(self.x_in[i], self.x_in[i] + a).sum().item()
            self.sums[("aa", i)] += a.pow(2).sum().item()
            self.sums[("bb", i)] += b.pow(2).sum().item()
            self.sums[("ab", i)] += (a * b).sum().item()
            self.sums[("diff", i)] += (a - b).pow(2).sum().item()
            if entropy and out[1] is not None:
                self.entropy[i] += attention_entropy(out[1]).sum(0).cpu()
        return hook

    def _final(self, mod, args):
        self.sums[("similarity", self.ad.n_layers)] += mean_pairwise_cosine(args[0]).sum().item()

    def close(self):
        for h in self.handles:
            h.remove()


def _rows(col: _Collector, name: str, entropy: bool) -> list[dict]:
    ad, s, n = col.ad, col.sums, col.n_seq
    L = ad.n_layers
    rows = [dict(model=name, layer=i, depth=i / L, metric="similarity", value=s[("similarity", i)] / n)
            for i in range(L + 1)]
    for i in range(L):
        depth = i / (L - 1) if L > 1 else 0.0
        vals = {"bi_block": s[("bi_block", i)] / n}
        if ("aa", i) in s:  # dense attention layer
            aa, bb, ab, diff = (s[(k, i)] for k in ("aa", "bb", "ab", "diff"))
            alpha = ab / bb if bb > 0 else 0.0
            vals |= {
                "bi_attn": s[("bi_attn", i)] / n,
                "bypass_error": (diff / aa) ** 0.5,
                "alpha_star": alpha,
                "bypass_error_rescaled": max(aa - 2 * alpha * ab + alpha**2 * bb, 0.0) ** 0.5 / aa**0.5,
            }
            if entropy:
                vals |= {f"entropy_h{h}": e / n for h, e in enumerate(col.entropy[i].tolist())}
        rows += [dict(model=name, layer=i, depth=depth, metric=k, value=v) for k, v in vals.items()]
    return rows


@torch.no_grad()
def layer_metrics(model, windows: torch.Tensor, name: str = "model", batch_size: int = 1,
                  entropy: bool = True) -> pd.DataFrame:
    """All over-smoothing metrics of one model on `windows` [n, T], in long form.

    Returns:
        DataFrame with columns model, layer, depth (layer / L for similarity, layer / (L-1) otherwise),
        metric, value. Entropy rows are named entropy_h{head}.
    """
    if windows.ndim != 2 or windows.shape[1] < 2:
        raise ValueError("windows must be [n_windows, seq_len] with seq_len >= 2")
    device = next(model.parameters()).device
    col = _Collector(model, entropy)
    decoder = model.get_decoder()
    try:
        with attention_backend(model, "eager" if entropy else model.config._attn_implementation):
            for start in tqdm(range(0, len(windows), batch_size), desc=f"analysis {name}", leave=False):
                ids = windows[start : start + batch_size].to(device)
                decoder(input_ids=ids, use_cache=False)  # the LM head is not needed here
                col.n_seq += len(ids)
                col.x_in.clear()
    finally:
        col.close()
    return pd.DataFrame(_rows(col, name, entropy))


def entropy_by_layer(df: pd.DataFrame) -> pd.DataFrame:
    """Mean over heads of the per-head entropy rows, as metric 'entropy' (plus min/max over heads)."""
    ent = df[df.metric.str.startswith("entropy_h")]
    g = ent.groupby(["model", "layer", "depth"]).value
    out = g.agg(["mean", "min", "max"]).reset_index().rename(columns={"mean": "value"})
    out["metric"] = "entropy"
    return out
