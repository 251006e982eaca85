"""Notebook 05: top-N vs bottom-N vs importance-chosen vs random layers, searched α vs α = 1, two corpora; N sweep."""

from __future__ import annotations

import numpy as np
import pandas as pd
from tqdm.auto import tqdm

from ..checkpoints import load_model
from ..data import ppl_windows
from ..harp import n_values, parse_layers, quarter_depth
from ..importance import layer_scores, lowest
from ..models import fingerprint, model_info
from ..prefix import Boundaries, ppl_of_plan
from ..search import search_alphas

CORPORA = ("enwiki", "lee")  # in-domain and out-of-domain test text
ALPHA_MODES = ("searched", "α = 1")


def _selections(scores: pd.DataFrame, L: int, n: int, random_seeds) -> list[tuple[str, int, list[int]]]:
    """(selection, seed, layers) for every way of choosing the n layers to prune."""
    out = [("top-N", 0, parse_layers(f"top:{n}", L)), ("bottom-N", 0, parse_layers(f"bottom:{n}", L)),
           ("lowest attention BI", 0, lowest(scores, "bi_attn", n)),
           ("lowest Taylor sensitivity", 0, lowest(scores, "taylor", n)),
           ("smallest bypass error", 0, lowest(scores, "bypass_error", n))]
    for seed in random_seeds:
        out.append(("random", seed, sorted(np.random.default_rng(seed).choice(L, n, replace=False).tolist())))
    return out


def _selection_rows(model, calib, tests: dict, scores, name: str, n: int, grid, random_seeds, memo: dict) -> list:
    """One row per selection, α mode and test corpus (random: one per seed)."""
    L = fingerprint(model.config)["num_layers"]
    rows = []
    for selection, rseed, layers in tqdm(_selections(scores, L, n, random_seeds), desc=f"selections {name}"):
        for mode in ALPHA_MODES:
            alphas = (search_alphas(model, calib, layers, grid, memo=memo) if mode == "searched"
                      else dict.fromkeys(layers, 1.0))
            for corpus, bounds in tests.items():
                rows.append(dict(model=name, selection=selection, seed=rseed, n_layers=n, alpha_mode=mode,
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


def selection_study(models: list[str], n_calib: int, n_test: int, seq_len: int, seed: int, dtype: str,
                    device: str, n_layers: int = 0, grid: tuple = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0),
                    random_seeds: tuple = (0, 1, 2), n_max_frac: float = 0.5) -> dict:
    """The paper's ablations: which N layers to prune (top, bottom, by importance, random), with α searched on
    enwiki-train or α = 1, evaluated on enwiki-test and the out-of-domain Lee news test split; plus an N sweep
    for top-N (one greedy search of the deepest N gives every shallower top-N, since greedy works top-down).

    Returns:
        dict: selection (model, selection, seed, n_layers, alpha_mode, corpus, ppl, layers), n_sweep (model,
        n_layers, alpha_mode, ppl), scores (per-layer importance), infos.
    """
    sel_rows, sweep_rows, score_tables, infos = [], [], [], []
    for name in models:
        model, tok = load_model(name, dtype=dtype, device=device)
        L = fingerprint(model.config)["num_layers"]
        calib = ppl_windows(tok, "enwiki", "train", n_calib, seq_len, seed)
        scores = layer_scores(model, calib)
        score_tables.append(scores.assign(model=name))
        tests = {c: Boundaries(model, ppl_windows(tok, c, "test", n_test, seq_len, seed)) for c in CORPORA}
        sel_rows += [dict(model=name, selection="dense", seed=0, n_layers=0, alpha_mode="-", corpus=corpus,
                          ppl=ppl_of_plan(bounds, {}), layers="") for corpus, bounds in tests.items()]
        memo: dict = {}  # searches share their top layers' α's (see search_alphas); the deepest top-N goes first
        deepest = parse_layers(f"top:{max(n_values(L, n_max_frac))}", L)
        greedy = search_alphas(model, calib, deepest, grid, memo=memo)
        sel_rows += _selection_rows(model, calib, tests, scores, name, n_layers or quarter_depth(L), grid,
                                    random_seeds, memo)
        sweep_rows += _sweep_rows(tests["enwiki"], greedy, deepest, name, L, n_max_frac)
        infos.append(model_info(model))
        del model, tests
    return {"selection": pd.DataFrame(sel_rows), "n_sweep": pd.DataFrame(sweep_rows),
            "scores": pd.concat(score_tables, ignore_index=True), "infos": infos}


def summarise_selection(tables: dict) -> dict:
    """Headline numbers: test PPL per model, selection (random: mean over seeds), α mode and corpus."""
    df = tables["selection"]
    g = df.groupby(["model", "selection", "alpha_mode", "corpus"]).ppl.mean()
    return {f"{m}/{s}/{a}/{c}": float(v) for (m, s, a, c), v in g.items()}
