"""Notebook 08: what do HARP's variants cost on downstream tasks, with intervals that can tell methods apart?

Dense vs HARP (searched α, α = 1, α = 0) of each model: lm-eval tasks scored per item (the fast exact scorer), each
pruned method's paired difference from dense on the same items with a bootstrap interval, token-level fidelity to
the dense model on held-out text, and the synthetic long-context tasks (issues 6 and 12).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import ClassVar

import pandas as pd

from ..compare.points import ModelSteps
from ..data.corpora import ppl_windows
from ..data.longcontext import multidoc_items, passkey_items
from ..eval.fidelity import fidelity
from ..eval.longcontext import long_context_eval
from ..eval.stats import aligned, decided, mean_ci, mean_of_means_ci, paired_table
from ..eval.tasks import CLOZE, DISCRIMINATIVE, GENERATION, limits_for, run_tasks, task_scores
from ..method.harp import apply_harp
from ..method.layers import parse_layers, quarter_depth
from ..method.search import search_alphas
from ..model.adapter import fingerprint
from ..model.loading import model_info
from ..report.params import OneWindowLength, StudyParams
from ..steps import context
from ..steps.executors import Outcome, run_steps
from ..steps.graph import Graph

DENSE, SEARCHED, ALPHA1, ALPHA0 = "dense", "HARP, searched α", "HARP, α = 1", "attention dropped, α = 0"
METHODS = (DENSE, SEARCHED, ALPHA1, ALPHA0)
MAIN = (DENSE, SEARCHED)  # scored on every item of LIMIT; the others on the first LIMIT_OTHERS of those same items
LONG_CONTEXT_METHODS = (DENSE, SEARCHED)
FIDELITY_CORPORA = ("enwiki", "lee")  # held-out test splits: in-domain and out-of-domain text
AVERAGE = "discriminative avg"
TASK_BATCH = 8  # lm-eval requests per forward


@dataclass(frozen=True)
class EvaluationParams(OneWindowLength, StudyParams):
    """Notebook 08's parameters: the models, tasks and their sizes, the α search, fidelity windows, and the
    synthetic long-context items (LC_*)."""

    NOTEBOOK: ClassVar[str] = "08_evaluation"
    TYPES: ClassVar[dict] = {"LIMIT": int | dict, "LIMIT_OTHERS": int | dict, "FEWSHOT": int | dict | None}
    models: list[str]
    tasks: list[str]
    limit: int | dict
    limit_others: int | dict
    fewshot: int | dict | None
    n_calib: int
    seq_len: int
    n_layers: int
    n_fidelity: int
    lc_lengths: list[int]
    lc_depths: list[float]
    lc_per_cell: int
    seed: int
    dtype: str
    device: str

    @property
    def n_eval(self) -> int:
        """The fidelity windows per corpus are the test windows of every step's setup."""
        return self.n_fidelity


def method_alphas(model, tok, n_layers: int, n_calib: int, seq_len: int, seed: int) -> dict[str, dict | None]:
    """{method: {layer: α}} for the top-N layers (N = 0: the paper's depth · 8/32); α searched on enwiki-train."""
    L = fingerprint(model.config)["num_layers"]
    layers = parse_layers(f"top:{n_layers or quarter_depth(L)}", L)
    calib = ppl_windows(tok, "enwiki", "train", n_calib, seq_len, seed)
    return {DENSE: None, SEARCHED: search_alphas(model, calib, layers), ALPHA1: dict.fromkeys(layers, 1.0),
            ALPHA0: dict.fromkeys(layers, 0.0)}


def long_context_items(tok, lengths, depths, n_per_cell: int, seed: int) -> list[dict]:
    """Passkey and multi-document QA items for every length and depth (see data.longcontext)."""
    return passkey_items(tok, lengths, depths, n_per_cell, seed) + multidoc_items(tok, lengths, depths, n_per_cell,
                                                                                  seed)


