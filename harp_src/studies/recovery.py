"""Notebook 10: who is ahead once every method gets the same recovery? (issue 29)

Structured-pruning papers report results after a short LoRA fine-tune; HARP is training-free. Here every point of one
level (HARP, `harp-bi`, `harp-mean` and the chosen baselines, each at HARP's real parameter drop, as in 06 and 09) is
measured before and after the same LoRA recovery (`heads.finetune.lora_finetune` through `peft`): the same steps,
rank, learning rate, enwiki-train windows and seed for every method, merged back into the weights. Quality is
measured against the original dense model on the same enwiki-test windows (KL, Δ NLL, top-1) and task items.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import ClassVar

import pandas as pd

from ..compare.points import (
    DENSE,
    HARP,
    HARP_BI,
    HARP_KINDS,
    HARP_MEAN,
    ModelSteps,
    build,
    item_rows,
    label,
    level_steps,
    points_of,
    real_drops,
    task_items,
    top,
    variants,
)
from ..data.corpora import ppl_windows
from ..eval.fidelity import fidelity_windows
from ..eval.stats import paired_table
from ..heads.finetune import FinetuneSpec, lora_finetune
from ..method.layers import quarter_depth
from ..model.loading import model_info
from ..report.params import StudyParams
from ..report.parts import steps_summary
from ..steps import context
from ..steps.executors import Outcome, run_steps
from ..steps.graph import Graph

RECOVERED = " + LoRA"  # appended to a point's level after recovery
SPEED_COLUMNS = ("speedup_2k", "speedup_8k", "kv_bytes_per_token")  # not measured here: recovery changes no shape


@dataclass(frozen=True)
class RecoveryParams(StudyParams):
    """Notebook 10's parameters: the models and methods, the top N layers (0: quarter depth), tasks and items,
    calibration and evaluation windows, and the one LoRA recovery every point gets (FT_*)."""

    NOTEBOOK: ClassVar[str] = "10_recovery"
    TYPES: ClassVar[dict] = {"LIMIT": int | dict}
    models: list[str]
    methods: list[str]
    n_layers: int
    tasks: list[str]
    limit: int | dict
    n_calib: int
    calib_len: int
    n_eval: int
    eval_len: int
    ft_steps: int
    ft_lr: float
    ft_rank: int
    ft_windows: int
    ft_len: int
    seed: int
    dtype: str
    device: str
    reuse_parts: bool

    def check(self) -> None:
        """Refuse bad values before any model loads."""
        variants(self.methods)
        self.finetune_spec()  # FinetuneSpec's own checks
        if self.n_layers < 0 or self.ft_windows < 1 or self.ft_len < 2:
            raise ValueError("N_LAYERS must be >= 0 (0: quarter depth), FT_WINDOWS >= 1 and FT_LEN >= 2")

    def finetune_spec(self) -> FinetuneSpec:
        """The LoRA recovery every point gets (alpha = 2 × rank, batch 1, the study's seed)."""
        spec = FinetuneSpec(steps=self.ft_steps, lr=self.ft_lr, rank=self.ft_rank, alpha=2 * self.ft_rank,
                            seed=self.seed)
        return spec.checked()


def recovered_step(key: dict, inputs: dict) -> tuple[pd.DataFrame, list, dict]:
    """One point pruned again (a copy that owns its weights), recovered with LoRA on the fine-tuning windows and
    measured again: (fidelity per window, task items, training)."""
    setup = key["setup"]
    dense, tok = context.dense(setup)
    row = inputs["point"][0]
    recipe = {"method": row["method"], "scope": row["scope"], "budget": row["budget_params"]}
    if row["alphas"] is not None:
        recipe["alphas"] = row["alphas"]
    model, _ = build(dense, recipe, context.windows(setup, "train"))
    # the fine-tuning windows: a second enwiki-train sample (seed + 1; it may share text with the calibration
    # sample, both are train), never the test split
    windows = ppl_windows(tok, "enwiki", "train", key["ft_windows"], key["ft_len"], setup["seed"] + 1)
    start = time.perf_counter()
    trained = lora_finetune(model, windows, FinetuneSpec(**key["spec"]), progress=False)  # merged: same parameters
    fid = fidelity_windows(dense, model, context.windows(setup, "test"), ref_states=context.states(setup),
                           progress=False)
    found = task_items(setup["model"], tok, model, key["tasks"], key["limit"])
    return fid, found, trained | {"seconds": time.perf_counter() - start}


def info_step(key: dict, inputs: dict) -> dict:
    """The model's provenance and HARP's real drop at its level (`harp_drop`)."""
    dense = context.dense(key["setup"])[0]
    n = key["n_layers"]
    return model_info(dense) | {"harp_drop": real_drops(dense.config, {n: top(inputs["plan"], n, key["num_layers"])},
                                                        [n], n)[n]}


def _declare_model(graph: Graph, p: RecoveryParams, name: str) -> dict:
    """One model's steps: searches, points, dense's tasks, and each point recovered."""
    ms = ModelSteps.open(graph, p, name)
    n = p.n_layers or quarter_depth(ms.num_layers)
    level = level_steps(ms, variants(p.methods), n, p.tasks, p.limit)
    spec = {"spec": p.finetune_spec().to_dict(), "ft_windows": p.ft_windows, "ft_len": p.ft_len,
            "tasks": list(p.tasks), "limit": p.limit}
    recovered = [ms.add(recovered_step, spec, {"point": i},
                        f"recovered {ms.graph.steps[i].key['recipe']['method']}",
                        size=p.ft_steps * p.ft_len / 128 + 5) for i in level["points"]]
    return {"name": name, "n": n, "points": level["points"], "recovered": recovered,
            "dense": ms.scored(DENSE, p.tasks, p.limit),
            "info": ms.add(info_step, {"n_layers": n, "num_layers": ms.num_layers}, {"plan": level["search"]},
                           "info"),
            "all": [level["search"], *level["extra"]]}


def recovery_graph(p: RecoveryParams) -> tuple[Graph, list[dict]]:
    """The study's steps for every model, and each model's step ids by role."""
    p.check()
    graph = Graph()
    return graph, [_declare_model(graph, p, name) for name in p.models]


def _assemble(ids: dict, out: Outcome, p: RecoveryParams) -> dict:
    name, res = ids["name"], out.results
    rows, fids, found = points_of(res, ids["points"])
    items = [i for r, f in zip(rows, found, strict=True)
             for i in item_rows(name, r["method"], r["scope"], r["level"], f)]
    training = []
    for row, step in zip(list(rows), ids["recovered"], strict=True):
        fid, after_items, trained = res[step]
        after = row["level"] + RECOVERED
        rows.append(row | {"level": after})
        fids.append(fid.assign(method=row["method"], scope=row["scope"], level=after))
        items += item_rows(name, row["method"], row["scope"], after, after_items)
        training.append(dict(model=name, method=label(row["method"], row["scope"]),
                             **{k: v for k, v in trained.items() if not isinstance(v, list)},
                             first_loss=trained["losses"][0], last_loss=trained["losses"][-1]))
    found_plans = {r["method"]: r["alphas"] for r in rows if r["method"] in HARP_KINDS}
    plans = {k: found_plans[k] for k in (HARP, HARP_BI, HARP_MEAN) if k in found_plans}
    runs = pd.DataFrame([{k: v for k, v in r.items() if k not in ("record", "alphas", "shape")} for r in rows])
    made = [out.provenance[i] for i in [ids["dense"], ids["info"], *ids["all"], *ids["points"], *ids["recovered"]]]
    info = dict(res[ids["info"]])
    drop = info.pop("harp_drop")
    dense_items = res[ids["dense"]]["items"]
    return {"runs": runs.assign(model=name, **dict.fromkeys(SPEED_COLUMNS, float("nan"))),
            "fidelity": pd.concat(fids, ignore_index=True).assign(model=name),
            "items": pd.DataFrame([dict(model=name, method=DENSE, level="", **r) for r in dense_items] + items),
            "training": pd.DataFrame(training),
            "alphas": pd.DataFrame([dict(model=name, set=k, layer=i, alpha=a) for k, plan in plans.items()
                                    for i, a in plan.items()]),
            "info": info | {"steps": steps_summary(made), "n_layers": ids["n"], "harp_drop": drop,
                            "finetune": p.finetune_spec().to_dict()},
            "seconds": dict(model=name, seconds=steps_summary(made)["compute_seconds"])}


def recovery_study(p: RecoveryParams) -> dict:
    """Every point of each model before and after the same LoRA recovery (see the module docstring), as a graph of
    stored steps run inline where the runner has not run them already (with REUSE_PARTS an interrupted run resumes
    at its first missing step).

    Returns:
        dict: runs (a row per point and stage: level "N=n" before, "N=n + LoRA" after), fidelity (per window), items
        (task items, dense's under level ""), training (per point: steps, losses, seconds), alphas, infos, seconds.
    """
    graph, models = recovery_graph(p)
    out = run_steps(graph, p.reuse_parts)
    parts = [_assemble(ids, out, p) for ids in models]
    tables = ("runs", "fidelity", "items", "training", "alphas")
    return {**{k: pd.concat([part[k] for part in parts], ignore_index=True) for k in tables},
            "infos": [part["info"] for part in parts], "seconds": pd.DataFrame([part["seconds"] for part in parts])}


# ---------------------------------------------------------------------------------------------- tables
def before_after(frontier: pd.DataFrame, metrics: tuple = ("kl", "lambada_openai", "arc_easy")) -> pd.DataFrame:
    """The frontier rows of `metrics` for the pruned points, with `point` (the method's label) and `stage` (before or
    after recovery): what the before/after figure draws."""
    rows = frontier[frontier.metric.isin(metrics) & (frontier.method != DENSE)]
    return rows.assign(point=[label(m, s) for m, s in zip(rows.method, rows.scope, strict=True)],
                       stage=["after" if lvl.endswith(RECOVERED) else "before" for lvl in rows.level])


def recovery_gains(study: dict, seed: int = 0) -> pd.DataFrame:
    """Per model, point and metric: after − before recovery, paired on the same windows (KL, Δ NLL, top-1) or items
    (tasks), with its 95 % interval and n."""
    fid = study["fidelity"].assign(point=lambda d: [label(m, s) for m, s in zip(d.method, d.scope, strict=True)])
    long = pd.concat([fid.assign(metric=m, value=fid[m]) for m in ("kl", "delta_nll", "top1_agreement")])
    items = study["items"][study["items"].method != DENSE].fillna({"scope": ""})
    items = items.assign(point=[label(m, s) for m, s in zip(items.method, items.scope, strict=True)],
                         metric=items.task, value=items.correct, window=items.doc_id)
    both = pd.concat([long, items], ignore_index=True)
    both = both.assign(method=["after" if lvl.endswith(RECOVERED) else "before" for lvl in both.level])
    return paired_table(both, "before", ["model", "point", "metric"], unit="window", value="value", seed=seed)


def ranking(frontier: pd.DataFrame) -> pd.DataFrame:
    """Per model, metric and stage: the points ordered best first (lowest KL and Δ NLL, highest accuracy), with
    `harp_rank` (1 = best) and the HARP variants' places, to say whether recovery changes who is ahead."""
    rows = []
    data = frontier[(frontier.method != DENSE) & ~frontier.metric.str.contains("−")]
    for (model, metric, level), part in data.groupby(["model", "metric", "level"], sort=False):
        ascending = metric in ("kl", "delta_nll") or metric.endswith("_bpb")
        order = part.sort_values("value", ascending=ascending)
        names = [label(m, s) for m, s in zip(order.method, order.scope, strict=True)]
        rows.append(dict(model=model, metric=metric, stage="after" if level.endswith(RECOVERED) else "before",
                         order=" > ".join(names),
                         **{f"{v}_rank": names.index(v) + 1 for v in HARP_KINDS if v in names}))
    return pd.DataFrame(rows)


def summarise_recovery(frontier: pd.DataFrame, gains: pd.DataFrame, study: dict) -> dict:
    """Headline numbers: every point's value before and after, each recovery gain, and run times."""
    out = {f"{r.model}/{label(r.method, r.scope)}/{r.level or 'dense'}/{r.metric}": float(r.value)
           for r in frontier.itertuples()}
    out |= {f"{r.model}/{r.point}/{r.metric}/gain": float(r.diff) for r in gains.itertuples()}
    out |= {f"{r.model}/seconds": float(r.seconds) for r in study["seconds"].itertuples()}
    return out
