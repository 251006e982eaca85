"""Notebook 06: is HARP on the quality-vs-cost frontier? Every method at HARP's real parameter drop at several
depths, against quality, measured long-context speed and KV memory (issue 27).

Per model: HARP on the top N layers for each N of LEVELS (the quarter depth always among them), α searched once on
enwiki-train for the deepest N (greedy top-down, so every shallower top-N's α's are its first N); `harp-bi`, the
quarter-depth layer set with the lowest attention block influence (05's best selection), α searched for it. At every
level each baseline is pruned to HARP's real parameter drop (`params_removed`, folding included), by its own rule
(whole-layer methods: the nearest whole count); the paper's convention (Q + K of the quarter-depth layers) is one
more level, `paper`; unstructured Wanda runs at quarter depth only. Every point gets token-level fidelity on enwiki
test (KL, Δ NLL, top-1 agreement, per window), LAMBADA (every level), ARC-Easy, PIQA and HellaSwag (quarter depth),
each with a paired interval against dense, and its measured prefill speed-up at two prompt lengths, decode speed at
the longer one and KV-cache bytes per token.

`harp-mean` (issue 28), HARP with the causal-mean bypass, gets the same axes at every level, α's searched for it,
in a part of its own (adding it reused a stored main part).

Speed is measured last, in a timing part per model: each distinct pruned shape of its points once, interleaved with
dense, identity HARP and harp-mean of one level side by side in one round-robin. Quality does not depend on the
machine's load; timing does, so a part of its own can be remeasured on a quiet machine without touching the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pandas as pd

from ..compare.points import (
    BEST,
    DENSE,
    HARP,
    HARP_BI,
    HARP_KINDS,
    HARP_MEAN,
    LAMBADA,
    PAPER,
    SPEED_COLUMNS,
    ModelSteps,
    check_named,
    item_rows,
    label,
    points_of,
    real_drops,
    run_table,
    speed_settings,
    top,
    variants,
    with_speeds,
)
from ..compare.tables import FRONTIER_COLUMNS, frontier_table, mean_versus_identity, verdict, versus_harp
from ..method.layers import quarter_depth
from ..model.loading import model_info
from ..report.params import StudyParams
from ..report.parts import steps_summary
from ..steps import context
from ..steps.executors import Outcome, run_steps
from ..steps.graph import Graph

__all__ = ["DENSE", "FRONTIER_COLUMNS", "HARP", "HARP_KINDS", "FrontierParams", "frontier_study", "frontier_table",
           "label", "mean_versus_identity", "summarise_frontier", "variants", "verdict", "versus_harp"]
QUARTER_ONLY = (HARP_BI, "wanda")  # measured at the quarter-depth level only


@dataclass(frozen=True)
class FrontierParams(StudyParams):
    """Notebook 06's parameters: the models and methods, HARP's depths (LEVELS: N per level, a list or one list per
    model), the tasks and their items, calibration and evaluation windows, and the timing (two prompt lengths)."""

    NOTEBOOK: ClassVar[str] = "06_baselines"
    TYPES: ClassVar[dict] = {"LEVELS": list | dict, "LIMIT_MAIN": int | dict, "LIMIT_LEVELS": int | dict,
                             "TASKS_MAIN": list[str], "GOLD_TASKS": list[str], "GOLD_LIMIT": int | dict,
                             "GOLD_METHODS": list[str]}
    models: list[str]
    methods: list[str]
    levels: list | dict
    tasks_main: list[str]
    limit_main: int | dict
    limit_levels: int | dict
    gold_tasks: list[str]
    gold_limit: int | dict
    gold_methods: list[str]
    n_calib: int
    calib_len: int
    n_eval: int
    eval_len: int
    speed_lens: list[int]
    speed_repeats: int
    decode_steps: int
    seed: int
    dtype: str
    device: str
    reuse_parts: bool

    def check(self) -> None:
        """Refuse bad values before any model loads."""
        variants(self.methods)
        if self.gold_tasks:
            check_named("GOLD_METHODS", self.gold_methods, self.methods)
        if len(self.speed_lens) != 2 or min(self.speed_lens) < 2 or self.speed_lens[0] >= self.speed_lens[1]:
            raise ValueError(f"SPEED_LENS must be two increasing prompt lengths (the 2k and 8k of the CSV), got "
                             f"{self.speed_lens}")
        for name in self.models:
            if any(not isinstance(n, int) or n < 1 for n in levels_for(self.levels, name)):
                raise ValueError(f"LEVELS for {name} must be numbers of top layers >= 1, got {self.levels}")


def levels_for(levels: list | dict, name: str) -> list[int]:
    """A model's HARP depths: `levels` itself, or its entry when keyed by model name."""
    return list(levels[name] if isinstance(levels, dict) else levels)


