"""Notebook 03: which α does the greedy search pick per layer, and does rescaling beat α = 1, α = 0 and α*?"""

from __future__ import annotations

import time

import pandas as pd

from ..data import ppl_windows
from ..harp import HarpPlan, param_report, parse_layers, quarter_depth
from ..models import fingerprint, load_model, model_info
from ..paper import LLAMA31_8B, official_llama31_8b_alphas
from ..prefix import Boundaries, ppl_of_plan
from ..search import closed_form_alphas, refine_alphas, search_alphas

SEARCHED, CLOSED_FORM, REFINED = "HARP, searched α", "HARP, closed-form α*", "HARP, searched + refined α"


def _timed(timing: list, name: str, method: str, fn, *args, **kwargs):
    """fn(*args, **kwargs), appending its wall time to `timing` as one row."""
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    timing.append(dict(model=name, method=method, seconds=time.perf_counter() - start))
    return result


def _variants(model, calib, layers, name: str, refine_sweeps: int, history: list, timing: list) -> dict:
    """{variant: {layer: α}} for every way of setting α, searches timed into `timing`."""
    variants = {SEARCHED: _timed(timing, name, "greedy search (cached)", search_alphas, model, calib, layers,
                                 history=history)}
    variants[CLOSED_FORM] = _timed(timing, name, "closed-form α*", closed_form_alphas, model, calib, layers)
    if refine_sweeps:
        variants[REFINED] = _timed(timing, name, f"refine ({refine_sweeps} sweep)", refine_alphas, model, calib,
                                   variants[SEARCHED], sweeps=refine_sweeps)
    fixed = {"HARP, α = 1": dict.fromkeys(layers, 1.0), "attention dropped, α = 0": dict.fromkeys(layers, 0.0)}
    return variants | fixed


def alpha_study(models: list[str], n_calib: int, n_test: int, seq_len: int, seed: int, dtype: str, device: str,
                n_layers: int = 0, refine_sweeps: int = 0) -> dict:
    """Greedy α search on enwiki-train, then enwiki-test PPL of dense vs HARP with searched / α = 1 / α = 0 /
    closed-form (and refined) α, per model. n_layers = 0 means the paper's depth · 8/32.

    Returns:
        dict of tables: curves (model, layer, alpha, calib_ppl), chosen (model, layer, rank_from_top, source,
        alpha), ablation (model, variant, test_ppl, params_removed, ratio_paper), timing, infos.
    """
    curves, chosen, ablation, timing, infos = [], [], [], [], []
    for name in models:
        model, tok = load_model(name, dtype=dtype, device=device)
        L = fingerprint(model.config)["num_layers"]
        layers = parse_layers(f"top:{n_layers or quarter_depth(L)}", L)
        calib = ppl_windows(tok, "enwiki", "train", n_calib, seq_len, seed)
        history: list = []
        variants = _variants(model, calib, layers, name, refine_sweeps, history, timing)
        curves += [dict(model=name, **{k: r[k] for k in ("layer", "alpha", "calib_ppl")}) for r in history]
        for source, alphas in variants.items():
            if "α =" not in source:
                chosen += [dict(model=name, layer=i, rank_from_top=L - i, source=source, alpha=a)
                           for i, a in alphas.items()]
        bounds = Boundaries(model, ppl_windows(tok, "enwiki", "test", n_test, seq_len, seed))
        for variant, alphas in {"dense": {}, **variants}.items():
            report = param_report(model.config, HarpPlan(fingerprint(model.config), alphas)) if alphas else {}
            ablation.append(dict(model=name, variant=variant, test_ppl=ppl_of_plan(bounds, alphas),
                                 params_removed=report.get("params_removed", 0),
                                 ratio_paper=report.get("ratio_paper", 0.0)))
        infos.append(model_info(model))
        del model, bounds
    depth = LLAMA31_8B["num_hidden_layers"]
    chosen += [dict(model="Llama-3.1-8B (official code)", layer=i, rank_from_top=depth - i, source="official list",
                    alpha=a) for i, a in official_llama31_8b_alphas().items()]
    return {"curves": pd.DataFrame(curves), "chosen": pd.DataFrame(chosen), "ablation": pd.DataFrame(ablation),
            "timing": pd.DataFrame(timing), "infos": infos}


def summarise_alpha(tables: dict) -> dict:
    """Headline numbers: test PPL per variant and model, and the searched α's (top layer first)."""
    out = {}
    for row in tables["ablation"].itertuples():
        out[f"{row.model}/test_ppl/{row.variant}"] = float(row.test_ppl)
    searched = tables["chosen"][tables["chosen"].source == SEARCHED]
    for name, part in searched.groupby("model"):
        out[f"{name}/searched_alphas_top_first"] = [float(a) for a in part.sort_values("rank_from_top").alpha]
    for row in tables["timing"].itertuples():
        out[f"{row.model}/seconds/{row.method}"] = float(row.seconds)
    return out
