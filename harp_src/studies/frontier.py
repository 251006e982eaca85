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
the longer one and KV-cache bytes per token (each pruned shape timed once, interleaved with dense).

`harp-mean` (issue 28), HARP with the causal-mean bypass, gets the same axes at every level, α's searched for it;
it is timed with identity HARP and dense, and kept in a part of its own (adding it reuses a stored main part).
"""

from __future__ import annotations

import copy
import time
from dataclasses import asdict, dataclass, field
from typing import ClassVar

import pandas as pd
from tqdm.auto import tqdm

from ..checkpoints import load_model
from ..data.corpora import ppl_windows
from ..eval.fidelity import fidelity_windows, reference_states
from ..eval.stats import mean_ci, paired_table
from ..eval.tasks import limits_for, run_tasks
from ..measure.timing import REFERENCE, shape_key, time_shapes
from ..method.accounting import param_report
from ..method.harp import HarpPlan, apply_harp
from ..method.layer_choice import layer_scores, lowest_layers
from ..method.layers import quarter_depth
from ..method.search import search_alphas
from ..model.adapter import fingerprint
from ..model.loading import model_info
from ..model.weights import n_params
from ..pruning.methods import METHODS, SCOPES
from ..pruning.prune import prune
from ..report.params import StudyParams
from ..report.parts import steps_summary, stored_part, stored_step

DENSE, HARP, HARP_BI, HARP_MEAN, PAPER = "dense", "harp", "harp-bi", "harp-mean", "paper"
HARP_KINDS = (HARP, HARP_BI, HARP_MEAN)  # the bypass variants; HARP itself is always measured
BYPASS = {HARP_MEAN: "mean"}  # the bypass of each HARP variant that is not the identity
QUARTER_ONLY = (HARP_BI, "wanda")  # measured at the quarter-depth level only
FIDELITY = ("kl", "delta_nll", "top1_agreement")  # per enwiki-test window, against dense
LAMBADA = "lambada_openai"
TASK_BATCH = 8  # lm-eval requests per forward
TIMING_GROUP = 6  # pruned models timed in one round-robin with dense (their copies are held at once)
FRONTIER_COLUMNS = ["model", "method", "scope", "level", "n_layers", "budget_params", "params_removed", "metric",
                    "value", "ci_low", "ci_high", "n", "speedup_2k", "speedup_8k", "kv_bytes_per_token"]


@dataclass(frozen=True)
class FrontierParams(StudyParams):
    """Notebook 06's parameters: the models and methods, HARP's depths (LEVELS: N per level, a list or one list per
    model), the tasks and their items, calibration and evaluation windows, and the timing (two prompt lengths)."""

    NOTEBOOK: ClassVar[str] = "06_baselines"
    TYPES: ClassVar[dict] = {"LEVELS": list | dict, "LIMIT_MAIN": int | dict, "LIMIT_LEVELS": int | dict,
                             "TASKS_MAIN": list[str]}
    models: list[str]
    methods: list[str]
    levels: list | dict
    tasks_main: list[str]
    limit_main: int | dict
    limit_levels: int | dict
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
        if len(self.speed_lens) != 2 or min(self.speed_lens) < 2 or self.speed_lens[0] >= self.speed_lens[1]:
            raise ValueError(f"SPEED_LENS must be two increasing prompt lengths (the 2k and 8k of the CSV), got "
                             f"{self.speed_lens}")
        for name in self.models:
            if any(not isinstance(n, int) or n < 1 for n in levels_for(self.levels, name)):
                raise ValueError(f"LEVELS for {name} must be numbers of top layers >= 1, got {self.levels}")


def levels_for(levels: list | dict, name: str) -> list[int]:
    """A model's HARP depths: `levels` itself, or its entry when keyed by model name."""
    return list(levels[name] if isinstance(levels, dict) else levels)