def _recipes(chosen, levels: list[int], quarter: int) -> list[dict]:
    """Every point to measure: HARP at each level, the chosen variants at HARP's real drop there (quarter-only ones
    at quarter depth), and the baselines at the paper's Q + K budget (level "paper", HARP's quarter-depth row beside
    them, `same_as` that level's HARP point)."""
    out = []
    for n in levels:
        level = f"N={n}"
        out.append(dict(method=HARP, scope="attention", level=level, n_layers=n, budget="N"))
        out += [dict(method=m, scope=s, level=level, n_layers=n, budget="N") for m, s in chosen
                if m not in QUARTER_ONLY or n == quarter]
    out.append(dict(method=HARP, scope="attention", level=PAPER, n_layers=quarter, budget=PAPER,
                    same_as=f"N={quarter}"))
    out += [dict(method=m, scope=s, level=PAPER, n_layers=quarter, budget=PAPER)
            for m, s in chosen if m not in QUARTER_ONLY]
    return out


def _tasks_for(p: FrontierParams, quarter: int):
    """recipe -> (tasks, item limit): the main tasks at quarter depth, LAMBADA alone elsewhere."""
    def tasks_for(recipe: dict) -> tuple[list[str], object]:
        if recipe["level"] == f"N={quarter}":
            return p.tasks_main, p.limit_main
        return ([LAMBADA] if LAMBADA in p.tasks_main else []), p.limit_levels
    return tasks_for


def info_step(key: dict, inputs: dict) -> dict:
    """The model's provenance (source, checksum, shapes) for the recorded metrics, and HARP's real drop at each
    level with the paper's Q + K budget at quarter depth (`budgets`)."""
    config = context.dense(key["setup"])[0].config
    plans = {n: top(inputs["plan"], n, key["num_layers"]) for n in key["levels"]}
    budgets = real_drops(config, plans, key["levels"], key["quarter"])
    return model_info(context.dense(key["setup"])[0]) | {"budgets": {str(k): int(v) for k, v in budgets.items()}}


def _declare_model(graph: Graph, p: FrontierParams, name: str) -> dict:
    """One model's steps (searches, points, harp-mean, gold scoring, timing); returns their ids by role."""
    ms = ModelSteps.open(graph, p, name)
    quarter = quarter_depth(ms.num_layers)
    levels = sorted(set(levels_for(p.levels, name)) | {quarter})
    tasks_for = _tasks_for(p, quarter)
    ids = {"name": name, "graph": graph, "quarter": quarter, "num_layers": ms.num_layers, "levels": levels,
           "search": ms.search(max(levels)), "bi": ms.bi_search(quarter)}
    ids["info"] = ms.add(info_step, {"levels": levels, "quarter": quarter, "num_layers": ms.num_layers},
                         {"plan": ids["search"]}, "info")
    ids["dense"] = ms.scored(DENSE, p.tasks_main, p.limit_main)
    chosen = [v for v in variants(p.methods) if v[0] != HARP_MEAN]  # harp-mean: points of their own, below
    ids["main"] = []
    for recipe in _recipes(chosen, levels, quarter):
        if "same_as" in recipe:
            ids["main"].append(recipe)
            continue
        alphas = ids["bi"] if recipe["method"] == HARP_BI else None
        ids["main"].append(ms.point(recipe, ids["search"], alphas, *tasks_for(recipe)))
    ids["mean"] = []
    if HARP_MEAN in dict(variants(p.methods)):
        ids["mean_search"] = ms.search(max(levels), "mean")
        for n in levels:
            recipe = dict(method=HARP_MEAN, scope="attention", level=f"N={n}", n_layers=n, budget="N")
            ids["mean"].append(ms.point(recipe, ids["search"], ids["mean_search"], *tasks_for(recipe)))
    points = [i for i in ids["main"] if isinstance(i, str)] + ids["mean"]
    ids["gold"] = _declare_gold(ms, p, ids, quarter) if p.gold_tasks else []
    ids["timing"] = ms.timing(points, speed_settings(p), pairs_first=True)
    return ids


