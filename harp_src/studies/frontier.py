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

import time
from dataclasses import dataclass
from typing import ClassVar

import pandas as pd

from ..checkpoints import load_model
from ..compare.points import (
    DENSE,
    HARP,
    HARP_BI,
    HARP_KINDS,
    HARP_MEAN,
    LAMBADA,
    PAPER,
    SPEED_COLUMNS,
    ModelRun,
    best_baseline,
    bi_plan,
    build,
    check_named,
    chosen_rows,
    label,
    measure_points,
    open_run,
    real_drops,
    run_table,
    scored_points,
    settings_of,
    speeds,
    task_items,
    top_plans,
    variants,
    with_speeds,
)
from ..compare.tables import FRONTIER_COLUMNS, frontier_table, mean_versus_identity, verdict, versus_harp
from ..measure.timing import shape_key
from ..method.layers import quarter_depth
from ..model.adapter import fingerprint
from ..model.loading import model_info
from ..report.params import StudyParams
from ..report.parts import steps_summary, stored_part

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
    EXEMPT: ClassVar[tuple] = ("gold_tasks", "gold_limit", "gold_methods")  # only the gold parts read them
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


def _recipes(chosen, levels: list[int], quarter: int, plans: dict, budgets: dict) -> list[dict]:
    """Every point to measure: HARP at each level, the chosen variants at HARP's real drop there (quarter-only ones
    at quarter depth), and the baselines at the paper's Q + K budget (level "paper", HARP's quarter-depth row beside
    them)."""
    out = []
    for n in levels:
        level = f"N={n}"
        out.append(dict(method=HARP, scope="attention", level=level, n_layers=n, budget=budgets[n], alphas=plans[n]))
        for method, scope in chosen:
            if method in QUARTER_ONLY and n != quarter:
                continue
            extra = {"alphas": plans[HARP_BI]} if method == HARP_BI else {}
            out.append(dict(method=method, scope=scope, level=level, n_layers=n, budget=budgets[n], **extra))
    out.append(dict(method=HARP, scope="attention", level=PAPER, n_layers=quarter, budget=budgets[PAPER],
                    alphas=plans[quarter], same_as=f"N={quarter}"))
    out += [dict(method=m, scope=s, level=PAPER, n_layers=quarter, budget=budgets[PAPER])
            for m, s in chosen if m not in QUARTER_ONLY]
    return out


def _tasks_for(p: FrontierParams, quarter: int):
    """recipe -> (tasks, item limit): the main tasks at quarter depth (and for dense), LAMBADA alone elsewhere."""
    def tasks_for(recipe: dict) -> tuple[list[str], object]:
        if recipe["level"] == f"N={quarter}" or recipe["method"] == DENSE:
            return p.tasks_main, p.limit_main
        return ([LAMBADA] if LAMBADA in p.tasks_main else []), p.limit_levels
    return tasks_for


def _plans(run: ModelRun, levels: list[int], quarter: int) -> dict:
    """{N: α's of the top N}, and harp-bi's {layer: α} under HARP_BI (each searched on the calibration windows)."""
    return top_plans(run, levels) | {HARP_BI: bi_plan(run, quarter)}


def _setup(name: str, p: FrontierParams, states: bool = True) -> tuple[ModelRun, list[int], int]:
    """The model's run (dense model, windows, with `states` the dense states), its levels and its quarter depth."""
    dense, tok = load_model(name, dtype=p.dtype, device=p.device)
    quarter = quarter_depth(fingerprint(dense.config)["num_layers"])
    run = open_run(name, dense, tok, p, _tasks_for(p, quarter), states)
    return run, sorted(set(levels_for(p.levels, name)) | {quarter}), quarter


def _gold_rows(run: ModelRun, part: dict, quarter: str) -> list[dict]:
    """The quarter-depth points of GOLD_METHODS, rebuilt from a model's finished parts: HARP variants from their α's,
    `best` (the baseline closest to dense on KL there) pruned again by its deterministic rule."""
    p, fid, alphas = run.params, part["fidelity"], part["alphas"]
    best = best_baseline(fid[fid.level == quarter])
    runs = part["runs"][part["runs"].level == quarter]
    rows = []
    for r in runs.itertuples():
        if r.method not in HARP_KINDS and label(r.method, r.scope) != best:
            continue
        row = dict(method=r.method, scope=r.scope, level=quarter, record=None)
        if r.method in HARP_KINDS:
            name = {HARP: quarter.removeprefix("N="), HARP_MEAN: f"{HARP_MEAN} {quarter}"}.get(r.method, HARP_BI)
            plan = alphas[alphas.set == name]
            row["alphas"] = dict(zip(plan.layer.astype(int), plan.alpha, strict=True))
        else:
            recipe = dict(method=r.method, scope=r.scope, budget=int(r.budget_params))
            row["record"] = build(run.dense, recipe, run.calib, share=True)[1]
        rows.append(row)
    return chosen_rows(rows, p.gold_methods, best)


