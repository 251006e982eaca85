"""Notebook 05: top-N vs bottom-N vs importance-chosen vs random layers, searched α vs α = 1, two corpora; N sweep."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import pandas as pd
from tqdm.auto import tqdm

from ..checkpoints import load_model
from ..data.corpora import ppl_windows
from ..method.layer_choice import layer_scores, lowest_layers
from ..method.layers import n_values, parse_layers, quarter_depth
from ..method.prefix import Boundaries, ppl_of_plan
from ..method.search import search_alphas
from ..model.adapter import fingerprint
from ..model.loading import model_info
from ..report.params import StudyParams

CORPORA = ("enwiki", "lee")  # in-domain and out-of-domain test text
ALPHA_MODES = ("searched", "α = 1")
ABLATION_GRID = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)  # a coarser α grid than the paper's: ~40 searches per model


@dataclass(frozen=True)
class AblationsParams(StudyParams):
    """Notebook 05's parameters: the models, calibration and test windows, N, the N sweep's depth, random sets."""

    NOTEBOOK: ClassVar[str] = "05_ablations"
    models: list[str]
    n_calib: int
    n_test: int
    seq_len: int
    n_layers: int
    n_max_frac: float
    random_seeds: list[int]
    seed: int
    dtype: str
    device: str


@dataclass
class _Run:
    """One model's share of the study: the model, its calibration windows and its test boundaries per corpus."""

    name: str
    model: object
    calib: object
    tests: dict
    memo: dict = field(default_factory=dict)  # searches share their top layers' α's (see search_alphas)


def _selections(scores: pd.DataFrame, L: int, n: int, random_seeds) -> list[tuple[str, int, list[int]]]:
    """(selection, seed, layers) for every way of choosing the n layers to prune."""
    out = [("top-N", 0, parse_layers(f"top:{n}", L)), ("bottom-N", 0, parse_layers(f"bottom:{n}", L)),
           ("lowest attention BI", 0, lowest_layers(scores, "bi_attn", n)),
           ("lowest Taylor sensitivity", 0, lowest_layers(scores, "taylor", n)),
           ("smallest bypass error", 0, lowest_layers(scores, "bypass_error", n))]
    for seed in random_seeds:
        out.append(("random", seed, sorted(np.random.default_rng(seed).choice(L, n, replace=False).tolist())))
    return out


def _selection_rows(run: _Run, scores, n: int, random_seeds) -> list:
    """One row per selection, α mode and test corpus (random: one per seed)."""
    L = fingerprint(run.model.config)["num_layers"]
    rows = []
    for selection, rseed, layers in tqdm(_selections(scores, L, n, random_seeds), desc=f"selections {run.name}"):
        for mode in ALPHA_MODES:
            alphas = (search_alphas(run.model, run.calib, layers, ABLATION_GRID, memo=run.memo) if mode == "searched"
                      else dict.fromkeys(layers, 1.0))
            for corpus, bounds in run.tests.items():
                rows.append(dict(model=run.name, selection=selection, seed=rseed, n_layers=n, alpha_mode=mode,
                                 corpus=corpus, ppl=ppl_of_plan(bounds, alphas), layers=" ".join(map(str, layers))))
    return rows


def _sweep_rows(bounds: Boundaries, greedy: dict[int, float], deepest: list[int], name: str, L: int,
                n_max_frac: float) -> list:
    """Top-N for every N of the sweep, searched α (the deepest search's top N) and α = 1."""
    rows = []
    for k in n_values(L, n_max_frac):
        top = deepest[-k:]
        for mode, alphas in (("searched", {i: greedy[i] for i in top}), ("α = 1", dict.fromkeys(top, 1.0))):
            rows.append(dict(model=name, n_layers=k, alpha_mode=mode, corpus="enwiki", ppl=ppl_of_plan(bounds, alphas)))
    return rows


def selection_study(p: AblationsParams) -> dict:
    """The paper's ablations: which N layers to prune (top, bottom, by importance, random), with α searched on
    enwiki-train or α = 1, evaluated on enwiki-test and the out-of-domain Lee news test split; plus an N sweep
    for top-N (one greedy search of the deepest N gives every shallower top-N, since greedy works top-down).

    Returns:
        dict: selection (model, selection, seed, n_layers, alpha_mode, corpus, ppl, layers), n_sweep (model,
        n_layers, alpha_mode, ppl), scores (per-layer importance), infos.
    """
    sel_rows, sweep_rows, score_tables, infos = [], [], [], []
    for name in p.models:
        model, tok = load_model(name, dtype=p.dtype, device=p.device)
        L = fingerprint(model.config)["num_layers"]
        calib = ppl_windows(tok, "enwiki", "train", p.n_calib, p.seq_len, p.seed)
        scores = layer_scores(model, calib)
        score_tables.append(scores.assign(model=name))
        tests = {c: Boundaries(model, ppl_windows(tok, c, "test", p.n_test, p.seq_len, p.seed)) for c in CORPORA}
        run = _Run(name, model, calib, tests)
        sel_rows += [dict(model=name, selection="dense", seed=0, n_layers=0, alpha_mode="-", corpus=corpus,
                          ppl=ppl_of_plan(bounds, {}), layers="") for corpus, bounds in tests.items()]
        deepest = parse_layers(f"top:{max(n_values(L, p.n_max_frac))}", L)  # the deepest top-N goes first
        greedy = search_alphas(model, calib, deepest, ABLATION_GRID, memo=run.memo)
        sel_rows += _selection_rows(run, scores, p.n_layers or quarter_depth(L), tuple(p.random_seeds))
        sweep_rows += _sweep_rows(tests["enwiki"], greedy, deepest, name, L, p.n_max_frac)
        infos.append(model_info(model))
        del model, tests, run
    return {"selection": pd.DataFrame(sel_rows), "n_sweep": pd.DataFrame(sweep_rows),
            "scores": pd.concat(score_tables, ignore_index=True), "infos": infos}


def summarise_selection(tables: dict) -> dict:
    """Headline numbers: test PPL per model, selection (random: mean over seeds), α mode and corpus."""
    df = tables["selection"]
    g = df.groupby(["model", "selection", "alpha_mode", "corpus"]).ppl.mean()
    return {f"{m}/{s}/{a}/{c}": float(v) for (m, s, a, c), v in g.items()}