def _declare_gold(ms: ModelSteps, p: FrontierParams, ids: dict, quarter: int) -> list:
    """Gold-answer bits per byte on dense and the quarter-depth points of GOLD_METHODS (HARP variants by name, the
    baseline closest to dense on KL as `best`): [(role, step id)]."""
    level = f"N={quarter}"
    at_quarter = [(r, i) for r, i in zip(_recipes_of(ids), _point_ids(ids), strict=True) if r["level"] == level]
    out = [("dense", ms.scored(DENSE, p.gold_tasks, p.gold_limit, label_="gold dense"))]
    for r, i in at_quarter:
        if r["method"] in HARP_KINDS and (r["method"] in p.gold_methods or label(r["method"], r["scope"])
                                          in p.gold_methods):
            out.append((r["method"], ms.scored(i, p.gold_tasks, p.gold_limit, label_=f"gold {r['method']}")))
    if BEST in p.gold_methods:
        structured = [i for r, i in at_quarter if r["method"] not in HARP_KINDS]
        out.append((BEST, ms.scored({"best": structured}, p.gold_tasks, p.gold_limit, label_="gold best")))
    return out


def _point_ids(ids: dict) -> list[str]:
    return [i for i in ids["main"] if isinstance(i, str)] + ids["mean"]


def _recipes_of(ids: dict) -> list[dict]:
    """The recipes of a model's point steps, in `_point_ids` order (read back from the graph's keys)."""
    return [ids["graph"].steps[i].key["recipe"] for i in _point_ids(ids)]


def frontier_graph(p: FrontierParams) -> tuple[Graph, list[dict]]:
    """The study's steps for every model, and each model's step ids by role."""
    p.check()
    graph, models = Graph(), []
    for name in p.models:
        models.append(_declare_model(graph, p, name))
    return graph, models


def _assemble(ids: dict, out: Outcome, p: FrontierParams) -> dict:
    """One model's tables from its stored steps, in the order the study always wrote them."""
    name, res = ids["name"], out.results
    quarter = f"N={ids['quarter']}"
    info = dict(res[ids["info"]])
    budgets = info.pop("budgets")
    rows, fids, items = [], [], []
    for entry in ids["main"]:
        if isinstance(entry, dict):  # HARP at the paper level repeats its quarter-depth point
            twin = next(r for r in rows if r["method"] == HARP and r["level"] == entry["same_as"])
            rows.append(twin | {"level": entry["level"], "budget_params": budgets[PAPER]})
            fids.append(fids[rows.index(twin)].assign(level=entry["level"]))
            items += [i | {"level": entry["level"]} for i in items
                      if i["method"] == HARP and i["level"] == twin["level"]]
            continue
        row, fid, found = res[entry]
        rows.append(row)
        fids.append(fid)
        items += item_rows(name, row["method"], row["scope"], row["level"], found)
    plans = {n: top(res[ids["search"]], n, ids["num_layers"]) for n in ids["levels"]} | {HARP_BI: res[ids["bi"]]}
    dense_items = [dict(model=name, method=DENSE, level="", **r) for r in res[ids["dense"]]["items"]]
    dense_row = {"model": name, "method": DENSE, "scope": "", "level": "", "n_layers": 0, "budget_params": 0,
                 "params_removed": 0, "weights_zeroed": 0, "shape": DENSE}
    runs = pd.concat([pd.DataFrame([dense_row]), run_table(name, rows)], ignore_index=True)
    alphas = [dict(model=name, set=str(k), layer=i, alpha=a) for k, plan in plans.items() for i, a in plan.items()]
    fidelity = pd.concat(fids, ignore_index=True).assign(model=name)
    items = pd.DataFrame(dense_items + items)
    if ids["mean"]:
        mrows, mfids, mfound = points_of(res, ids["mean"])
        mean_alphas = [dict(model=name, set=f"{HARP_MEAN} N={r['n_layers']}", layer=i, alpha=a) for r in mrows
                       for i, a in r["alphas"].items()]
        runs = pd.concat([runs, run_table(name, mrows)], ignore_index=True)
        fidelity = pd.concat([fidelity, pd.concat(mfids, ignore_index=True).assign(model=name)], ignore_index=True)
        items = pd.concat([items, pd.DataFrame([i for r, f in zip(mrows, mfound, strict=True)
                                                for i in item_rows(name, r["method"], r["scope"], r["level"], f)])],
                          ignore_index=True)
        alphas += mean_alphas
    if ids["gold"]:
        items = pd.concat([items, pd.DataFrame(_gold_items(ids, res, runs, quarter))], ignore_index=True)
    runs = with_speeds(runs, res[ids["timing"]])
    pairs = runs[runs.method.isin([HARP, HARP_MEAN]) & runs.level.str.startswith("N=")]
    mean_speed = pairs if (pairs.method == HARP_MEAN).any() else pairs.iloc[:0]
    made = [out.provenance[i] for i in _model_ids(ids)]
    return {"runs": runs, "fidelity": fidelity, "items": items, "alphas": pd.DataFrame(alphas),
            "mean_speed": mean_speed[["model", "method", "level", *SPEED_COLUMNS]],
            "budgets": {name: budgets}, "info": info | {"steps": steps_summary(made)},
            "seconds": dict(model=name, seconds=steps_summary(made)["compute_seconds"])}