def _gold_part(name: str, p: FrontierParams, part: dict) -> dict:
    """Gold-answer bits per byte (GOLD_TASKS) on dense and the quarter-depth points of GOLD_METHODS, each point and
    task set a stored step; a part of its own, so adding it reused the finished main and harp-mean parts."""
    start = time.perf_counter()
    run, _, quarter = _setup(name, p, states=False)  # no fidelity here: the dense states are not needed
    items = scored_points(run, _gold_rows(run, part, f"N={quarter}"), p.gold_tasks, p.gold_limit)
    return {"items": pd.DataFrame(items), "steps": steps_summary(run.made),
            "seconds": time.perf_counter() - start}


def _model_part(name: str, p: FrontierParams) -> dict:
    start = time.perf_counter()
    run, levels, quarter = _setup(name, p)
    plans = _plans(run, levels, quarter)
    budgets = real_drops(run.dense.config, plans, levels, quarter)
    dense_items = run.step({"dense": p.tasks_main}, lambda: task_items(run, run.dense, p.tasks_main, p.limit_main))
    items = [dict(model=name, method=DENSE, level="", **r) for r in dense_items]
    chosen = [v for v in variants(p.methods) if v[0] != HARP_MEAN]  # harp-mean has a part of its own
    rows, fids, found = measure_points(run, _recipes(chosen, levels, quarter, plans, budgets))
    dense_row = {"model": name, "method": DENSE, "scope": "", "level": "", "n_layers": 0, "budget_params": 0,
                 "params_removed": 0, "weights_zeroed": 0, "shape": DENSE}
    return {"runs": pd.concat([pd.DataFrame([dense_row]), run_table(name, rows)], ignore_index=True),
            "records": {r["shape"]: r["record"] for r in rows if r["record"] is not None},  # for the timing part
            "fidelity": pd.concat(fids, ignore_index=True).assign(model=name), "items": pd.DataFrame(items + found),
            "alphas": pd.DataFrame([dict(model=name, set=str(k), layer=i, alpha=a) for k, plan in plans.items()
                                    for i, a in plan.items()]),
            "budgets": {name: {str(k): int(v) for k, v in budgets.items()}},
            "info": model_info(run.dense) | {"steps": steps_summary(run.made)},
            "seconds": dict(model=name, seconds=time.perf_counter() - start)}


def _mean_part(name: str, p: FrontierParams, main: dict) -> dict:
    """harp-mean at every level: α's searched for the causal-mean bypass (top-down, the deepest N once) and the
    same quality axes (timed with the rest in the timing part)."""
    start = time.perf_counter()
    run, levels, quarter = _setup(name, p)
    plans, drop = top_plans(run, levels, bypass="mean"), main["budgets"][name]
    recipes = [dict(method=HARP_MEAN, scope="attention", level=f"N={n}", n_layers=n, budget=drop[str(n)],
                    alphas=plans[n]) for n in levels]
    rows, fids, items = measure_points(run, recipes)
    return {"runs": run_table(name, rows), "fidelity": pd.concat(fids, ignore_index=True).assign(model=name),
            "items": pd.DataFrame(items), "steps": steps_summary(run.made),
            "alphas": pd.DataFrame([dict(model=name, set=f"{HARP_MEAN} N={r['n_layers']}", layer=i, alpha=a)
                                    for r in recipes for i, a in r["alphas"].items()]),
            "seconds": dict(model=name, seconds=time.perf_counter() - start)}


def _with_mean(main: dict, mean: dict, made: dict) -> dict:
    """The main part with harp-mean's points added."""
    joined = {k: pd.concat([main[k], mean[k]], ignore_index=True) for k in ("runs", "fidelity", "items", "alphas")}
    seconds, info = main["seconds"] | {"mean_seconds": mean["seconds"]["seconds"]}, main["info"]
    return main | joined | {"seconds": seconds, "info": info | {"harp_mean_part": made | {"steps": mean["steps"]}}}


def _plan_set(method: str, n_layers: int) -> str:
    """Where a HARP variant's α's are in a part's `alphas` table (its `set` column)."""
    return {HARP: str(n_layers), HARP_MEAN: f"{HARP_MEAN} N={n_layers}"}.get(method, HARP_BI)


def _rebuilt_record(run: ModelRun, row) -> object:
    """A baseline point's record, pruned again by its deterministic rule (for parts stored before they kept their
    records), refused unless it gives the measured point's shape."""
    recipe = dict(method=row.method, scope=row.scope, budget=int(row.budget_params))
    model, record = build(run.dense, recipe, run.calib, share=True)
    if shape_key(model, record) != row.shape:
        raise RuntimeError(f"{label(row.method, row.scope)} at {row.level} pruned again gives another shape than "
                           f"its measured point; delete {run.name}'s stored 06 parts to measure it again")
    return record


