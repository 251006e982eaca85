"""Notebook 06: at HARP's parameter budget, is HARP better than the structured-pruning baselines, and on what?

For each model: HARP (top N = depth/4 layers, α searched on enwiki-train) fixes two budgets (`pruning.budgets.budgets`):
"harp", what HARP removes, and "release", all attention weights of those layers, which the authors' release scripts
fill with FLAP on MLP channels (our row "HARP + FLAP"). Every baseline variant is pruned to each budget on the same
calibration windows, then measured against dense and against HARP: token-level fidelity and perplexity on held-out
enwiki and Lee windows (paired over windows), lm-eval tasks (paired over items) for dense, HARP and the best variant of
each method, and prefill / decode latency interleaved with dense (issue 13).
"""

from __future__ import annotations

import copy
import json
import math
import time
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import pandas as pd
from tqdm.auto import tqdm

from ..checkpoints import load_model
from ..data.corpora import ppl_windows
from ..eval.fidelity import FIDELITY_METRICS, fidelity_summary, fidelity_windows, reference_states
from ..eval.stats import mean_ci, paired_table
from ..eval.tasks import limits_for, run_tasks, task_scores
from ..measure.timing import latency_pair
from ..method.harp import apply_harp
from ..method.layers import parse_layers, quarter_depth
from ..method.search import search_alphas
from ..model.adapter import fingerprint, get_adapter
from ..model.loading import model_info
from ..model.weights import n_params
from ..pruning.budgets import budgets
from ..pruning.methods import METHODS, SCOPES
from ..pruning.prune import prune
from ..pruning.slicing import Units, units
from ..report.params import StudyParams

DENSE, HARP, HARP_FLAP = "dense", "HARP", "HARP + FLAP"
BUDGETS = ("harp", "release")
REFERENCE = {"harp": HARP, "release": HARP_FLAP}  # what each budget's baselines are paired against
CORPORA = ("enwiki", "lee")  # held-out test splits: in-domain and out-of-domain text
TASK_BATCH = 8  # lm-eval requests per forward


@dataclass(frozen=True)
class EqualBudgetParams(StudyParams):
    """Notebook 06's parameters: the models, the variants, tasks and their sizes, calibration and evaluation windows,
    HARP's N, and the latency comparison."""

    NOTEBOOK: ClassVar[str] = "06_baselines"
    TYPES: ClassVar[dict] = {"LIMIT": int | dict, "FEWSHOT": int | dict | None, "TASKS": list[str]}
    models: list[str]
    variants: list[str]
    tasks: list[str]
    limit: int | dict
    fewshot: int | dict | None
    n_calib: int
    seq_len: int
    n_eval: int
    n_layers: int
    latency_len: int
    latency_repeats: int
    latency_budgets: list[str]
    seed: int
    dtype: str
    device: str


@dataclass
class _Run:
    """One model's share of the study: the dense model, its calibration and evaluation windows, and the dense
    final states of those windows (dense runs once per window, not once per variant)."""

    name: str
    dense: object
    tok: object
    calib: object
    windows: dict
    states: dict


def variants(specs: list[str]) -> list[tuple[str, str]]:
    """(method, scope) pairs from specs "method" (all its scopes) or "method:scope"; ["all"] means every one."""
    if list(specs) == ["all"]:
        specs = list(METHODS)
    out = []
    for spec in specs:
        method, _, scope = spec.partition(":")
        if method not in SCOPES:
            raise ValueError(f"unknown method '{method}' in VARIANTS; choose from {', '.join(METHODS)}")
        scopes = [scope] if scope else list(SCOPES[method])
        bad = [s for s in scopes if s not in SCOPES[method]]
        if bad:
            raise ValueError(f"method '{method}' has no scope '{bad[0]}'; valid: {', '.join(SCOPES[method])}")
        out += [(method, s) for s in scopes]
    return out


def label(method: str, scope: str) -> str:
    """A variant's name in tables: the method, plus the scope where the method has more than one."""
    return method if len(SCOPES[method]) == 1 else f"{method} [{scope}]"