def _gold_items(ids: dict, res: dict, runs: pd.DataFrame, quarter: str) -> list[dict]:
    """Gold items, dense first, then the chosen points in the order of the quarter-depth rows."""
    name = ids["name"]
    found = {role: res[i] for role, i in ids["gold"]}
    items = [dict(model=name, method=DENSE, scope="", level="", **r) for r in found.pop("dense")["items"]]
    best = found.pop(BEST, None)
    best_point = None if best is None or best.get("none") else tuple(best["point"])
    for r in runs[runs.level == quarter].itertuples():
        if r.method in HARP_KINDS and r.method in found:
            part = found.pop(r.method)
        elif best_point is not None and (r.method, r.scope, r.level) == best_point:
            part, best_point = best, None
        else:
            continue
        items += [dict(model=name, method=r.method, scope=r.scope, level=quarter, **i) for i in part["items"]]
    return items


def _model_ids(ids: dict) -> list[str]:
    found = [ids["info"], ids["search"], ids["bi"], ids["dense"], *_point_ids(ids), ids["timing"]]
    return found + ([ids["mean_search"]] if "mean_search" in ids else []) + [i for _, i in ids["gold"]]


def frontier_study(p: FrontierParams) -> dict:
    """Every method at HARP's real drop at each level of each model (see the module docstring), as a graph of
    stored steps (searches, points, scorings, one timing per model) run inline where the runner has not run them
    already; with REUSE_PARTS an interrupted run resumes at its first missing step.

    Returns:
        dict: runs (a row per point: method, scope, level, n_layers, budget_params, params_removed, weights_zeroed,
        speed-ups, decode tokens/s, KV bytes per token), fidelity (per window), items (task items), alphas, budgets,
        infos (with the steps' provenance), seconds, mean_speed (identity HARP and harp-mean at each level, timed
        side by side).
    """
    graph, models = frontier_graph(p)
    out = run_steps(graph, p.reuse_parts)
    parts = [_assemble(ids, out, p) for ids in models]

    def cat(key):
        return pd.concat([part.get(key, pd.DataFrame()) for part in parts], ignore_index=True)
    return {**{k: cat(k) for k in ("runs", "fidelity", "items", "alphas", "mean_speed")},
            "budgets": {k: v for part in parts for k, v in part["budgets"].items()},
            "infos": [part["info"] for part in parts], "seconds": pd.DataFrame([part["seconds"] for part in parts])}


def summarise_frontier(frontier: pd.DataFrame, verdicts: pd.DataFrame, study: dict) -> dict:
    """Headline numbers: every frontier value, the verdicts, budgets, α's and run times."""
    out = {}
    for r in frontier.itertuples():
        out[f"{r.model}/{label(r.method, r.scope)}/{r.level or 'dense'}/{r.metric}"] = float(r.value)
    for r in verdicts.itertuples():
        out[f"{r.model}/{r.level}/harp_on_frontier"] = bool(r.harp_on_frontier)
        out[f"{r.model}/{r.level}/dominates_on_kl"] = r.dominates_on_kl
        out[f"{r.model}/{r.level}/better_on_kl"] = r.better_on_kl  # quality alone: no timing noise
        out[f"{r.model}/{r.level}/better_on_lambada"] = r.better_on_lambada
    for model, b in study["budgets"].items():
        out |= {f"{model}/budget/{k}": v for k, v in b.items()}
    for r in study["mean_speed"].itertuples():
        out[f"{r.model}/{r.method}/{r.level}/mean_round_speedup_8k"] = float(r.speedup_8k)
    for r in study["seconds"].itertuples(index=False):  # seconds (main part), mean_seconds (harp-mean's part)
        out |= {f"{r.model}/{k}": float(v) for k, v in r._asdict().items() if k.endswith("seconds") and v == v}
    return out