def _pruned(dense, alphas: dict[int, float] | None, method: str):
    if alphas is None:
        return dense
    model = copy.deepcopy(dense)
    apply_harp(model, sorted(alphas), alphas, meta={"method": method})
    return model


def alphas_step(key: dict, inputs: dict) -> dict:
    """Every method's α's (`method_alphas`: the search on the setup's calibration windows) and the model's
    provenance."""
    setup = key["setup"]
    dense, tok = context.dense(setup)
    return {"variants": method_alphas(dense, tok, key["n_layers"], setup["n_calib"], setup["calib_len"],
                                      setup["seed"]), "info": model_info(dense)}


def method_step(key: dict, inputs: dict) -> dict:
    """One method of one model: its task results and items, its fidelity to dense on each corpus' test windows
    (pruned methods), and its long-context answers (LONG_CONTEXT_METHODS)."""
    setup = key["setup"]
    name, method, seed = setup["model"], key["method"], setup["seed"]
    dense, tok = context.dense(setup)
    alphas = inputs["alphas"]["variants"][method]
    print(f"== {name}: {method}", flush=True)
    model = _pruned(dense, alphas, method)
    items: list = []
    table = run_tasks(model, tok, key["tasks"], key["limit"], num_fewshot=key["fewshot"],
                      batch_size=TASK_BATCH, items=items)
    fid, answers = [], None
    if alphas is not None and setup["n_eval"]:
        for corpus in FIDELITY_CORPORA:
            windows = ppl_windows(tok, corpus, "test", setup["n_eval"], setup["eval_len"], seed)
            fid.append(fidelity(dense, model, windows, seed=seed).assign(model=name, method=method, corpus=corpus))
    lc = key["long_context"]
    if lc["lengths"] and method in LONG_CONTEXT_METHODS:
        lc_items = long_context_items(tok, lc["lengths"], lc["depths"], lc["per_cell"], seed)
        answers = long_context_eval(model, tok, lc_items).assign(model=name, method=method)
    return {"results": table.assign(model=name, method=method),
            "items": [dict(model=name, method=method, **row) for row in items], "fidelity": fid,
            "long_context": answers}


def _declare_model(graph: Graph, p: EvaluationParams, name: str) -> dict:
    """One model's steps: the α search, then every method side by side."""
    ms = ModelSteps.open(graph, p, name)
    n = p.n_layers or quarter_depth(ms.num_layers)
    alphas = ms.add(alphas_step, {"n_layers": p.n_layers}, label="α search", size=n * p.n_calib * p.seq_len / 256)
    lc = {"lengths": list(p.lc_lengths), "depths": list(p.lc_depths), "per_cell": p.lc_per_cell}
    methods = []
    for method in METHODS:
        limit = limits_for(p.limit if method in MAIN else p.limit_others, name)
        items = sum(_counts(limit, p.tasks))
        long = 2 * len(p.lc_depths) * p.lc_per_cell * sum(p.lc_lengths) / 256 if method in LONG_CONTEXT_METHODS else 0
        methods.append(ms.add(method_step, {"method": method, "tasks": list(p.tasks), "limit": limit,
                                            "fewshot": p.fewshot, "long_context": lc}, {"alphas": alphas},
                              f"{method}", size=items / 20 + long + 2 * p.n_fidelity * p.seq_len / 256))
    return {"name": name, "alphas": alphas, "methods": methods}


def _counts(limit, tasks: list[str]) -> list[int]:
    """Items asked of each task (100 where a limit does not say; for size estimates only)."""
    return [int((limit.get(t, 100) if isinstance(limit, dict) else limit) or 100) for t in tasks]


def evaluation_graph(p: EvaluationParams) -> tuple[Graph, list[dict]]:
    """The study's steps for every model, and each model's step ids by role."""
    graph = Graph()
    return graph, [_declare_model(graph, p, name) for name in p.models]