def _harp_model(dense, alphas: dict[int, float]):
    model = copy.deepcopy(dense)
    apply_harp(model, sorted(alphas), alphas, meta={"method": "searched"})
    return model


def _build(dense, recipe: dict, calib):
    """A pruned copy of `dense` from a recipe: HARP (α's), HARP + FLAP, or a baseline at a budget."""
    if recipe["kind"] == "dense":
        return dense, None
    if recipe["kind"] == "harp":
        model = _harp_model(dense, recipe["alphas"])
        if recipe.get("flap_params"):
            return model, prune(model, "flap", recipe["flap_params"], calib, "mlp", progress=False)
        return model, None
    model = copy.deepcopy(dense)
    return model, prune(model, recipe["method"], recipe["budget_params"], calib, recipe["scope"], progress=False)


def _recipes(alphas: dict[int, float], budget: dict[str, int], chosen: list[tuple[str, str]]) -> list[dict]:
    out = [dict(label=DENSE, method=DENSE, scope="", budget="", kind="dense"),
           dict(label=HARP, method="harp", scope="attention", budget="harp", kind="harp", alphas=alphas),
           dict(label=HARP_FLAP, method="harp+flap", scope="attention+mlp", budget="release", kind="harp",
                alphas=alphas, flap_params=budget["release"] - budget["harp"])]
    for b in BUDGETS:
        out += [dict(label=label(m, s), method=m, scope=s, budget=b, kind="baseline", budget_params=budget[b])
                for m, s in chosen]
    return out


def _removed(dense_params: int, model, record) -> tuple[int, int]:
    """(parameters really removed, weights zeroed)."""
    return dense_params - n_params(model), 0 if record is None else record.weights_zeroed


def _measure(run: _Run, model, p: EqualBudgetParams, timed: bool) -> tuple[list[pd.DataFrame], dict]:
    """Fidelity per window on every corpus, and (if `timed`) latency interleaved with dense."""
    per_window = [fidelity_windows(run.dense, model, w, progress=False, ref_states=run.states[c]).assign(corpus=c)
                  for c, w in run.windows.items()]
    latency = latency_pair(run.dense, model, p.latency_len, repeats=p.latency_repeats, warmup=1, decode_steps=8,
                           seed=p.seed) if timed and model is not run.dense else {}
    return per_window, latency


def pruned_key(recipe: dict, record, u: Units) -> str | None:
    """What identifies a baseline's pruned model: method, budget and per-layer edits, leaving out kept-lists that keep
    every unit (None for dense and HARP). Two variants with one key are the same model, e.g. a uniform method's
    "heads+mlp" whose head share rounds to 0 and its "mlp"; `u`: the dense model's units."""
    if recipe["kind"] != "baseline":
        return None
    full = {"heads": list(range(u.n_heads)), "channels": list(range(u.n_channels))}
    edits = {str(i): {k: v for k, v in e.items() if full.get(k) != v} for i, e in sorted(record.layers.items())}
    return json.dumps([recipe["method"], recipe["budget"], edits], sort_keys=True)


def _best_by_method(fid: pd.DataFrame, rows: list[dict]) -> list[str]:
    """Per baseline method, the variant (scope) with the lowest mean enwiki KL to dense at the "harp" budget."""
    kl = fid[(fid.corpus == "enwiki")].groupby("label").kl.mean()
    best = {}
    for r in rows:
        if r["kind"] == "baseline" and r["budget"] == "harp":
            if r["method"] not in best or kl[r["label"]] < kl[best[r["method"]]]:
                best[r["method"]] = r["label"]
    return list(best.values())