def variants(specs: list[str]) -> list[tuple[str, str]]:
    """(method, scope) pairs from specs "method" (all its scopes) or "method:scope"; ["all"] means every baseline,
    harp-bi and harp-mean. HARP itself is always measured."""
    names = [*METHODS, HARP_BI, HARP_MEAN]
    specs = names if list(specs) == ["all"] else specs
    out = []
    for method, _, scope in (spec.partition(":") for spec in specs):
        if method in (HARP_BI, HARP_MEAN):
            out.append((method, "attention"))
            continue
        if method not in SCOPES:
            raise ValueError(f"unknown method '{method}' in METHODS; choose from {', '.join(names)}")
        scopes = [scope] if scope else list(SCOPES[method])
        bad = [s for s in scopes if s not in SCOPES[method]]
        if bad:
            raise ValueError(f"method '{method}' has no scope '{bad[0]}'; valid: {', '.join(SCOPES[method])}")
        out += [(method, s) for s in scopes]
    return out


# ---------------------------------------------------------------------------------------------- what is pruned
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


def _build(dense, recipe: dict, calib):
    """A pruned copy of `dense` and the baseline's record (None for HARP)."""
    model = copy.deepcopy(dense)
    if "alphas" in recipe:
        apply_harp(model, sorted(recipe["alphas"]), recipe["alphas"], meta={"method": recipe["method"]},
                   bypass=BYPASS.get(recipe["method"], "identity"))
        return model, None
    return model, prune(model, recipe["method"], recipe["budget"], calib, recipe["scope"], progress=False)


@dataclass
class ModelRun:
    """One model's share of the study: the dense model, its tokenizer, calibration and evaluation windows, the
    dense final states of the evaluation windows (dense runs once per window, not once per point), the study's
    parameters and the provenance of every stored step made or reused so far."""

    name: str
    dense: object
    tok: object
    calib: object
    windows: object
    states: list
    params: FrontierParams
    made: list = field(default_factory=list)

    def step(self, what: dict, compute):
        """compute()'s result, stored per model, `what` and parameters: an interrupted run resumes after it."""
        key = {"model": self.name, "step": what, **settings_of(self.params)}
        return stored_step(self.params.NOTEBOOK, key, compute, self.params.reuse_parts, self.made)


def settings_of(p: FrontierParams) -> dict:
    """The parameters a stored part or step depends on (not which models run, nor whether to reuse)."""
    return {k: v for k, v in asdict(p).items() if k not in ("models", "reuse_parts")}


def _items(run: ModelRun, model, tasks: list[str], limit) -> list[dict]:
    """Per-item results of `tasks` on `model` (zero-shot, the fast scorer)."""
    found: list = []
    if tasks:
        run_tasks(model, run.tok, tasks, limits_for(limit, run.name), num_fewshot=0, batch_size=TASK_BATCH,
                  items=found, verbose=False)
    return found


def _tasks_for(recipe: dict, p: FrontierParams, quarter: int) -> tuple[list[str], object]:
    """(tasks, item limit) of a point: the main tasks at quarter depth, LAMBADA alone elsewhere."""
    if recipe["level"] == f"N={quarter}" or recipe["method"] == DENSE:
        return p.tasks_main, p.limit_main
    return ([LAMBADA] if LAMBADA in p.tasks_main else []), p.limit_levels


def _measure(run: ModelRun, recipe: dict, p: FrontierParams, quarter: int) -> tuple[dict, pd.DataFrame, list]:
    """Prune one point and measure its quality: (run row, fidelity per window, task items)."""
    model, record = _build(run.dense, recipe, run.calib)
    fid = fidelity_windows(run.dense, model, run.windows, ref_states=run.states, progress=False)
    found = _items(run, model, *_tasks_for(recipe, p, quarter))
    row = {k: recipe[k] for k in ("method", "scope", "level", "n_layers")} | {
        "budget_params": recipe["budget"], "params_removed": n_params(run.dense) - n_params(model),
        "weights_zeroed": 0 if record is None else record.weights_zeroed, "shape": shape_key(model, record),
        "record": record, "alphas": recipe.get("alphas")}
    return row, fid, found


# ---------------------------------------------------------------------------------------------- speed
def _rebuild(dense, row: dict):
    model = copy.deepcopy(dense)
    if row["record"] is not None:
        row["record"].apply(model)
    else:
        apply_harp(model, sorted(row["alphas"]), row["alphas"], bypass=BYPASS.get(row["method"], "identity"))
    return model


