"""Notebook 01: do token representations become alike in high layers, and how far is attention from its bypass?"""

from __future__ import annotations

import pandas as pd

from ..analysis import layer_metrics
from ..checkpoints import load_model
from ..data import ppl_windows


def analyse_models(models: list[str], n_windows: int, seq_len: int, seed: int, dtype: str = "float32",
                   device: str = "cpu") -> pd.DataFrame:
    """layer_metrics for each model on the same enwiki-test windows spec (each model's own tokenizer).

    Returns:
        DataFrame: model, layer, depth, metric, value (see analysis.layer_metrics).
    """
    tables = []
    for name in models:
        model, tok = load_model(name, dtype=dtype, device=device)
        windows = ppl_windows(tok, "enwiki", "test", n_windows, seq_len, seed)
        tables.append(layer_metrics(model, windows, name=name))
        del model
    return pd.concat(tables, ignore_index=True)


def summarise_over_smoothing(df: pd.DataFrame) -> dict:
    """Headline numbers per model: similarity in the bottom vs top quarter of depth, where the bypass
    error (after the best rescaling) is smallest, and the mean best α in the top quarter."""
    out = {}
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