def _variant_rows(run: _Run, p: EqualBudgetParams, alphas: dict[int, float], budget: dict[str, int]) -> tuple:
    """Every variant pruned and measured: (rows, fidelity per window, {(label, budget): (recipe, record)})."""
    dense = run.dense
    dense_params, dense_units = n_params(dense), units(get_adapter(dense))
    rows, fids, records, measured = [], [], {}, {}
    for recipe in tqdm(_recipes(alphas, budget, variants(p.variants)), desc=f"{run.name}: variants"):
        model, record = _build(dense, recipe, run.calib)
        removed, zeroed = _removed(dense_params, model, record)
        twin = pruned_key(recipe, record, dense_units)
        same_as = measured[twin][0] if twin in measured else ""
        if same_as:  # e.g. a heads+mlp variant that took no head is the mlp variant: measured once
            per_window, latency = measured[twin][1:]
        else:
            per_window, latency = _measure(run, model, p, recipe["budget"] in p.latency_budgets)
            if twin is not None:
                measured[twin] = (recipe["label"], per_window, latency)
        fids += [f.assign(label=recipe["label"], budget=recipe["budget"]) for f in per_window]
        rows.append({**{k: recipe[k] for k in ("label", "method", "scope", "budget", "kind")},
                     "budget_params": budget.get(recipe["budget"], 0), "params_removed": removed,
                     "weights_zeroed": zeroed, "same_as": same_as, **latency})
        records[(recipe["label"], recipe["budget"])] = (recipe, record)
        if model is not dense:
            del model
    return rows, fids, records


def _task_items(run: _Run, p: EqualBudgetParams, labels: list[str], records: dict) -> list[dict]:
    """Per-item task results of the variants `labels` (at the "harp" budget), each rebuilt from its record."""
    items = []
    for lab in tqdm(labels, desc=f"{run.name}: tasks"):
        recipe, record = records[(lab, "" if lab == DENSE else "harp")]
        if record is None:
            model, _ = _build(run.dense, recipe, run.calib)
        else:  # the record replays the measured model bit for bit, without calibrating again
            model = copy.deepcopy(run.dense)
            record.apply(model)
        found: list = []
        run_tasks(model, run.tok, p.tasks, limits_for(p.limit, run.name), num_fewshot=p.fewshot, batch_size=TASK_BATCH,
                  items=found)
        items += [dict(model=run.name, method=lab, **row) for row in found]
        if model is not run.dense:
            del model
    return items


def _model_part(name: str, p: EqualBudgetParams) -> dict:
    start = time.perf_counter()
    dense, tok = load_model(name, dtype=p.dtype, device=p.device)
    L = fingerprint(dense.config)["num_layers"]
    layers = parse_layers(f"top:{p.n_layers or quarter_depth(L)}", L)
    calib = ppl_windows(tok, "enwiki", "train", p.n_calib, p.seq_len, p.seed)
    windows = {c: ppl_windows(tok, c, "test", p.n_eval, p.seq_len, p.seed) for c in CORPORA}
    run = _Run(name, dense, tok, calib, windows, {c: reference_states(dense, w) for c, w in windows.items()})
    alphas = search_alphas(dense, calib, layers)
    budget = budgets(dense, _harp_model(dense, alphas).harp_plan)
    rows, fids, records = _variant_rows(run, p, alphas, budget)
    fid = pd.concat(fids, ignore_index=True).assign(model=name)
    on_tasks = [DENSE, HARP, *_best_by_method(fid, rows)] if p.tasks else []
    items = _task_items(run, p, on_tasks, records)
    return {"rows": pd.DataFrame(rows).assign(model=name), "fidelity": fid, "items": pd.DataFrame(items),
            "alphas": pd.DataFrame([dict(model=name, layer=i, alpha=a) for i, a in alphas.items()]),
            "budgets": {name: budget}, "info": model_info(dense),
            "seconds": dict(model=name, seconds=time.perf_counter() - start)}