def _speed(run: ModelRun, rows: list[dict], p: FrontierParams) -> dict[str, dict]:
    """{shape: speed-ups, decode speed and KV bytes per token} of every distinct pruned shape and of dense (DENSE),
    TIMING_GROUP shapes at a time in one round-robin with dense at both prompt lengths, each group a stored step."""
    first = {r["shape"]: r for r in reversed(rows)}
    builders = {s: (lambda s=s: _rebuild(run.dense, first[s])) for s in dict.fromkeys(r["shape"] for r in rows)}
    timed = time_shapes(run.dense, builders, tuple(p.speed_lens), repeats=p.speed_repeats, seed=p.seed,
                        decode_steps=p.decode_steps, group=TIMING_GROUP, desc=f"{run.name}: timing",
                        store=lambda names, compute: run.step({"timing": names}, compute))
    return {DENSE if k == REFERENCE else k: _speed_row(*v, p.speed_lens[1]) for k, v in timed.items()}


def _speed_row(fast: dict, slow: dict, long: int) -> dict:
    return {"speedup_2k": fast["prefill_speedup"], "speedup_8k": slow["prefill_speedup"],
            "decode_speedup_8k": slow["decode_speedup"], "decode_tokens_per_s_8k": slow["decode_tokens_per_s"],
            "kv_bytes_per_token": slow["kv_bytes"] / long}


# ---------------------------------------------------------------------------------------------- one model
def _plans(run: ModelRun, levels: list[int], quarter: int) -> dict:
    """{N: α's of the top N}, and harp-bi's {layer: α} under HARP_BI (each searched on the calibration windows)."""
    L = fingerprint(run.dense.config)["num_layers"]
    deepest = list(range(L - max(levels), L))
    # greedy top-down: every top-N's α's are the first N of the deepest search
    alphas = run.step({"search": deepest}, lambda: search_alphas(run.dense, run.calib, deepest))
    plans = {n: {i: alphas[i] for i in range(L - n, L)} for n in levels}
    plans[HARP_BI] = run.step({"search": HARP_BI}, lambda: search_alphas(
        run.dense, run.calib, lowest_layers(layer_scores(run.dense, run.calib), "bi_attn", quarter)))
    return plans


def _budgets(config, plans: dict, levels: list[int], quarter: int) -> dict:
    """HARP's real parameter drop at each level, and the paper's Q + K budget at quarter depth (under PAPER)."""
    fp = fingerprint(config)
    from_plan = {n: param_report(config, HarpPlan(fp, plans[n])) for n in levels}
    return {n: r["params_removed"] for n, r in from_plan.items()} | {PAPER: from_plan[quarter]["removed_paper"]}


def _setup(name: str, p: FrontierParams) -> tuple[ModelRun, list[int], int]:
    """The model's run (dense model, windows, dense states), its levels and its quarter depth."""
    dense, tok = load_model(name, dtype=p.dtype, device=p.device)
    quarter = quarter_depth(fingerprint(dense.config)["num_layers"])
    calib = ppl_windows(tok, "enwiki", "train", p.n_calib, p.calib_len, p.seed)
    windows = ppl_windows(tok, "enwiki", "test", p.n_eval, p.eval_len, p.seed)
    run = ModelRun(name, dense, tok, calib, windows, reference_states(dense, windows), p)
    return run, sorted(set(levels_for(p.levels, name)) | {quarter}), quarter


def _points(run: ModelRun, recipes: list[dict], p: FrontierParams, quarter: int) -> tuple[list, list, list]:
    """Measure every recipe: (run rows, fidelity per window, task items)."""
    rows, fids, items = [], [], []
    for recipe in tqdm(recipes, desc=f"{run.name}: points"):
        if "same_as" in recipe:  # HARP at the paper level is the quarter-depth HARP model: measured once
            twin = next(r for r in rows if r["method"] == HARP and r["level"] == recipe["same_as"])
            rows.append(twin | {"level": PAPER, "budget_params": recipe["budget"]})
            fids.append(fids[rows.index(twin)].assign(level=PAPER))
            items += [i | {"level": PAPER} for i in items if i["method"] == HARP and i["level"] == twin["level"]]
            continue
        row, fid, found = run.step({"point": recipe}, lambda r=recipe: _measure(run, r, p, quarter))
        rows.append(row)
        fids.append(fid.assign(method=recipe["method"], scope=recipe["scope"], level=recipe["level"]))
        items += [dict(model=run.name, method=recipe["method"], scope=recipe["scope"], level=recipe["level"], **r)
                  for r in found]
    return rows, fids, items


