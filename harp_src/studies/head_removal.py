"""Notebook 02: what does removing attention from N top vs bottom layers cost (α = 1, α = 0), and what does it save?"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import pandas as pd
from tqdm.auto import tqdm
from transformers import AutoConfig

from ..checkpoints import load_model
from ..data.corpora import ppl_windows
from ..eval.perplexity import greedy_text
from ..method.accounting import param_report
from ..method.harp import HarpPlan, apply_harp
from ..method.layers import n_values, parse_layers, quarter_depth
from ..method.prefix import Boundaries, nll_of_plan
from ..model.adapter import fingerprint
from ..model.loading import model_info, resolve_source
from ..report.params import StudyParams

SAVINGS = [("parameters removed, paper convention", "ratio_paper"), ("parameters removed, whole model", "ratio_model"),
           ("KV cache removed", "kv_cache_cut")]


@dataclass(frozen=True)
class HeadRemovalParams(StudyParams):
    """Notebook 02's parameters: the models, the enwiki-test windows, how deep the N sweep goes, a prompt to show."""

    NOTEBOOK: ClassVar[str] = "02_head_removal"
    models: list[str]
    n_windows: int
    seq_len: int
    n_max_frac: float
    prompt: str
    seed: int
    dtype: str
    device: str


SELECTIONS, ALPHAS = ("top", "bottom"), (1.0, 0.0)  # which N layers, and the two fixed α's


def removal_sweep(model, windows, name: str, n_max_frac: float = 0.5, batch_size: int = 4) -> pd.DataFrame:
    """Test PPL for N pruned layers chosen top-N or bottom-N, for each fixed α; N = 0 is the dense model.

    Returns:
        DataFrame: model, selection, n_layers, alpha, ppl, params_removed, ratio_paper, ratio_model, kv_cache_cut
    """
    bounds = Boundaries(model, windows, batch_size)
    L = bounds.ad.n_layers
    nll, count = bounds.nll_from(0)
    rows = [dict(model=name, selection=s, n_layers=0, alpha=a, ppl=math.exp(nll / count), params_removed=0,
                 ratio_paper=0.0, ratio_model=0.0, kv_cache_cut=0.0) for s in SELECTIONS for a in ALPHAS]
    todo = [(s, n, a) for s in SELECTIONS for n in n_values(L, n_max_frac) for a in ALPHAS]
    for sel, n, alpha in tqdm(todo, desc=f"removal sweep {name}"):
        layers = parse_layers(f"{sel}:{n}", L)
        nll, count = nll_of_plan(bounds, layers, alpha)
        report = param_report(model.config, HarpPlan(fingerprint(model.config), dict.fromkeys(layers, alpha)))
        rows.append(dict(model=name, selection=sel, n_layers=n, alpha=alpha, ppl=math.exp(nll / count),
                         **{k: report[k] for k in ("params_removed", "ratio_paper", "ratio_model", "kv_cache_cut")}))
    return pd.DataFrame(rows).assign(n_layers_total=L)


def removal_study(p: HeadRemovalParams) -> tuple[pd.DataFrame, list[dict]]:
    """removal_sweep for each model on its enwiki-test windows; also returns each model's provenance."""
    tables, infos = [], []
    for name in p.models:
        model, tok = load_model(name, dtype=p.dtype, device=p.device)
        windows = ppl_windows(tok, "enwiki", "test", p.n_windows, p.seq_len, p.seed)
        tables.append(removal_sweep(model, windows, name, n_max_frac=p.n_max_frac))
        infos.append(model_info(model))
    return pd.concat(tables, ignore_index=True), infos


def savings_table(p: HeadRemovalParams) -> pd.DataFrame:
    """Parameter and KV-cache savings of top-N HARP (α = 1 and α = 0) from each model's config alone.

    Returns:
        DataFrame: model, n_layers, alpha, metric (one of SAVINGS), value (percent).
    """
    rows = []
    for name in p.models:
        config = AutoConfig.from_pretrained(resolve_source(name)[0])
        L = fingerprint(config)["num_layers"]
        for n in n_values(L, p.n_max_frac):
            for alpha in (1.0, 0.0):
                layers = parse_layers(f"top:{n}", L)
                r = param_report(config, HarpPlan(fingerprint(config), dict.fromkeys(layers, alpha)))
                rows += [dict(model=name, n_layers=n, alpha=alpha, metric=metric, value=100 * r[key])
                         for metric, key in SAVINGS]
    return pd.DataFrame(rows)


def side_by_side(p: HeadRemovalParams, max_new_tokens: int = 30) -> pd.DataFrame:
    """Greedy text of each dense model and of its top-N (N = depth/4) HARP versions with α = 1 and α = 0, from the
    notebook's PROMPT."""
    rows = []
    for name in p.models:
        for alpha in (None, 1.0, 0.0):
            model, tok = load_model(name, dtype=p.dtype, device=p.device)
            n = quarter_depth(fingerprint(model.config)["num_layers"])
            if alpha is not None:
                apply_harp(model, f"top:{n}", alpha)
            label = "dense" if alpha is None else f"top-{n}, α = {alpha}"
            rows.append(dict(model=name, variant=label, text=greedy_text(model, tok, p.prompt, max_new_tokens)))
    return pd.DataFrame(rows)


def summarise_removal(df: pd.DataFrame) -> dict:
    """Headline numbers: dense PPL and PPL at N = depth/4 for top/bottom × α = 1/0, per model."""
    out = {}
    for name, part in df.groupby("model"):
        out[f"{name}/dense_ppl"] = float(part[part.n_layers == 0].ppl.iloc[0])
        n = min(quarter_depth(int(part.n_layers_total.iloc[0])), int(part.n_layers.max()))
        for (sel, alpha), rows in part[part.n_layers == n].groupby(["selection", "alpha"]):
            out[f"{name}/ppl_{sel}{n}_alpha{alpha:g}"] = float(rows.ppl.iloc[0])
        out[f"{name}/ratio_paper_top{n}_alpha1"] = float(
            part[(part.n_layers == n) & (part.selection == "top") & (part.alpha == 1.0)].ratio_paper.iloc[0])
    return out
