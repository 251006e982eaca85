"""Per-layer importance of the attention sub-layer, used to pick which layers to prune in the ablations.

- taylor: first-order Taylor estimate of the loss change when the attention branch a is removed,
  |Σ_tokens (∂loss/∂a) · a| (Michel et al.'s masking confidence, at layer rather than head granularity)
- bi_attn and bypass_error come from `eval.smoothing.layer_metrics`.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from ..eval.smoothing import layer_metrics
from ..model.adapter import get_adapter
from ..model.nll import next_token_nll


def taylor_sensitivity(model, windows: torch.Tensor, batch_size: int = 2) -> dict[int, float]:
    """|Σ (∂ loss / ∂ a) · a| per layer, a = what the attention sub-layer adds to the residual stream.

    Args:
        windows: calibration windows [n, T]; loss = summed next-token NLL.
    Returns:
        {layer: score}; small = removing that layer's attention should change the loss least.
    """
    ad = get_adapter(model)
    device = next(model.parameters()).device
    branches: dict[int, torch.Tensor] = {}
    handles = []
    for i in range(ad.n_layers):
        target = ad.branch_module(i)

        def keep(mod, args, out, i=i):
            a = out[0] if isinstance(out, tuple) else out
            a.retain_grad()
            branches[i] = a

        handles.append(target.register_forward_hook(keep))
    scores = np.zeros(ad.n_layers)
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(windows), batch_size):
            ids = windows[start : start + batch_size].to(device)
            model.zero_grad(set_to_none=True)
            next_token_nll(model(input_ids=ids, use_cache=False).logits, ids, "sum").backward()
            for i, a in branches.items():
                scores[i] += (a.grad * a).sum().item()
            branches.clear()
    finally:
        for h in handles:
            h.remove()
        model.zero_grad(set_to_none=True)
        model.train(was_training)
    return {i: abs(float(s)) for i, s in enumerate(scores)}


def layer_scores(model, windows: torch.Tensor) -> pd.DataFrame:
    """One row per layer: bi_attn, bypass_error (from analysis) and taylor (this module)."""
    df = layer_metrics(model, windows, entropy=False)
    wide = df[df.metric.isin(["bi_attn", "bypass_error"])].pivot_table(index="layer", columns="metric",
                                                                      values="value")
    wide["taylor"] = pd.Series(taylor_sensitivity(model, windows))
    return wide.reset_index()


def lowest_layers(scores: pd.DataFrame, column: str, n: int) -> list[int]:
    """The n layers with the smallest score (ties: the higher layer first)."""
    ranked = scores.sort_values([column, "layer"], ascending=[True, False])
    return sorted(int(i) for i in ranked.layer.head(n))