def _model_tables(ids: dict, out: Outcome) -> dict:
    name, res = ids["name"], out.results
    methods = [res[i] for i in ids["methods"]]
    variants = res[ids["alphas"]]["variants"]
    seconds = sum(out.provenance[i].get("seconds", 0.0) for i in [ids["alphas"], *ids["methods"]])
    return {"results": [m["results"] for m in methods], "items": [i for m in methods for i in m["items"]],
            "fidelity": [f for m in methods for f in m["fidelity"]],
            "long_context": [m["long_context"] for m in methods if m["long_context"] is not None],
            "info": res[ids["alphas"]]["info"],
            "alphas": [dict(model=name, layer=i, alpha=a) for i, a in variants[SEARCHED].items()],
            "seconds": dict(model=name, seconds=seconds)}


def _first(df: pd.DataFrame) -> pd.DataFrame:
    first = ["model", "method"]
    return df[first + [c for c in df.columns if c not in first]]


def evaluation_study(p: EvaluationParams) -> dict:
    """Every method of METHODS through run_tasks (MAIN on LIMIT items, the others on LIMIT_OTHERS), fidelity of
    each pruned method to dense on N_FIDELITY test windows per corpus, the LONG_CONTEXT_METHODS on the synthetic
    long-context items. Limits may be keyed by model name. A stored step per model's search and per method (see
    `evaluation_graph`), run inline where the runner has not run them already.

    Returns:
        dict: results (run_tasks rows + model, method), items (model, method, task, doc_id, correct, raw), paired
        (paired_table of items vs dense, per model and task), scores (per model, method, task: mean with interval),
        fidelity (model, method, corpus, metric, value, ci_low, ci_high, n_tokens, …), long_context (answers),
        alphas, seconds, infos.
    """
    graph, models = evaluation_graph(p)
    out = run_steps(graph, reuse=False)
    parts = [_model_tables(ids, out) for ids in models]
    items = pd.DataFrame([row for part in parts for row in part["items"]])
    fid = [f for part in parts for f in part["fidelity"]]
    lc = [f for part in parts for f in part["long_context"]]
    no_answers = pd.DataFrame(columns=["model", "method"])
    return {"results": _first(pd.concat([t for part in parts for t in part["results"]], ignore_index=True)),
            "items": _first(items), "paired": task_differences(items, p.seed), "scores": task_scores(items, p.seed),
            "fidelity": _first(pd.concat(fid, ignore_index=True)) if fid else pd.DataFrame(),
            "long_context": _first(pd.concat(lc, ignore_index=True)) if lc else no_answers,
            "alphas": pd.DataFrame([a for part in parts for a in part["alphas"]]),
            "seconds": pd.DataFrame([part["seconds"] for part in parts]), "infos": [part["info"] for part in parts]}


# ---------------------------------------------------------------------------------------------- tables
def uninformative_tasks(items: pd.DataFrame) -> list[str]:
    """Generation tasks on which every method of every model scores 0: they stay in the tables, not in averages."""
    gen = items[items.task.isin(GENERATION)]
    return sorted(t for t, part in gen.groupby("task") if (part.correct == 0).all())


def task_differences(items: pd.DataFrame, seed: int = 0) -> pd.DataFrame:
    """Each pruned method minus dense on the same items, per model and task, plus the discriminative average
    (mean of the per-task differences, each task resampled on its own), with 95 % intervals."""
    paired = paired_table(items, DENSE, ["model", "task"], seed=seed)
    rows = []
    for (model, method), part in paired.groupby(["model", "method"], sort=False):
        tasks = [t for t in part.task if t in DISCRIMINATIVE]
        if tasks:
            diffs = [_task_diffs(items, model, method, t) for t in tasks]
            value, low, high = mean_of_means_ci(diffs, seed)
            rows.append(dict(model=model, task=AVERAGE, method=method, reference=DENSE, diff=value, ci_low=low,
                             ci_high=high, n=sum(len(d) for d in diffs), decided=decided(low, high),
                             confidence=part.confidence.iloc[0], seed=seed))
    return pd.concat([paired, pd.DataFrame(rows)], ignore_index=True)