def equal_budget_study(p: EqualBudgetParams) -> dict:
    """Every chosen baseline variant at HARP's two budgets, with HARP, HARP + FLAP and dense, on each model.

    Returns:
        dict: runs (one row per model and variant: method, scope, budget, budget_params, params_removed,
        weights_zeroed, latency), fidelity (per window), items (task items of dense, HARP and each method's best
        variant), alphas, budgets, infos, seconds.
    """
    for b in p.latency_budgets:
        if b not in BUDGETS:
            raise ValueError(f"latency budget '{b}' is not one of {BUDGETS}")
    variants(p.variants)  # a bad variant fails before any model loads
    parts = [_model_part(name, p) for name in p.models]
    items = [part["items"] for part in parts if len(part["items"])]
    return {"runs": pd.concat([part["rows"] for part in parts], ignore_index=True),
            "fidelity": pd.concat([part["fidelity"] for part in parts], ignore_index=True),
            "items": pd.concat(items, ignore_index=True) if items else pd.DataFrame(),
            "alphas": pd.concat([part["alphas"] for part in parts], ignore_index=True),
            "budgets": {k: v for part in parts for k, v in part["budgets"].items()},
            "infos": [part["info"] for part in parts], "seconds": pd.DataFrame([part["seconds"] for part in parts])}


# ---------------------------------------------------------------------------------------------- tables
def _key_columns(runs: pd.DataFrame) -> pd.DataFrame:
    return runs[["model", "label", "method", "scope", "budget", "budget_params", "params_removed", "weights_zeroed"]]


def baselines_table(study: dict, seed: int = 0) -> pd.DataFrame:
    """The long table behind figures/06_baselines: per model and variant, each metric with its interval.

    Metrics: per corpus, fidelity to dense (FIDELITY_METRICS, interval over windows) and perplexity exp(mean NLL)
    (interval from the windows' NLLs); prefill / decode speed-up over dense (medians, no interval); per task, the
    primary score (interval over items).
    """
    runs, fid = study["runs"], study["fidelity"]
    rows = []
    for (model, lab, budget, corpus), part in fid.groupby(["model", "label", "budget", "corpus"], sort=False):
        for r in fidelity_summary(part, seed).itertuples():
            rows.append(dict(model=model, label=lab, budget=budget, metric=f"{r.metric} {corpus}", value=r.value,
                             ci_low=r.ci_low, ci_high=r.ci_high, n=r.n_windows))
        value, low, high = mean_ci(part.nll.to_numpy(dtype=np.float64), seed)
        rows.append(dict(model=model, label=lab, budget=budget, metric=f"ppl {corpus}", value=math.exp(value),
                         ci_low=math.exp(low), ci_high=math.exp(high), n=len(part)))
    for r in runs.itertuples():
        for metric in ("prefill_speedup", "decode_speedup"):
            if metric in runs.columns and not pd.isna(getattr(r, metric)):
                rows.append(dict(model=r.model, label=r.label, budget=r.budget, metric=metric,
                                 value=getattr(r, metric), ci_low=np.nan, ci_high=np.nan, n=np.nan))
    items = study["items"]
    if len(items):
        scores = task_scores(items, seed)
        budget_of = {DENSE: ""} | {lab: "harp" for lab in scores.method.unique() if lab != DENSE}
        for r in scores.itertuples():
            rows.append(dict(model=r.model, label=r.method, budget=budget_of[r.method], metric=r.task, value=r.value,
                             ci_low=r.ci_low, ci_high=r.ci_high, n=r.n))
    table = pd.DataFrame(rows).merge(_key_columns(runs), on=["model", "label", "budget"], how="left")
    first = ["model", "method", "scope", "budget", "params_removed", "metric", "value", "ci_low", "ci_high"]
    return table[first + [c for c in table.columns if c not in first]]


