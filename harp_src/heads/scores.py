"""Head importance scores in one place: the raw per-head statistics (Taylor, LRP, entropy, sink and self mass), the
keep score each pruning metric ranks by, re-scoring a gated model, and the tables and rank correlations of them."""

from __future__ import annotations

import pandas as pd
import torch
from scipy import stats as sstats

from ..model.adapter import get_adapter
from .gates import gate_gradients, per_layer_l2, taylor_head_scores
from .lrp import lrp_head_scores
from .patterns import head_statistics, most_redundant

HEAD_METRICS = ("taylor", "taylor_raw", "lrp", "entropy", "sink", "random")  # what ranks heads for pruning


SHOWN_SCORES = ("taylor", "taylor_raw", "lrp", "entropy_norm", "sink", "self")  # the heat maps and their correlations


# ---------------------------------------------------------------------------------------------- scores
def keep_score(metric: str, raw: dict[str, torch.Tensor], seed: int = 0) -> torch.Tensor:
    """Keep scores (higher = keep) of one pruning metric from the raw per-head statistics it needs.

    taylor (normalised per layer, as Michel et al.), taylor_raw (not normalised: one scale over all layers), lrp: as
    measured; entropy: 1 − normalised entropy (near-uniform averaging heads go first); sink: 1 − mass on the first
    token (degenerate sink heads go first); random: uniform noise (seeded), shaped like any raw statistic.
    """
    if metric in ("taylor", "taylor_raw", "lrp"):
        return raw[metric].double()
    if metric == "entropy":
        return 1 - raw["entropy_norm"].double()
    if metric == "sink":
        return 1 - raw["sink"].double()
    shape = next(iter(raw.values())).shape
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64, device="cpu")


def keep_scores(raw: dict[str, torch.Tensor], seed: int = 0) -> dict[str, torch.Tensor]:
    """`keep_score` of every metric of HEAD_METRICS."""
    return {m: keep_score(m, raw, seed) for m in HEAD_METRICS}


def head_grid(heads: pd.DataFrame, column: str, shape) -> torch.Tensor:
    out = torch.full(shape, float("nan"), dtype=torch.float64, device="cpu")
    for r in heads.itertuples():
        out[r.layer, r.head] = getattr(r, column)
    return out


def head_scores(model, calib: torch.Tensor, progress: bool = True) -> tuple[dict[str, torch.Tensor], pd.DataFrame]:
    """Raw per-head statistics [n_layers, n_heads] (taylor, taylor_raw, lrp, entropy, entropy_norm, sink, self) and
    the pairs table of `heads.patterns.head_statistics` (js, cos per pair of heads in a layer)."""
    ad = get_adapter(model)
    heads, pairs = head_statistics(model, calib, progress)
    grads = gate_gradients(model, calib, progress).abs().mean(0).double()
    raw = {"taylor": per_layer_l2(grads), "taylor_raw": grads,
           "lrp": lrp_head_scores(model, calib, progress=progress).double()}
    raw |= {c: head_grid(heads, c, (ad.n_layers, ad.n_heads)) for c in ("entropy", "entropy_norm", "sink", "self")}
    return raw, pairs


def scores_table(raw: dict[str, torch.Tensor], model: str) -> pd.DataFrame:
    """Long form: model, metric, layer, head, score."""
    rows = [dict(model=model, metric=m, layer=i, head=h, score=float(t[i, h]))
            for m, t in raw.items() for i in range(t.shape[0]) for h in range(t.shape[1])]
    return pd.DataFrame(rows)


def metric_correlations(scores: pd.DataFrame, metrics: tuple[str, ...] = SHOWN_SCORES) -> pd.DataFrame:
    """Spearman rank correlation over all heads of each pair of metrics, per model: model, a, b, rho, p."""
    rows = []
    for model, part in scores.groupby("model", sort=False):
        wide = part.pivot_table(index=["layer", "head"], columns="metric", values="score")
        for k, a in enumerate(metrics):
            for b in metrics[k + 1:]:
                res = sstats.spearmanr(wide[a], wide[b])
                rows.append(dict(model=model, a=a, b=b, rho=float(res.statistic), p=float(res.pvalue)))
    return pd.DataFrame(rows)


def redundancy_by_layer(pairs: pd.DataFrame, scores: pd.DataFrame) -> pd.DataFrame:
    """Per model and layer: the most similar pair's JS (bits), the highest output cosine, and the largest sink mass
    of any head; long form with metric, value (for one figure with a panel per metric)."""
    best = most_redundant(pairs)
    sink = scores[scores.metric == "sink"].groupby(["model", "layer"]).score.max().rename("max_sink").reset_index()
    wide = best.merge(sink, on=["model", "layer"])
    n = wide.groupby("model").layer.transform("max").clip(lower=1)
    wide["depth"] = wide.layer / n
    return wide.melt(id_vars=["model", "layer", "depth"], value_vars=["js", "cos", "max_sink"], var_name="metric",
                     value_name="value")


def rescore(model, metric: str, calib, seed: int) -> torch.Tensor:
    """Keep scores of `metric` on `model` as it is now (its gates included)."""
    if metric in ("taylor", "taylor_raw"):
        return taylor_head_scores(model, calib, normalise=metric == "taylor", progress=False)
    if metric == "lrp":
        return lrp_head_scores(model, calib, progress=False).double()
    ad = get_adapter(model)
    shape = (ad.n_layers, ad.n_heads)
    if metric == "random":
        return keep_score(metric, {"shape": torch.empty(shape, device="meta")}, seed)
    heads, _ = head_statistics(model, calib, progress=False)
    return keep_score(metric, {c: head_grid(heads, c, shape) for c in ("entropy_norm", "sink")}, seed)
