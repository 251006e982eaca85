"""Notebook 09: does the answer change with scale? Qwen2.5-Coder-1.5B in 06's decisive comparison (issue 29).

Per model, at quarter depth (N top layers): HARP with α searched, `harp-bi` and `harp-mean`, and the chosen baselines
each pruned to HARP's real parameter drop. Every point gets token-level fidelity on enwiki test (KL, Δ NLL, top-1
agreement per window) and its measured prefill speed-up and KV bytes per token (each shape timed once, interleaved
with dense). The expensive axes go where they decide: the tasks (LAMBADA, ARC-Easy) and the gold-answer bits per byte
of GSM8K, HumanEval and MBPP run on dense, the points of TASK_METHODS and the baseline closest to dense on KL
("best"); GSM8K exact-match generation (greedy, 5-shot) on dense and the points of GEN_METHODS.

The scale table sets each model's HARP against dense and against the best baseline on each metric; the two smaller
models' rows come from notebook 06's committed tables (`figures/06_frontier.csv`, `figures/06_vs_harp.csv`), the
models run here from this study.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pandas as pd

from ..compare.points import (
    DENSE,
    HARP,
    HARP_BI,
    HARP_KINDS,
    HARP_MEAN,
    ModelSteps,
    best_baseline,
    check_named,
    chosen_items,
    chosen_steps,
    label,
    level_steps,
    points_of,
    real_drops,
    run_table,
    speed_settings,
    top,
    variants,
)
from ..eval.stats import paired_table
from ..eval.tasks import limits_for, task_scores
from ..method.layers import quarter_depth
from ..model.loading import model_info, param_count, require_installed
from ..pruning.methods import UNSTRUCTURED
from ..report.files import ROOT
from ..report.params import StudyParams
from ..report.parts import steps_summary
from ..steps import context
from ..steps.executors import Outcome, run_steps
from ..steps.graph import Graph

GEN_TASK = "gsm8k"
GEN_SHOTS = 5  # lm-eval's GSM8K prompt: 5 worked examples
SCALE_METRICS = ("kl", "lambada_openai", "arc_easy", "gsm8k_gold_bpb", "humaneval_gold_bpb")
SCALE_TITLES = {"kl": "enwiki KL to dense (lower is better)",
                "lambada_openai": "LAMBADA accuracy (higher is better)",
                "arc_easy": "ARC-Easy accuracy (higher is better)",
                "gsm8k_gold_bpb": "GSM8K gold bits per byte (lower is better)",
                "humaneval_gold_bpb": "HumanEval gold bits per byte (lower is better)"}
BEST_REFERENCE = "best baseline"
SCALE_COLUMNS = ["model", "params", "metric", "method", "reference", "diff", "ci_low", "ci_high", "n"]


@dataclass(frozen=True)
class ScaleParams(StudyParams):
    """Notebook 09's parameters: the models, the baselines and HARP variants (METHODS, as in 06), the top N layers
    (0: quarter depth), the tasks, gold-bpb tasks and generation items and which points get them, the windows, and
    the timing."""

    NOTEBOOK: ClassVar[str] = "09_scale"
    TYPES: ClassVar[dict] = {"LIMIT": int | dict, "GOLD_LIMIT": int | dict, "TASK_METHODS": list[str],
                             "GEN_METHODS": list[str], "GOLD_TASKS": list[str]}
    models: list[str]
    methods: list[str]
    n_layers: int
    tasks: list[str]
    limit: int | dict
    gold_tasks: list[str]
    gold_limit: int | dict
    task_methods: list[str]
    gen_limit: int
    gen_methods: list[str]
    n_calib: int
    calib_len: int
    n_eval: int
    eval_len: int
    speed_lens: list[int]
    speed_repeats: int
    decode_steps: int
    small_from: str
    seed: int
    dtype: str
    device: str
    reuse_parts: bool

    def check(self) -> None:
        """Refuse bad values, and models that are not installed, before any model loads."""
        check_named("TASK_METHODS", self.task_methods, self.methods)
        check_named("GEN_METHODS", self.gen_methods, self.methods)
        if len(self.speed_lens) != 2 or min(self.speed_lens) < 2 or self.speed_lens[0] >= self.speed_lens[1]:
            raise ValueError(f"SPEED_LENS must be two increasing prompt lengths, got {self.speed_lens}")
        if self.n_layers < 0 or self.gen_limit < 0:
            raise ValueError("N_LAYERS (0: quarter depth) and GEN_LIMIT (0: no generation) must be >= 0")
        require_installed(self.models)


def info_step(key: dict, inputs: dict) -> dict:
    """The model's provenance, its parameter count and HARP's real drop at its level (`harp_drop`)."""
    dense = context.dense(key["setup"])[0]
    n = key["n_layers"]
    drop = real_drops(dense.config, {n: top(inputs["plan"], n, key["num_layers"])}, [n], n)[n]
    return model_info(dense) | {"params": param_count(key["setup"]["model"]), "harp_drop": drop}


def _declare_model(graph: Graph, p: ScaleParams, name: str) -> dict:
    """One model's steps: searches, points (fidelity only), tasks and gold bpb on the chosen points, generation,
    timing."""
    ms = ModelSteps.open(graph, p, name)
    n = p.n_layers or quarter_depth(ms.num_layers)
    level = level_steps(ms, variants(p.methods), n, [], None)  # the points' tasks: later, once `best` is known
    points = level["points"]
    limits = {**_limits(limits_for(p.limit, name), p.tasks), **_limits(limits_for(p.gold_limit, name), p.gold_tasks)}
    return {"name": name, "n": n, "points": points,
            "info": ms.add(info_step, {"n_layers": n, "num_layers": ms.num_layers}, {"plan": level["search"]},
                           "info"),
            "tasks": chosen_steps(ms, points, p.task_methods, p.tasks + p.gold_tasks, limits),
            "generation": chosen_steps(ms, points, p.gen_methods, [GEN_TASK], p.gen_limit, GEN_SHOTS)
            if p.gen_limit else [],
            "timing": ms.timing(points, speed_settings(p), pairs_first=False),
            "all": [level["search"], *level["extra"], *points]}


def scale_graph(p: ScaleParams) -> tuple[Graph, list[dict]]:
    """The study's steps for every model, and each model's step ids by role."""
    p.check()
    graph = Graph()
    return graph, [_declare_model(graph, p, name) for name in p.models]


def _assemble(ids: dict, out: Outcome) -> dict:
    name, res = ids["name"], out.results
    rows, fids, _ = points_of(res, ids["points"])
    fidelity = pd.concat(fids, ignore_index=True).assign(model=name)
    best = best_baseline(fidelity)
    speed = res[ids["timing"]]
    dense_row = {"model": name, "method": DENSE, "scope": "", "level": "", "n_layers": 0, "budget_params": 0,
                 "params_removed": 0, "weights_zeroed": 0, "shape": DENSE} | speed[DENSE]
    found = {r["method"]: r["alphas"] for r in rows if r["method"] in HARP_KINDS}
    plans = {k: found[k] for k in (HARP, HARP_BI, HARP_MEAN) if k in found}
    made = [out.provenance[i] for i in [ids["info"], ids["timing"], *ids["all"],
                                        *(i for _, i in ids["tasks"] + ids["generation"])]]
    info = dict(res[ids["info"]])
    params, drop = info.pop("params"), info.pop("harp_drop")
    return {"runs": pd.concat([pd.DataFrame([dense_row]), run_table(name, rows, speed)], ignore_index=True),
            "fidelity": fidelity, "items": pd.DataFrame(chosen_items(name, res, ids["points"], ids["tasks"])),
            "generation": pd.DataFrame(chosen_items(name, res, ids["points"], ids["generation"])),
            "alphas": pd.DataFrame([dict(model=name, set=k, layer=i, alpha=a) for k, plan in plans.items()
                                    for i, a in plan.items()]),
            "info": info | {"model": name, "steps": steps_summary(made), "best_baseline": best, "params": params,
                            "n_layers": ids["n"], "harp_drop": drop},
            "seconds": dict(model=name, seconds=steps_summary(made)["compute_seconds"])}


def _limits(limit, tasks: list[str]) -> dict:
    """{task: items} for `tasks` from one count or a {task: items} dict (a model's entry, already resolved)."""
    return limit if isinstance(limit, dict) else dict.fromkeys(tasks, limit)


def scale_study(p: ScaleParams) -> dict:
    """Each model of `p.models` at quarter depth (see the module docstring), as a graph of stored steps run inline
    where the runner has not run them already (with REUSE_PARTS an interrupted run resumes at its first missing
    step).

    Returns:
        dict: runs (a row per point: cost, speed-ups, KV bytes per token), fidelity (per window), items (task and
        gold-bpb items), generation (GSM8K exact-match items), alphas, infos (provenance, best baseline, parameter
        count, steps), seconds.
    """
    graph, models = scale_graph(p)
    out = run_steps(graph, p.reuse_parts)
    parts = [_assemble(ids, out) for ids in models]
    tables = ("runs", "fidelity", "items", "generation", "alphas")
    return {**{k: pd.concat([part[k] for part in parts], ignore_index=True) for k in tables},
            "infos": [part["info"] for part in parts], "seconds": pd.DataFrame([part["seconds"] for part in parts])}


# ---------------------------------------------------------------------------------------------- tables
def _versus_dense(frontier: pd.DataFrame, model: str, level: str, method: str, metric: str) -> dict | None:
    """A point minus dense: KL is itself a divergence from dense; a task's paired "<task> − dense" row."""
    name = metric if metric == "kl" else f"{metric} − dense"
    hit = frontier[(frontier.model == model) & (frontier.level == level) & (frontier.method == method)
                   & (frontier.metric == name)]
    if hit.empty:
        return None
    r = hit.iloc[0]
    return dict(reference=DENSE, diff=r.value, ci_low=r.ci_low, ci_high=r.ci_high, n=int(r.n), baseline="")


def kl_best(vs: pd.DataFrame, model: str, level: str) -> str:
    """The structured baseline (not a HARP variant, not unstructured Wanda) closest to dense on enwiki KL at `level`:
    the lowest paired KL difference from HARP. The one rule for every model's best baseline (a per-metric maximum
    over many baselines would favour the baselines); "" when none was measured."""
    kl = vs[(vs.model == model) & (vs.level == level) & (vs.metric == "kl")
            & ~vs.method.isin(HARP_KINDS + UNSTRUCTURED)]
    return "" if kl.empty else str(kl.loc[kl["diff"].idxmin()].method)


def _versus_best(vs: pd.DataFrame, model: str, level: str, metric: str) -> dict | None:
    """HARP minus the best baseline (kl_best) on `metric`, paired: `vs` holds each point minus HARP, so this is
    minus that baseline's difference, its interval flipped."""
    best = kl_best(vs, model, level)
    hit = vs[(vs.model == model) & (vs.level == level) & (vs.metric == metric) & (vs.method == best)]
    if hit.empty:
        return None
    r = hit.iloc[0]
    flip = (0.0 - r["diff"], 0.0 - r.ci_high, 0.0 - r.ci_low)  # 0.0 - x: no "-0" in the table
    return dict(reference=BEST_REFERENCE, diff=flip[0], ci_low=flip[1], ci_high=flip[2], n=int(r.n), baseline=best)


def scale_table(frontier: pd.DataFrame, vs: pd.DataFrame, quarter: dict, params: dict) -> pd.DataFrame:
    """figures/09_scale.csv: per model (its parameter count in `params`, its quarter-depth level in `quarter`) and
    metric of SCALE_METRICS, HARP minus dense and HARP minus the best baseline (named in `baseline`: for every model
    and metric, the structured baseline closest to dense on KL, see kl_best), with the paired 95 % interval and n."""
    rows = []
    for model, level in quarter.items():
        for metric in SCALE_METRICS:
            for found in (_versus_dense(frontier, model, level, HARP, metric), _versus_best(vs, model, level, metric)):
                if found is not None:
                    rows.append(dict(model=model, params=params[model], metric=metric, method=HARP) | found)
    return pd.DataFrame(rows, columns=[*SCALE_COLUMNS, "baseline"])


def smaller_models(folder: str | Path, measured: list[str]) -> tuple[pd.DataFrame, pd.DataFrame, dict]:
    """06's frontier and versus-HARP tables for the models not measured here, and each one's quarter-depth level
    (HARP's level with the most metrics: 06 runs its main tasks and gold bpb there only); empty where 06's frontier
    tables are not in `folder` yet."""
    folder = Path(folder)
    if not ((folder / "06_frontier.csv").exists() and (folder / "06_vs_harp.csv").exists()):
        return pd.DataFrame(), pd.DataFrame(), {}
    frontier, vs = pd.read_csv(folder / "06_frontier.csv"), pd.read_csv(folder / "06_vs_harp.csv")
    if "level" not in vs.columns:  # 06's tables from before its frontier (issue 27)
        return pd.DataFrame(), pd.DataFrame(), {}
    frontier = frontier[~frontier.model.isin(measured)].fillna({"scope": "", "level": ""})
    harp = frontier[(frontier.method == HARP) & frontier.level.str.startswith("N=")]
    counts = harp.groupby(["model", "level"]).metric.nunique().reset_index().sort_values("metric")
    quarter = {r.model: r.level for r in counts.drop_duplicates("model", keep="last").itertuples()}
    return frontier, vs[~vs.model.isin(measured)], quarter


def scale_rows(study: dict, p: ScaleParams, frontier: pd.DataFrame, vs: pd.DataFrame) -> pd.DataFrame:
    """figures/09_scale.csv (see scale_table): the models run here from this study's tables, the smaller ones from
    notebook 06's tables in SMALL_FROM (relative to the repository root unless absolute)."""
    small_f, small_vs, quarter = smaller_models(ROOT / p.small_from, p.models)
    if not quarter:
        warnings.warn(f"notebook 06's frontier tables are not in {p.small_from}: the scale table has only "
                      f"{', '.join(p.models)}", stacklevel=2)
    quarter |= {name: f"N={info['n_layers']}" for name, info in zip(p.models, study["infos"], strict=True)}
    return scale_table(pd.concat([frontier, small_f], ignore_index=True), pd.concat([vs, small_vs], ignore_index=True),
                       quarter, {name: param_count(name) for name in quarter})


def summarise_scale(scale: pd.DataFrame, frontier: pd.DataFrame, study: dict) -> dict:
    """Headline numbers: every scale row, every point's value, each model's best baseline and run time."""
    out = {f"{r.model}/{r.metric}/harp − {r.reference}": float(r.diff) for r in scale.itertuples()}
    out |= {f"{r.model}/{label(r.method, r.scope)}/{r.metric}": float(r.value) for r in frontier.itertuples()}
    for info in study["infos"]:
        out[f"{info['model']}/best_baseline"] = info["best_baseline"]
    out |= {f"{r.model}/seconds": float(r.seconds) for r in study["seconds"].itertuples()}
    return out


def generation_scores(study: dict, seed: int = 0) -> pd.DataFrame:
    """GSM8K exact match per model and point with its 95 % interval and n; each point's paired difference from dense
    on the same items (diff, diff_low, diff_high); and `reportable`: dense scores above 0 with its interval (where
    dense solves no item, the task cannot tell a pruned model from dense)."""
    gen = study["generation"]
    if gen.empty:
        return pd.DataFrame()
    gen = gen.assign(method=[label(m, s) if m != DENSE else DENSE for m, s in zip(gen.method, gen.scope, strict=True)])
    scores = task_scores(gen, seed)
    paired = paired_table(gen, DENSE, ["model", "task"], seed=seed)
    if len(paired):
        paired = paired[["model", "task", "method", "diff", "ci_low", "ci_high"]].rename(
            columns={"ci_low": "diff_low", "ci_high": "diff_high"})
        scores = scores.merge(paired, on=["model", "task", "method"], how="left")
    dense_low = scores[scores.method == DENSE].set_index("model").ci_low
    return scores.assign(reportable=[bool(dense_low.get(m, 0) > 0) for m in scores.model])