def versus_harp(study: dict, seed: int = 0) -> pd.DataFrame:
    """Each baseline minus HARP (budget "harp") or minus HARP + FLAP (budget "release"), paired on the same windows
    (fidelity metrics and NLL) and items (tasks), with 95 % bootstrap intervals. For KL and Δ NLL a positive
    difference means the baseline is further from dense than HARP; for top-1 agreement and tasks, that it is closer.
    """
    fid = study["fidelity"]
    parts = []
    for budget, reference in REFERENCE.items():
        sub = fid[fid.budget == budget]
        for metric in (*FIDELITY_METRICS, "nll"):
            long = sub.rename(columns={"label": "method"}).assign(metric=f"{metric} " + sub.corpus)
            parts.append(paired_table(long, reference, ["model", "metric"], unit="window", value=metric, seed=seed)
                         .assign(budget=budget))
    items = study["items"]
    if len(items):
        tasks = paired_table(items.rename(columns={"task": "metric"}), HARP, ["model", "metric"], seed=seed)
        parts.append(tasks[tasks.method != DENSE].assign(budget="harp"))
    return pd.concat(parts, ignore_index=True)


def summarise_equal_budget(table: pd.DataFrame, vs: pd.DataFrame, study: dict) -> dict:
    """Headline numbers: every metric of every variant, every paired difference from HARP, budgets and α's."""
    out = {}
    for r in table.itertuples():
        out[f"{r.model}/{r.label}/{r.budget or 'dense'}/{r.metric}"] = float(r.value)
    for r in vs.itertuples():
        out[f"{r.model}/{r.method}/{r.budget}/{r.metric}/vs_reference"] = [float(r.diff), float(r.ci_low),
                                                                           float(r.ci_high)]
    for model, b in study["budgets"].items():
        out |= {f"{model}/budget/{k}": int(v) for k, v in b.items()}
    for model, part in study["alphas"].groupby("model"):
        out[f"{model}/searched_alphas_top_first"] = [float(a) for a in part.sort_values("layer", ascending=False).alpha]
    for r in study["seconds"].itertuples():
        out[f"{r.model}/seconds"] = float(r.seconds)
    return out


def latency_table(runs: pd.DataFrame) -> pd.DataFrame:
    """Prefill and per-token decode latency of each timed variant and of dense beside it (medians of interleaved
    runs), long form: model, label, method, scope, budget, params_removed, phase, seconds, dense_seconds, speedup."""
    timed = runs.dropna(subset=["prefill_speedup"]) if "prefill_speedup" in runs.columns else runs.iloc[:0]
    rows = []
    for r in timed.itertuples():
        for phase, own, ref, speedup in (("prefill", r.prefill_s, r.prefill_reference_s, r.prefill_speedup),
                                         ("decode (per token)", r.decode_ms / 1e3, r.decode_reference_ms / 1e3,
                                          r.decode_speedup)):
            rows.append(dict(model=r.model, label=r.label, method=r.method, scope=r.scope, budget=r.budget,
                             params_removed=r.params_removed, seq_len=int(r.seq_len), threads=int(r.threads),
                             phase=phase, seconds=own, dense_seconds=ref, speedup=speedup))
    return pd.DataFrame(rows)


def task_table(table: pd.DataFrame, vs: pd.DataFrame) -> pd.DataFrame:
    """Per model and variant (rows) and task (columns): "score [low, high]" and, for baselines, "Δ vs HARP [low,
    high]" (* where the interval excludes 0)."""
    tasks = [m for m in table.metric.unique() if not m.startswith(("kl ", "top1", "delta_nll", "ppl ", "prefill",
                                                                     "decode"))]
    score = table[table.metric.isin(tasks)]
    score = score.assign(cell=[f"{r.value:.3f} [{r.ci_low:.3f}, {r.ci_high:.3f}] (n={int(r.n)})"
                               for r in score.itertuples()])
    diff = vs[vs.metric.isin(tasks)]
    diff = diff.assign(label=diff.method, cell=[f"{r.diff:+.3f} [{r.ci_low:+.3f}, {r.ci_high:+.3f}]"
                                                f"{' *' if r.decided else ''}" for r in diff.itertuples()])
    wide = {k: d.pivot_table(index=["model", "label"], columns="metric", values="cell", aggfunc="first", sort=False)
            for k, d in (("score", score), ("Δ vs HARP", diff)) if len(d)}
    return pd.concat(wide, axis=1) if wide else pd.DataFrame()