def _runs(name: str, rows: list[dict], speed: dict) -> pd.DataFrame:
    return pd.DataFrame([{k: v for k, v in r.items() if k not in ("record", "alphas")} | speed[r["shape"]]
                         for r in rows]).assign(model=name)


def _model_part(name: str, p: FrontierParams) -> dict:
    start = time.perf_counter()
    run, levels, quarter = _setup(name, p)
    plans = _plans(run, levels, quarter)
    budgets = _budgets(run.dense.config, plans, levels, quarter)
    dense_items = run.step({"dense": p.tasks_main}, lambda: _items(run, run.dense, p.tasks_main, p.limit_main))
    items = [dict(model=name, method=DENSE, level="", **r) for r in dense_items]
    chosen = [v for v in variants(p.methods) if v[0] != HARP_MEAN]  # harp-mean has a part of its own
    rows, fids, found = _points(run, _recipes(chosen, levels, quarter, plans, budgets), p, quarter)
    speed = _speed(run, rows, p)
    dense_row = {"model": name, "method": DENSE, "scope": "", "level": "", "n_layers": 0, "budget_params": 0,
                 "params_removed": 0, "weights_zeroed": 0, "shape": DENSE} | speed[DENSE]
    return {"runs": pd.concat([pd.DataFrame([dense_row]), _runs(name, rows, speed)], ignore_index=True),
            "fidelity": pd.concat(fids, ignore_index=True).assign(model=name), "items": pd.DataFrame(items + found),
            "alphas": pd.DataFrame([dict(model=name, set=str(k), layer=i, alpha=a) for k, plan in plans.items()
                                    for i, a in plan.items()]),
            "budgets": {name: {str(k): int(v) for k, v in budgets.items()}},
            "info": model_info(run.dense) | {"steps": steps_summary(run.made)},
            "seconds": dict(model=name, seconds=time.perf_counter() - start)}


def _mean_part(name: str, p: FrontierParams, main: dict) -> dict:
    """harp-mean at every level: α's searched for the causal-mean bypass (top-down, the deepest N once), the same
    quality axes, and a timing round-robin of dense, identity HARP and harp-mean at each level (`speed`: both
    bypasses' figures from that one round-robin)."""
    start = time.perf_counter()
    run, levels, quarter = _setup(name, p)
    L = fingerprint(run.dense.config)["num_layers"]
    deepest = list(range(L - max(levels), L))
    alphas = run.step({"search": deepest, "bypass": "mean"},
                      lambda: search_alphas(run.dense, run.calib, deepest, bypass="mean"))
    drop = main["budgets"][name]
    recipes = [dict(method=HARP_MEAN, scope="attention", level=f"N={n}", n_layers=n, budget=drop[str(n)],
                    alphas={i: alphas[i] for i in range(L - n, L)}) for n in levels]
    rows, fids, items = _points(run, recipes, p, quarter)
    found = {k: dict(zip(g.layer, g.alpha, strict=True)) for k, g in main["alphas"].groupby("set")}
    identity = [dict(method=HARP, level=f"N={n}", record=None, shape=f"identity N={n}", alphas=found[str(n)])
                for n in levels]
    speed = _speed(run, rows + identity, p)
    pair = pd.DataFrame([dict(model=name, method=r["method"], level=r["level"]) | speed[r["shape"]]
                         for r in rows + identity])
    return {"runs": _runs(name, rows, speed), "fidelity": pd.concat(fids, ignore_index=True).assign(model=name),
            "items": pd.DataFrame(items), "speed": pair, "steps": steps_summary(run.made),
            "alphas": pd.DataFrame([dict(model=name, set=f"{HARP_MEAN} N={r['n_layers']}", layer=i, alpha=a)
                                    for r in recipes for i, a in r["alphas"].items()]),
            "seconds": dict(model=name, seconds=time.perf_counter() - start)}


