"""Notebook 01: do token representations become alike in high layers, and how far is attention from its bypass?"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import pandas as pd

from ..checkpoints import load_model
from ..data.corpora import ppl_windows
from ..eval.smoothing import layer_metrics
from ..report.params import StudyParams


@dataclass(frozen=True)
class OverSmoothingParams(StudyParams):
    """Notebook 01's parameters: the models, and the enwiki-test windows every metric is measured on."""

    NOTEBOOK: ClassVar[str] = "01_over_smoothing"
    models: list[str]
    n_windows: int
    seq_len: int
    seed: int
    dtype: str
    device: str


def analyse_models(p: OverSmoothingParams) -> pd.DataFrame:
    """layer_metrics for each model on the same enwiki-test windows spec (each model's own tokenizer).

    Returns:
        DataFrame: model, layer, depth, metric, value (see eval.smoothing.layer_metrics).
    """
    tables = []
    for name in p.models:
        model, tok = load_model(name, dtype=p.dtype, device=p.device)
        windows = ppl_windows(tok, "enwiki", "test", p.n_windows, p.seq_len, p.seed)
        tables.append(layer_metrics(model, windows, name=name))
        del model
    return pd.concat(tables, ignore_index=True)


def uniform_causal_entropy(seq_len: int) -> float:
    """Mean attention entropy (nats) of uniform causal attention over a window: position t spreads over t tokens,
    so its entropy is ln t; averaged over t = 1..seq_len. The reference for "attention degenerates toward
    averaging"."""
    return float(np.log(np.arange(1, seq_len + 1)).mean())


def summarise_over_smoothing(df: pd.DataFrame, seq_len: int) -> dict:
    """Headline numbers per model: similarity in the bottom vs top quarter of depth, where the bypass
    error (after the best rescaling) is smallest, and the mean best α in the top quarter; and the entropy uniform
    causal attention would have over `seq_len`-token windows."""
    out = {"uniform_causal_entropy": uniform_causal_entropy(seq_len)}
    for name, part in df.groupby("model"):
        sim = part[(part.metric == "similarity") & (part.layer > 0)]  # layer 0 input = raw embeddings
        rescaled = part[part.metric == "bypass_error_rescaled"]
        alpha = part[part.metric == "alpha_star"]
        best = rescaled.loc[rescaled.value.idxmin()]
        out |= {
            f"{name}/similarity_bottom_quarter": float(sim[sim.depth <= 0.25].value.mean()),
            f"{name}/similarity_top_quarter": float(sim[sim.depth >= 0.75].value.mean()),
            f"{name}/min_bypass_error_rescaled": float(best.value),
            f"{name}/min_bypass_error_layer": int(best.layer),
            f"{name}/alpha_star_top_quarter": float(alpha[alpha.depth >= 0.75].value.mean()),
            f"{name}/alpha_star_bottom_quarter": float(alpha[alpha.depth <= 0.25].value.mean()),
        }
    return out