def timed_rows(run: ModelRun, part: dict) -> list[dict]:
    """A row per distinct pruned shape of a model's finished points, ready for `speeds`: HARP variants rebuilt from
    their α's, baselines from their records. Identity HARP and harp-mean of each level come first, side by side,
    so each pair shares a round-robin (`timing_groups` fills groups of TIMING_GROUP, an even number, in order)."""
    runs = part["runs"]
    runs = runs[runs.method != DENSE].drop_duplicates("shape")
    pairs = runs.method.isin([HARP, HARP_MEAN]) & runs.level.str.startswith("N=")
    ordered = pd.concat([runs[pairs].sort_values(["n_layers", "method"]), runs[~pairs]])
    plans = {k: dict(zip(g.layer.astype(int), g.alpha, strict=True)) for k, g in part["alphas"].groupby("set")}
    records = part.get("records", {})
    rows = []
    for r in ordered.itertuples():
        row = dict(method=r.method, level=r.level, shape=r.shape, record=None)
        if r.method in HARP_KINDS:
            row["alphas"] = plans[_plan_set(r.method, r.n_layers)]
        else:
            row["record"] = records[r.shape] if r.shape in records else _rebuilt_record(run, r)
        rows.append(row)
    return rows


def _timing_part(name: str, p: FrontierParams, part: dict) -> dict:
    """Every distinct shape of a model's finished main and harp-mean points timed against dense (`speeds`: groups
    from `timing_groups`, each group a stored step)."""
    start = time.perf_counter()
    run, _, _ = _setup(name, p, states=False)  # no fidelity here: the dense states are not needed
    speed = speeds(run, timed_rows(run, part))
    return {"speed": speed, "steps": steps_summary(run.made), "seconds": time.perf_counter() - start}


def _with_speed(part: dict, timing: dict, made: dict) -> dict:
    """The part with every point's speed from the timing part, and `mean_speed`: identity HARP and harp-mean at each
    level (empty without harp-mean)."""
    runs = with_speeds(part["runs"], timing["speed"])
    pairs = runs[runs.method.isin([HARP, HARP_MEAN]) & runs.level.str.startswith("N=")]
    mean_speed = pairs if (pairs.method == HARP_MEAN).any() else pairs.iloc[:0]
    return part | {"runs": runs, "mean_speed": mean_speed[["model", "method", "level", *SPEED_COLUMNS]],
                   "seconds": part["seconds"] | {"timing_seconds": timing["seconds"]},
                   "info": part["info"] | {"timing_part": made | {"steps": timing["steps"]}}}


def frontier_study(p: FrontierParams) -> dict:
    """Every method at HARP's real drop at each level of each model (see the module docstring). Main parts run
    first, then harp-mean parts, gold parts and, last, timing parts; parts and their steps (searches, points, timing
    groups) are stored in .runs/parts, so with REUSE_PARTS an interrupted run resumes where it stopped.

    Returns:
        dict: runs (a row per point: method, scope, level, n_layers, budget_params, params_removed, weights_zeroed,
        speed-ups, decode tokens/s, KV bytes per token), fidelity (per window), items (task items), alphas, budgets,
        infos (with each part's and steps' provenance), seconds, mean_speed (identity HARP and harp-mean at each
        level, timed side by side).
    """
    p.check()
    settings = settings_of(p, exempt=True)  # the gold parameters key only the gold parts
    parts = []
    for name in p.models:
        part, made = stored_part(p.NOTEBOOK, {"model": name, **settings}, lambda name=name: _model_part(name, p),
                                 p.reuse_parts)
        parts.append(part | {"info": part["info"] | {"part": made}})
    if HARP_MEAN in dict(variants(p.methods)):
        for k, (name, part) in enumerate(zip(p.models, list(parts), strict=True)):
            mean, made = stored_part(p.NOTEBOOK, {"model": name, "part": HARP_MEAN, **settings},
                                     lambda name=name, part=part: _mean_part(name, p, part), p.reuse_parts)
            parts[k] = _with_mean(part, mean, made)
    if p.gold_tasks:
        for k, (name, part) in enumerate(zip(p.models, list(parts), strict=True)):
            gold, made = stored_part(p.NOTEBOOK, {"model": name, "part": "gold", **settings_of(p)},
                                     lambda name=name, part=part: _gold_part(name, p, part), p.reuse_parts)
            parts[k] = part | {"items": pd.concat([part["items"], gold["items"]], ignore_index=True),
                               "info": part["info"] | {"gold_part": made | {"steps": gold["steps"]}},
                               "seconds": part["seconds"] | {"gold_seconds": gold["seconds"]}}
    for k, (name, part) in enumerate(zip(p.models, list(parts), strict=True)):  # last: needs a quiet machine
        timing, made = stored_part(p.NOTEBOOK, {"model": name, "part": "timing", **settings},
                                   lambda name=name, part=part: _timing_part(name, p, part), p.reuse_parts)
        parts[k] = _with_speed(part, timing, made)

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