def _with_mean(main: dict, mean: dict, made: dict) -> dict:
    """The main part with harp-mean's points added (and its timing round-robin under `mean_speed`)."""
    joined = {k: pd.concat([main[k], mean[k]], ignore_index=True) for k in ("runs", "fidelity", "items", "alphas")}
    seconds, info = main["seconds"] | {"mean_seconds": mean["seconds"]["seconds"]}, main["info"]
    return main | joined | {"mean_speed": mean["speed"], "seconds": seconds,
                            "info": info | {"harp_mean_part": made | {"steps": mean["steps"]}}}


def frontier_study(p: FrontierParams) -> dict:
    """Every method at HARP's real drop at each level of each model (see the module docstring). Main parts run
    before harp-mean parts; parts and their steps (searches, points, timing groups) are stored in .runs/parts, so
    with REUSE_PARTS an interrupted run resumes where it stopped.

    Returns:
        dict: runs (a row per point: method, scope, level, n_layers, budget_params, params_removed, weights_zeroed,
        speed-ups, decode tokens/s, KV bytes per token), fidelity (per window), items (task items), alphas, budgets,
        infos (with each part's and steps' provenance), seconds, mean_speed (harp-mean's round-robin with HARP).
    """
    p.check()
    settings = settings_of(p)
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

    def cat(key):
        return pd.concat([part.get(key, pd.DataFrame()) for part in parts], ignore_index=True)
    return {**{k: cat(k) for k in ("runs", "fidelity", "items", "alphas", "mean_speed")},
            "budgets": {k: v for part in parts for k, v in part["budgets"].items()},
            "infos": [part["info"] for part in parts], "seconds": pd.DataFrame([part["seconds"] for part in parts])}


# ---------------------------------------------------------------------------------------------- tables
def label(method: str, scope: str) -> str:
    """A point's name in tables: the method, plus the scope where the method has more than one."""
    return f"{method} [{scope}]" if len(SCOPES.get(method, ())) > 1 else method


def _labelled(df: pd.DataFrame) -> pd.DataFrame:
    return df.assign(method=[label(m, s) for m, s in zip(df.method, df.scope, strict=True)])


def frontier_table(study: dict, seed: int = 0) -> pd.DataFrame:
    """figures/06_frontier.csv: per model, point and metric the value with its 95 % interval and n, beside the point's
    cost. Metrics: KL, Δ NLL and top-1 agreement against dense (mean over enwiki-test windows); each task's accuracy
    (interval over items) and its paired difference from dense on the same items ("<task> − dense")."""
    runs, fid, items = study["runs"], study["fidelity"], study["items"]
    keys = ["model", "method", "scope", "level"]
    rows = []
    for key, part in fid.groupby(keys, sort=False):
        for metric in FIDELITY:
            value, low, high = mean_ci(part[metric].to_numpy(), seed)
            rows.append(dict(zip(keys, key, strict=True), metric=metric, value=value, ci_low=low, ci_high=high,
                             n=len(part)))
    items = items.fillna({"scope": ""})
    for key, part in items.groupby([*keys, "task"], sort=False):
        value, low, high = mean_ci(part.correct.to_numpy(), seed)
        rows.append(dict(zip(keys, key[:4], strict=True), metric=key[4], value=value, ci_low=low, ci_high=high,
                         n=len(part)))
    point = items.method + "|" + items.scope + "|" + items.level  # one name per point, to pair with dense
    diffs = paired_table(items.assign(method=point.where(items.method != DENSE, DENSE)), DENSE, ["model", "task"],
                         seed=seed)
    for r in diffs.itertuples():
        method, scope, level = r.method.split("|")
        rows.append(dict(model=r.model, method=method, scope=scope, level=level, metric=f"{r.task} − dense",
                         value=r.diff, ci_low=r.ci_low, ci_high=r.ci_high, n=r.n))
    cost = runs[[*keys, "n_layers", "budget_params", "params_removed", "speedup_2k", "speedup_8k",
                 "kv_bytes_per_token"]].fillna({"scope": "", "level": ""})
    table = pd.DataFrame(rows).merge(cost, on=keys, how="left")
    return table[FRONTIER_COLUMNS]