def _task_diffs(items: pd.DataFrame, model: str, method: str, task: str):
    part = items[(items.model == model) & (items.task == task)].set_index("doc_id")
    a, b = aligned(part[part.method == DENSE].correct, part[part.method == method].correct)
    return a - b


def results_table(scores: pd.DataFrame, paired: pd.DataFrame) -> pd.DataFrame:
    """The paper-style table: rows (model, method), per task "score [low, high] (n)", and for pruned methods the
    difference from dense with its interval; a difference whose interval excludes 0 is marked *."""
    score = scores.assign(cell=[f"{r.value:.3f} [{r.ci_low:.3f}, {r.ci_high:.3f}] (n={r.n})"
                                for r in scores.itertuples()])
    delta = paired.assign(cell=[f"{r.diff:+.3f} [{r.ci_low:+.3f}, {r.ci_high:+.3f}]{' *' if r.decided else ''}"
                                for r in paired.itertuples()])
    wide = {k: d.pivot_table(index=["model", "method"], columns="task", values="cell", aggfunc="first", sort=False)
            for k, d in (("score", score), ("Δ vs dense", delta))}
    table = pd.concat(wide, axis=1)
    order = [*DISCRIMINATIVE, *CLOZE, *GENERATION, AVERAGE]
    return table[[(k, t) for k in wide for t in order if (k, t) in table.columns]]


def long_context_scores(long_ctx: pd.DataFrame, seed: int = 0) -> pd.DataFrame:
    """Exact-match accuracy per model, method, task and length, with a bootstrap interval over items."""
    rows = []
    for (model, method, task, length), part in long_ctx.groupby(["model", "method", "task", "length"], sort=False):
        value, low, high = mean_ci(part.correct.astype(float).to_numpy(), seed)
        rows.append(dict(model=model, method=method, task=task, length=length, accuracy=value, ci_low=low,
                         ci_high=high, n=len(part), n_tokens=float(part.n_tokens.mean())))
    return pd.DataFrame(rows)


def long_context_differences(long_ctx: pd.DataFrame, seed: int = 0) -> pd.DataFrame:
    """HARP minus dense on the same long-context items, per model and task (lengths pooled), with intervals."""
    items = long_ctx.assign(correct=long_ctx.correct.astype(float)).rename(columns={"item": "doc_id"})
    return paired_table(items, DENSE, ["model", "task"], seed=seed)


def summarise_evaluation(tables: dict) -> dict:
    """Headline numbers: every score and difference with its interval, fidelity, long-context accuracy, α's."""
    out = {}
    for r in tables["scores"].itertuples():
        out[f"{r.model}/{r.method}/{r.task}"] = float(r.value)
        out[f"{r.model}/{r.method}/{r.task}/n"] = int(r.n)
    for r in tables["paired"].itertuples():
        out |= {f"{r.model}/{r.method}/{r.task}/diff": float(r.diff),
                f"{r.model}/{r.method}/{r.task}/diff_ci": [float(r.ci_low), float(r.ci_high)]}
    for r in tables["fidelity"].itertuples():
        out[f"{r.model}/{r.method}/fidelity/{r.corpus}/{r.metric}"] = float(r.value)
    lc = tables["long_context"]
    if len(lc):
        for (model, method, task), part in lc.groupby(["model", "method", "task"]):
            out[f"{model}/{method}/long_context/{task}"] = float(part.correct.mean())
    for model, part in tables["alphas"].groupby("model"):
        out[f"{model}/searched_alphas_top_first"] = [float(a) for a in part.sort_values("layer", ascending=False).alpha]
    for r in tables["seconds"].itertuples():
        out[f"{r.model}/seconds"] = float(r.seconds)
    return out
