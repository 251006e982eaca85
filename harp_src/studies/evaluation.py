"""Notebook 08: dense vs HARP variants of each model through the lm-eval task suite and the synthetic long-context
tasks, as tidy tables (the paper's results table, issue 6)."""

from __future__ import annotations

import time

import pandas as pd

from ..data import ppl_windows
from ..evaluate import DISCRIMINATIVE, GENERATION, run_tasks
from ..harp import apply_harp, parse_layers, quarter_depth
from ..longcontext import long_context_eval, multidoc_items, passkey_items
from ..models import fingerprint, load_model, model_info
from ..search import search_alphas

DENSE, SEARCHED, ALPHA1, ALPHA0 = "dense", "HARP, searched α", "HARP, α = 1", "attention dropped, α = 0"
METHODS = (DENSE, SEARCHED, ALPHA1, ALPHA0)
LONG_CONTEXT_METHODS = (DENSE, SEARCHED)  # the figure compares these two


def method_alphas(model, tok, n_layers: int, n_calib: int, seq_len: int, seed: int) -> dict[str, dict | None]:
    """{method: {layer: α}} for the top-N layers (N = 0: the paper's depth · 8/32); α searched on enwiki-train."""
    L = fingerprint(model.config)["num_layers"]
    layers = parse_layers(f"top:{n_layers or quarter_depth(L)}", L)
    calib = ppl_windows(tok, "enwiki", "train", n_calib, seq_len, seed)
    return {DENSE: None, SEARCHED: search_alphas(model, calib, layers), ALPHA1: dict.fromkeys(layers, 1.0),
            ALPHA0: dict.fromkeys(layers, 0.0)}


def long_context_items(tok, lengths, depths, n_per_cell: int, seed: int) -> list[dict]:
    """Passkey and multi-document QA items for every length and depth (see longcontext)."""
    return passkey_items(tok, lengths, depths, n_per_cell, seed) + multidoc_items(tok, lengths, depths, n_per_cell,
                                                                                  seed)


def evaluation_study(models: list[str], tasks: list[str], limit, num_fewshot, n_calib: int, seq_len: int,
                     lc_lengths: list[int], lc_depths: list[float], lc_per_cell: int, seed: int, dtype: str,
                     device: str, n_layers: int = 0, batch_size: int = 8) -> dict:
    """Every method of METHODS through run_tasks; the LONG_CONTEXT_METHODS also through the long-context items.

    Returns:
        dict: results (model, method + run_tasks columns), long_context (model, method + long_context_eval
        columns), alphas (model, layer, alpha), seconds (model, seconds: wall time of that model's part), infos.
    """
    results, long_ctx, alphas_rows, infos, seconds = [], [], [], [], []
    for name in models:
        start = time.perf_counter()
        model, tok = load_model(name, dtype=dtype, device=device)
        variants = method_alphas(model, tok, n_layers, n_calib, seq_len, seed)
        alphas_rows += [dict(model=name, layer=i, alpha=a) for i, a in variants[SEARCHED].items()]
        items = long_context_items(tok, lc_lengths, lc_depths, lc_per_cell, seed) if lc_lengths else []
        infos.append(model_info(model))
        for method, alphas in variants.items():
            print(f"== {name}: {method}", flush=True)
            if alphas is not None:
                model, tok = load_model(name, dtype=dtype, device=device)
                apply_harp(model, sorted(alphas), alphas, meta={"method": method})
            table = run_tasks(model, tok, tasks, limit, num_fewshot, batch_size)
            results.append(table.assign(model=name, method=method))
            if items and method in LONG_CONTEXT_METHODS:
                long_ctx.append(long_context_eval(model, tok, items).assign(model=name, method=method))
        del model
        seconds.append(dict(model=name, seconds=time.perf_counter() - start))
        print(f"== {name}: {seconds[-1]['seconds'] / 60:.1f} min", flush=True)
    first = ["model", "method"]
    results = pd.concat(results, ignore_index=True)
    long_ctx = pd.concat(long_ctx, ignore_index=True) if long_ctx else pd.DataFrame(columns=first)
    return {"results": results[first + [c for c in results.columns if c not in first]],
            "long_context": long_ctx[first + [c for c in long_ctx.columns if c not in first]],
            "alphas": pd.DataFrame(alphas_rows), "seconds": pd.DataFrame(seconds), "infos": infos}


def results_table(results: pd.DataFrame) -> pd.DataFrame:
    """The paper-style table: rows (model, method), a column per task (its primary metric), and the generation
    and discriminative averages over the tasks present."""
    primary = results[results.primary]
    table = primary.pivot_table(index=["model", "method"], columns="task", values="value", sort=False)
    for label, group in (("generation avg", GENERATION), ("discriminative avg", DISCRIMINATIVE)):
        present = [t for t in group if t in table.columns]
        if present:
            table[label] = table[present].mean(axis=1)
    order = [t for t in (*DISCRIMINATIVE, *GENERATION) if t in table.columns]
    return table[order + [c for c in ("generation avg", "discriminative avg") if c in table.columns]]


def long_context_accuracy(long_ctx: pd.DataFrame) -> pd.DataFrame:
    """Exact-match accuracy per model, method, task, length and depth (n items each)."""
    acc = (long_ctx.groupby(["model", "method", "task", "length", "depth"], as_index=False)
           .agg(accuracy=("correct", "mean"), n=("correct", "size"), n_tokens=("n_tokens", "mean")))
    order = {m: k for k, m in enumerate(METHODS)}  # dense first, as in the results table (same colours)
    return acc.sort_values("method", key=lambda col: col.map(order), kind="stable", ignore_index=True)


def summarise_evaluation(tables: dict) -> dict:
    """Headline numbers: each cell of the results table, long-context accuracy per method and task, searched α's."""
    out = {}
    for (model, method), row in results_table(tables["results"]).iterrows():
        out |= {f"{model}/{method}/{col}": float(v) for col, v in row.items() if pd.notna(v)}
    lc = tables["long_context"]
    if len(lc):
        for (model, method, task), part in lc.groupby(["model", "method", "task"]):
            out[f"{model}/{method}/long_context/{task}"] = float(part.correct.mean())
    for model, part in tables["alphas"].groupby("model"):
        out[f"{model}/searched_alphas_top_first"] = [float(a) for a in part.sort_values("layer", ascending=False).alpha]
    for row in tables.get("seconds", pd.DataFrame(columns=["model", "seconds"])).itertuples():
        out[f"{row.model}/seconds"] = float(row.seconds)
    return out