def versus_harp(study: dict, seed: int = 0) -> pd.DataFrame:
    """Each point minus HARP at the same level, paired on the same windows (KL, Δ NLL, top-1) and items (tasks):
    model, level, metric, method, diff, ci_low, ci_high, n, decided. For KL and Δ NLL a negative difference means
    closer to dense than HARP; for top-1 and tasks, a positive one."""
    fid = _labelled(study["fidelity"])
    long = pd.concat([fid.assign(metric=m, value=fid[m]) for m in FIDELITY], ignore_index=True)
    parts = [paired_table(long, HARP, ["model", "level", "metric"], unit="window", value="value", seed=seed)]
    items = study["items"]
    if len(items):
        items = _labelled(items[items.method != DENSE].fillna({"scope": ""})).rename(columns={"task": "metric"})
        parts.append(paired_table(items, HARP, ["model", "level", "metric"], seed=seed))
    return pd.concat(parts, ignore_index=True)


def verdict(study: dict, vs: pd.DataFrame) -> pd.DataFrame:
    """Per model and level: is HARP on the frontier? A point dominates HARP on a metric when it is better there with
    an interval that excludes 0 (lower KL; higher LAMBADA accuracy) and at least as fast in the long prefill
    (measured medians, no interval). Better-but-slower points are listed apart."""
    runs = _labelled(study["runs"][study["runs"].method != DENSE])
    rows = []
    for (model, level), part in runs.groupby(["model", "level"], sort=False):
        speed = part.set_index("method").speedup_8k
        row = dict(model=model, level=level, harp_speedup_8k=float(speed[HARP]))
        better = {}
        for metric, sign in (("kl", -1), (LAMBADA, 1)):
            d = vs[(vs.model == model) & (vs.level == level) & (vs.metric == metric) & vs.decided]
            better[metric] = sorted(d[d["diff"] * sign > 0].method)
            row[f"dominates_on_{'kl' if metric == 'kl' else 'lambada'}"] = ", ".join(
                m for m in better[metric] if speed[m] >= speed[HARP]) or "none"
        slower = sorted({m for ms in better.values() for m in ms if speed[m] < speed[HARP]})
        row["better_but_slower"] = ", ".join(slower) or "none"
        row["harp_on_frontier"] = row["dominates_on_kl"] == "none" and row["dominates_on_lambada"] == "none"
        rows.append(row)
    return pd.DataFrame(rows)


def mean_versus_identity(study: dict, vs: pd.DataFrame) -> pd.DataFrame:
    """harp-mean against identity HARP per model, level and metric (KL, LAMBADA, ARC-Easy where measured): the paired
    difference mean − identity with its interval, n and `decided`, beside both bypasses' prefill speed-up at the long
    length and decode speed-up there, from their one timing round-robin with dense."""
    if study["mean_speed"].empty:
        return pd.DataFrame()
    d = vs[(vs.method == HARP_MEAN) & vs.metric.isin(["kl", LAMBADA, "arc_easy"])]
    speed = study["mean_speed"].pivot_table(index=["model", "level"], columns="method",
                                            values=["speedup_8k", "decode_speedup_8k"], sort=False)
    speed.columns = [f"{method} {stat}" for stat, method in speed.columns]
    keep = ["model", "level", "metric", "diff", "ci_low", "ci_high", "n", "decided"]
    return d[keep].merge(speed.reset_index(), on=["model", "level"], how="left")


def summarise_frontier(frontier: pd.DataFrame, verdicts: pd.DataFrame, study: dict) -> dict:
    """Headline numbers: every frontier value, the verdicts, budgets, α's and run times."""
    out = {}
    for r in frontier.itertuples():
        out[f"{r.model}/{label(r.method, r.scope)}/{r.level or 'dense'}/{r.metric}"] = float(r.value)
    for r in verdicts.itertuples():
        out[f"{r.model}/{r.level}/harp_on_frontier"] = bool(r.harp_on_frontier)
        out[f"{r.model}/{r.level}/dominates_on_kl"] = r.dominates_on_kl
    for model, b in study["budgets"].items():
        out |= {f"{model}/budget/{k}": v for k, v in b.items()}
    for r in study["mean_speed"].itertuples():
        out[f"{r.model}/{r.method}/{r.level}/mean_round_speedup_8k"] = float(r.speedup_8k)
    for r in study["seconds"].itertuples(index=False):  # seconds (main part), mean_seconds (harp-mean's part)
        out |= {f"{r.model}/{k}": float(v) for k, v in r._asdict().items() if k.endswith("seconds") and v == v}
    return out
