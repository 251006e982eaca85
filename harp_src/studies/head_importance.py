"""Notebook 07: which attention heads matter, what head pruning costs and saves, and how that compares with HARP.

Per model: head scores on enwiki-train windows (Taylor masking confidence, LRP relevance, attention entropy, sink
and self mass, pairwise redundancy); a per-layer sensitivity profile on enwiki-test windows (all heads of one layer
off, one layer HARP-bypassed with α = 1 and with its own searched α); prune curves (test perplexity and KL to dense
per window) for every metric one-shot, with a global ranking and with a uniform ratio, Taylor iterative with LoRA
fine-tuning between rounds and one-shot followed by the same fine-tuning; HARP top-N at the same number of heads;
and what really slicing the heads off saves (parameters, KV bytes, attention FLOPs, decode latency interleaved with
dense) (issue 14).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from ..compare.points import ModelSteps
from ..data.corpora import ppl_windows
from ..eval.fidelity import fidelity_windows
from ..eval.stats import decided, mean_ci, paired_difference
from ..heads.choice import check_fraction, choose_heads, count_heads, iterative_schedule, without
from ..heads.finetune import FinetuneSpec, check_steps, lora_finetune
from ..heads.gates import HeadGates
from ..heads.scores import HEAD_METRICS, head_scores, keep_scores, rescore, scores_table
from ..heads.sensitivity import HARP_ONE, HARP_SEARCHED, layer_sensitivity
from ..measure.flops import half_heads_bound
from ..measure.head_savings import savings_table
from ..method.harp import harp_applied
from ..method.search import search_alphas
from ..model.adapter import get_adapter
from ..model.loading import model_info
from ..report.params import OneWindowLength, StudyParams
from ..steps import context
from ..steps.executors import Outcome, run_steps
from ..steps.graph import Graph

ONE_SHOT, UNIFORM, ITERATIVE, ONE_SHOT_FT = "one-shot", "one-shot, uniform per layer", "iterative", "one-shot + FT"
MIN_WINDOWS = 10  # fewer paired windows than this: an interval is reported but no difference is called


@dataclass(frozen=True)
class HeadImportanceParams(OneWindowLength, StudyParams):
    """Notebook 07's parameters: windows for scoring (N_CALIB), fine-tuning (N_FT), testing (N_TEST, the first N_SENS
    for the sensitivity profile); the prune curves' fractions; the iterative loop (TARGET, STEP, metrics, LoRA steps
    and rate); the sensitivity α grid; and the savings measured on really sliced models."""

    NOTEBOOK: ClassVar[str] = "07_head_importance"
    TYPES: ClassVar[dict] = {"FRACTIONS": list[float], "SENSITIVITY_GRID": list[float],
                             "SAVINGS_FRACTIONS": list[float], "ITERATIVE_METRICS": list[str]}
    models: list[str]
    n_calib: int
    n_ft: int
    n_test: int
    n_sens: int
    seq_len: int
    fractions: list[float]
    target: float
    step: float
    iterative_metrics: list[str]
    ft_steps: int
    ft_lr: float
    sensitivity_grid: list[float]
    savings_fractions: list[float]
    savings_len: int
    savings_repeats: int
    seed: int
    dtype: str
    device: str

    def check(self) -> None:
        """Refuse bad values before any model loads."""
        for f in self.fractions:
            check_fraction(f)
        check_fraction(self.target)
        check_fraction(self.step, "step fraction")
        for f in self.savings_fractions:
            check_fraction(f, "savings fraction")
        bad = [m for m in self.iterative_metrics if m not in HEAD_METRICS]
        if bad:
            raise ValueError(f"unknown metric {bad[0]!r} in ITERATIVE_METRICS; choose from {HEAD_METRICS}")
        if self.iterative_metrics:
            check_steps(self.ft_steps)
        if not 1 <= self.n_sens <= self.n_test:
            raise ValueError(f"N_SENS (the sensitivity profile's test windows) must be in 1..N_TEST={self.n_test}, "
                             f"got {self.n_sens}")


@dataclass
class ModelRun:
    """One model's share of the study: the dense model, its windows (scoring, fine-tuning, test) and the dense final
    states of the test windows."""

    name: str
    dense: object
    calib: torch.Tensor
    ft_windows: torch.Tensor
    test: torch.Tensor
    states: list


# ---------------------------------------------------------------------------------------------- prune curves
def _measure(dense, model, test: torch.Tensor, states, **labels) -> pd.DataFrame:
    """Per test window: KL to dense and NLL of `model` (which may be `dense` itself, gated)."""
    fid = fidelity_windows(dense, model, test, ref_states=states, progress=False)
    return fid[["window", "kl", "nll", "nll_reference"]].assign(**labels)


def _gated(dense, heads: dict[int, list[int]], test, states, **labels) -> pd.DataFrame:
    with HeadGates(dense) as gates:
        gates.close_heads(heads)
        return _measure(dense, dense, test, states, **labels)


def one_shot_rows(dense, keep: dict[str, torch.Tensor], fractions: list[float], test, states) -> list[pd.DataFrame]:
    """Every metric at every fraction, one-shot, global ranking and uniform per layer (random: global only)."""
    ad = get_adapter(dense)
    total = ad.n_layers * ad.n_heads
    out = []
    for metric, scores in tqdm(keep.items(), desc="one-shot curves"):
        for frac in fractions:
            for mode, schedule in (("global", ONE_SHOT), ("uniform", UNIFORM)):
                if metric == "random" and mode == "uniform":
                    continue
                heads = choose_heads(scores, ad, round(frac * total), mode=mode)
                out.append(_gated(dense, heads, test, states, metric=metric, schedule=schedule, target=frac,
                                  frac_heads_removed=count_heads(heads) / total))
    return out


def iterative_rows(run: ModelRun, metric: str, target: float, step: float, seed: int, spec: FinetuneSpec
                   ) -> tuple[list[pd.DataFrame], list[dict], dict[int, list[int]]]:
    """Remove `step` of the remaining heads, fine-tune (LoRA, on a copy), re-score (seed + round), repeat up to
    `target`.

    Returns the per-window measurements after every round, one record per round (heads, fine-tune losses, test
    perplexity), and the final head set.
    """
    check_steps(spec.steps)
    dense = run.dense
    ad = get_adapter(dense)
    total = ad.n_layers * ad.n_heads
    model = copy.deepcopy(dense)
    removed: dict[int, list[int]] = {}
    out, log = [], []
    with HeadGates(model) as gates:
        for k, count in enumerate(tqdm(iterative_schedule(ad, target, step), desc=f"iterative {metric}")):
            scores = without(rescore(model, metric, run.calib, seed + k), removed)
            removed = choose_heads(scores, ad, count)
            gates.close_heads(removed)
            ft = lora_finetune(model, run.ft_windows, FinetuneSpec(**{**spec.to_dict(), "seed": spec.seed + k}),
                               progress=False)
            part = _measure(dense, model, run.test, run.states, metric=metric, schedule=ITERATIVE, target=target,
                            frac_heads_removed=count_heads(removed) / total)
            out.append(part)
            log.append(dict(round=k + 1, heads_removed=count_heads(removed), ft_loss_first=ft["losses"][0],
                            ft_loss_last=ft["losses"][-1], trainable_params=ft["trainable_params"],
                            test_ppl=math.exp(part.nll.mean())))
    return out, log, removed


def one_shot_finetuned(run: ModelRun, heads: dict[int, list[int]], metric: str, target: float, spec: FinetuneSpec
                       ) -> pd.DataFrame:
    """The one-shot head set with the iterative loop's total fine-tuning after it (the fair contrast)."""
    dense = run.dense
    ad = get_adapter(dense)
    model = copy.deepcopy(dense)
    with HeadGates(model) as gates:
        gates.close_heads(heads)
        lora_finetune(model, run.ft_windows, spec, progress=False)
        return _measure(dense, model, run.test, run.states, metric=metric, schedule=ONE_SHOT_FT, target=target,
                        frac_heads_removed=count_heads(heads) / (ad.n_layers * ad.n_heads))


def harp_points(dense, alphas: dict[int, float], fractions: list[float], test, states) -> list[pd.DataFrame]:
    """HARP on the top N = round(f · L) layers (every head of N layers: the same heads removed as fraction f), with
    the searched α's (a top-down search of the deepest N gives every shallower N's α's) and with α = 1."""
    ad = get_adapter(dense)
    out = []
    for frac in fractions:
        n = max(1, round(frac * ad.n_layers))
        layers = list(range(ad.n_layers - n, ad.n_layers))
        for schedule, plan in ((HARP_SEARCHED, {i: alphas[i] for i in layers}), (HARP_ONE, dict.fromkeys(layers, 1.0))):
            with harp_applied(dense, layers, plan):
                out.append(_measure(dense, dense, test, states, metric="HARP", schedule=schedule, target=frac,
                                    frac_heads_removed=n / ad.n_layers))
    return out


def curve_summary(windows: pd.DataFrame, seed: int = 0) -> pd.DataFrame:
    """Per model, metric, schedule and fraction: ppl = exp(mean window NLL) and mean KL, each with its 95 % interval
    over windows (the ppl interval is the exponentiated NLL interval)."""
    rows = []
    keys = ["model", "metric", "schedule", "target", "frac_heads_removed"]
    for key, part in windows.groupby(keys, sort=False):
        nll, lo, hi = mean_ci(part.nll.to_numpy(), seed)
        kl, kl_lo, kl_hi = mean_ci(part.kl.to_numpy(), seed)
        rows.append(dict(zip(keys, key, strict=True), ppl=math.exp(nll), ppl_low=math.exp(lo), ppl_high=math.exp(hi),
                         kl=kl, kl_low=kl_lo, kl_high=kl_hi, n_windows=len(part)))
    return pd.DataFrame(rows)


def _pair(windows: pd.DataFrame, model: str, a: tuple, b: tuple, seed: int) -> list[dict]:
    """a − b (metric, schedule, target) on the same windows, for NLL and KL."""
    def pick(key):
        m = windows[(windows.model == model) & (windows.metric == key[0]) & (windows.schedule == key[1])
                    & np.isclose(windows.target, key[2])]
        m = m[m.frac_heads_removed == m.frac_heads_removed.max()]  # iterative: its final round
        return m.set_index("window").sort_index()
    pa, pb = pick(a), pick(b)
    if pa.empty or pb.empty:
        return []
    rows = []
    for value in ("nll", "kl"):
        d = paired_difference(pa[value].to_numpy(), pb[value].to_numpy(), seed)
        d["decided"] = bool(decided(d["ci_low"], d["ci_high"]) and d["n"] >= MIN_WINDOWS)
        rows.append(dict(model=model, a=f"{a[0]} · {a[1]}", b=f"{b[0]} · {b[1]}", target=a[2], value=value, **d))
    return rows


def standard_comparisons(windows: pd.DataFrame, best: dict[tuple[str, float], str]) -> list[tuple[tuple, tuple]]:
    """The paired comparisons the conclusions rest on, per model: each metric vs random (one-shot), uniform vs
    global per metric, iterative vs one-shot and vs one-shot + FT, and HARP (searched α) vs the best one-shot metric
    at each fraction (`best[(model, fraction)]`)."""
    out = []
    for model, part in windows.groupby("model", sort=False):
        fracs = sorted(part[part.schedule == ONE_SHOT].target.unique())
        for frac in fracs:
            for metric in [m for m in HEAD_METRICS if m != "random"]:
                out.append((model, (metric, ONE_SHOT, frac), ("random", ONE_SHOT, frac)))
                out.append((model, (metric, UNIFORM, frac), (metric, ONE_SHOT, frac)))
            if (model, frac) in best:
                out.append((model, ("HARP", HARP_SEARCHED, frac), (best[(model, frac)], ONE_SHOT, frac)))
        for metric, target in part[part.schedule == ITERATIVE][["metric", "target"]].drop_duplicates().itertuples(
                index=False):
            out.append((model, (metric, ITERATIVE, target), (metric, ONE_SHOT, target)))
            out.append((model, (metric, ITERATIVE, target), (metric, ONE_SHOT_FT, target)))
    return out


def curve_differences(windows: pd.DataFrame, summary: pd.DataFrame, seed: int = 0) -> pd.DataFrame:
    """Paired differences (a − b per window; negative = a closer to dense) of `standard_comparisons`.

    With fewer than MIN_WINDOWS windows `decided` stays False: such intervals cannot decide.
    """
    one = summary[(summary.schedule == ONE_SHOT) & (summary.metric != "random")]
    best = {(m, t): p.sort_values("ppl").metric.iloc[0] for (m, t), p in one.groupby(["model", "target"])}
    rows = []
    for model, a, b in standard_comparisons(windows, best):
        rows += _pair(windows, model, a, b, seed)
    return pd.DataFrame(rows)


# ---------------------------------------------------------------------------------------------- the study
def _model_run(key: dict) -> ModelRun:
    """The model's share of the study as a step opens it: the dense model, its scoring, fine-tuning (N_FT more
    enwiki-train windows after the scoring ones, disjoint from them) and test windows, and dense's test states."""
    setup = key["setup"]
    dense, tok = context.dense(setup)
    n_calib, seq_len = setup["n_calib"], setup["calib_len"]
    calib = context.windows(setup, "train")
    ft_windows = (ppl_windows(tok, "enwiki", "train", n_calib + key["n_ft"], seq_len, setup["seed"])[n_calib:]
                  if key.get("n_ft") else calib[:0])
    return ModelRun(setup["model"], dense, calib, ft_windows, context.windows(setup, "test"), context.states(setup))


def scores_step(key: dict, inputs: dict) -> dict:
    """Every head's raw statistics and pairwise redundancy on the scoring windows, and the keep scores they give."""
    run = _model_run(key)
    raw, pairs = head_scores(run.dense, run.calib)
    return {"raw": raw, "pairs": pairs, "keep": keep_scores(raw, key["setup"]["seed"])}


def sensitivity_step(key: dict, inputs: dict) -> pd.DataFrame:
    """The per-layer sensitivity profile on the first N_SENS test windows."""
    run = _model_run(key)
    return layer_sensitivity(run.dense, run.calib, run.test[: key["n_sens"]], tuple(key["grid"]))


def one_shot_step(key: dict, inputs: dict) -> list[pd.DataFrame]:
    """Every metric's one-shot prune curve (`one_shot_rows`), then dense itself, per test window."""
    run = _model_run(key)
    windows = one_shot_rows(run.dense, inputs["scores"]["keep"], key["fractions"], run.test, run.states)
    windows.append(_measure(run.dense, run.dense, run.test, run.states, metric="dense", schedule="dense", target=0.0,
                            frac_heads_removed=0.0))
    return windows


def iterative_step(key: dict, inputs: dict) -> dict:
    """One metric's iterative prune → fine-tune loop, and the same final head count one-shot with the same total
    fine-tuning: windows, the rounds' log, and the one-shot set {label: (fraction, heads)}."""
    run = _model_run(key)
    ad = get_adapter(run.dense)
    total, metric, seed = ad.n_layers * ad.n_heads, key["metric"], key["setup"]["seed"]
    spec_ft = FinetuneSpec(steps=key["ft_steps"], lr=key["ft_lr"], seed=seed)
    windows, log, removed = iterative_rows(run, metric, key["target"], key["step"], seed, spec_ft)
    one = choose_heads(inputs["scores"]["keep"][metric], ad, count_heads(removed))
    all_steps = FinetuneSpec(**{**spec_ft.to_dict(), "steps": spec_ft.steps * len(log)})
    windows.append(one_shot_finetuned(run, one, metric, key["target"], all_steps))
    return {"windows": windows, "rounds": [dict(model=run.name, metric=metric, **r) for r in log],
            "set": {f"{metric} one-shot, {count_heads(one) / total:.0%} heads": (count_heads(one) / total, one)}}


def harp_step(key: dict, inputs: dict) -> dict:
    """α searched on the scoring windows for the deepest fraction's top layers, and HARP's points at every fraction
    (`harp_points`)."""
    run = _model_run(key)
    n_layers = get_adapter(run.dense).n_layers
    top = max(1, round(max(key["fractions"]) * n_layers))
    alphas = search_alphas(run.dense, run.calib, list(range(n_layers - top, n_layers)))
    return {"alphas": alphas, "windows": harp_points(run.dense, alphas, key["fractions"], run.test, run.states)}


def savings_step(key: dict, inputs: dict) -> dict:
    """What really slicing off the iterative loops' one-shot sets and Taylor's SAVINGS_FRACTIONS saves, beside HARP at
    the same fractions (`savings_table`; timed, so it runs alone), the half-heads bound and the model's provenance."""
    run = _model_run(key)
    ad = get_adapter(run.dense)
    total = ad.n_layers * ad.n_heads
    loops = [inputs[f"it{k}"] for k in range(len(inputs)) if f"it{k}" in inputs]  # in ITERATIVE_METRICS' order
    final_sets = {label: v for loop in loops for label, v in loop["set"].items()}
    for frac in key["fractions"]:
        heads = choose_heads(inputs["scores"]["keep"]["taylor"], ad, round(frac * total))
        final_sets.setdefault(f"taylor one-shot, {count_heads(heads) / total:.0%} heads",
                              (count_heads(heads) / total, heads))
    savings, check = savings_table(run.dense, run.test[:1], final_sets, inputs["harp"]["alphas"], key["fractions"],
                                   seq_len=key["seq_len"], repeats=key["repeats"])
    return {"savings": savings, "check": check, "bound": half_heads_bound(run.dense.config, key["seq_len"]),
            "info": model_info(run.dense)}


def _declare_model(graph: Graph, p: HeadImportanceParams, name: str) -> dict:
    """One model's steps: the scores, then the sensitivity profile, the one-shot curves, each iterative loop and
    HARP's points side by side, then the savings of the final head sets (alone: it times them)."""
    ms = ModelSteps.open(graph, p, name)
    windows = p.n_test * p.seq_len / 256  # one pass over the test windows
    scores = ms.add(scores_step, {}, label="head scores", size=3 * p.n_calib * p.seq_len / 256)
    sens = ms.add(sensitivity_step, {"n_sens": p.n_sens, "grid": list(p.sensitivity_grid)}, label="sensitivity",
                  size=ms.num_layers * (len(p.sensitivity_grid) + 2) * p.n_sens * p.seq_len / 256)
    one = ms.add(one_shot_step, {"fractions": list(p.fractions)}, {"scores": scores}, "one-shot curves",
                 size=len(HEAD_METRICS) * 2 * len(p.fractions) * windows)
    iterative = [ms.add(iterative_step, {"metric": m, "n_ft": p.n_ft, "target": p.target, "step": p.step,
                                         "ft_steps": p.ft_steps, "ft_lr": p.ft_lr}, {"scores": scores},
                        f"iterative {m}", size=10 * (p.ft_steps + windows)) for m in p.iterative_metrics]
    harp = ms.add(harp_step, {"fractions": list(p.fractions)}, label="HARP points",
                  size=max(p.fractions) * ms.num_layers * p.n_calib * p.seq_len / 256 + 2 * len(p.fractions) * windows)
    savings = ms.add(savings_step, {"fractions": list(p.savings_fractions), "seq_len": p.savings_len,
                                    "repeats": p.savings_repeats},
                     {"scores": scores, "harp": harp} | {f"it{k}": i for k, i in enumerate(iterative)}, "savings",
                     alone=True, size=(len(p.iterative_metrics) + 2 * len(p.savings_fractions)) * p.savings_len / 256
                     * (1 + p.savings_repeats))
    return {"name": name, "scores": scores, "sensitivity": sens, "one_shot": one, "iterative": iterative,
            "harp": harp, "savings": savings}


def head_importance_graph(p: HeadImportanceParams) -> tuple[Graph, list[dict]]:
    """The study's steps for every model, and each model's step ids by role."""
    p.check()
    graph = Graph()
    return graph, [_declare_model(graph, p, name) for name in p.models]


def _model_tables(ids: dict, out: Outcome) -> dict:
    name, res = ids["name"], out.results
    scores, iterative, harp, savings = (res[ids["scores"]], [res[i] for i in ids["iterative"]], res[ids["harp"]],
                                        res[ids["savings"]])
    windows = res[ids["one_shot"]] + [w for it in iterative for w in it["windows"]] + harp["windows"]
    made = {role: out.provenance[ids[role]].get("seconds", 0.0)
            for role in ("scores", "sensitivity", "one_shot", "harp", "savings")}
    made["iterative"] = sum(out.provenance[i].get("seconds", 0.0) for i in ids["iterative"])
    return {"scores": scores_table(scores["raw"], name), "pairs": scores["pairs"].assign(model=name),
            "sensitivity": res[ids["sensitivity"]].assign(model=name),
            "windows": pd.concat(windows, ignore_index=True).assign(model=name),
            "rounds": pd.DataFrame([r for it in iterative for r in it["rounds"]]),
            "savings": savings["savings"].assign(model=name), "bound": dict(model=name, **savings["bound"]),
            "alphas": pd.DataFrame([dict(model=name, layer=i, alpha=a) for i, a in harp["alphas"].items()]),
            "check": dict(model=name, **savings["check"]), "info": savings["info"],
            "seconds": dict(model=name, seconds=sum(made.values()), **made)}


def head_importance_study(p: HeadImportanceParams) -> dict:
    """Everything notebook 07 shows, for each model; tables concatenated over models. The sensitivity profile uses
    the first N_SENS test windows (it runs 3 configurations per layer). A graph of stored steps per model (see
    `head_importance_graph`), run inline where the runner has not run them already.

    Returns:
        dict: scores (model, metric, layer, head, score), pairs, sensitivity, windows (per test window of every
        pruned configuration: metric, schedule, target, frac_heads_removed, kl, nll), rounds (the iterative log),
        savings, bounds, alphas, checks, infos, seconds (compute seconds per model and part).
    """
    graph, models = head_importance_graph(p)
    out = run_steps(graph, reuse=False)
    parts = [_model_tables(ids, out) for ids in models]

    def cat(key):
        return pd.concat([part[key] for part in parts], ignore_index=True)
    return {**{k: cat(k) for k in ("scores", "pairs", "sensitivity", "windows", "rounds", "savings", "alphas")},
            "bounds": pd.DataFrame([part["bound"] for part in parts]),
            "checks": pd.DataFrame([part["check"] for part in parts]),
            "infos": [part["info"] for part in parts], "seconds": pd.DataFrame([part["seconds"] for part in parts])}


# ---------------------------------------------------------------------------------------------- tables for 07
SAVINGS_METRICS = {"params_removed_M": "parameters removed (millions)", "kv_ratio": "KV cache, pruned / dense",
                   "attn_prefill_flop_ratio": "attention FLOPs, dense / pruned (prefill)",
                   "attn_decode_flop_ratio": "attention FLOPs, dense / pruned (one decode step)",
                   "decode_speedup": "decode time, dense / pruned (measured)",
                   "prefill_speedup": "prefill time, dense / pruned (measured)"}


def savings_long(savings: pd.DataFrame) -> pd.DataFrame:
    """The savings table in long form for one panel per quantity: model, config, metric, value."""
    wide = savings.assign(params_removed_M=savings.params_removed / 1e6)
    keep = [m for m in SAVINGS_METRICS if m in wide]
    long = wide.melt(id_vars=["model", "config", "frac_heads_removed"], value_vars=keep, var_name="metric",
                     value_name="value")
    return long.assign(metric=long.metric.map(SAVINGS_METRICS))


def summarise_head_importance(study: dict, summary: pd.DataFrame, diffs: pd.DataFrame, corr: pd.DataFrame) -> dict:
    """Headline numbers: every curve point (ppl, kl), every paired difference, the sensitivity extremes, metric
    correlations, savings, the sliced-vs-gated check and run times."""
    out = {}
    for r in summary.itertuples():
        key = f"{r.model}/{r.metric}/{r.schedule}/{r.frac_heads_removed:.3f}"
        out[f"{key}/ppl"], out[f"{key}/kl"] = float(r.ppl), float(r.kl)
    for r in diffs.itertuples():
        out[f"{r.model}/{r.a} - {r.b}/{r.target:.2f}/{r.value}"] = [float(r.diff), float(r.ci_low), float(r.ci_high)]
    for (model, what), part in study["sensitivity"].groupby(["model", "intervention"]):
        if what != "dense":
            top = part.sort_values("ppl").iloc[-1]
            out[f"{model}/sensitivity/{what}/most_sensitive_layer"] = int(top.layer)
            out[f"{model}/sensitivity/{what}/max_ppl"] = float(top.ppl)
    for r in corr.itertuples():
        out[f"{r.model}/spearman/{r.a}~{r.b}"] = float(r.rho)
    for r in study["savings"].itertuples():
        for m in ("params_removed", "kv_ratio", "attn_prefill_flop_ratio", "attn_decode_flop_ratio",
                  "decode_speedup"):
            if hasattr(r, m):
                out[f"{r.model}/savings/{r.config}/{m}"] = float(getattr(r, m))
    for r in study["bounds"].itertuples():
        out[f"{r.model}/half_heads/prefill_attention_flop_ratio"] = float(r.prefill_attention_flop_ratio)
        out[f"{r.model}/half_heads/decode_attention_flop_ratio"] = float(r.decode_attention_flop_ratio)
    for r in study["checks"].itertuples():
        out[f"{r.model}/max_abs_logit_diff_sliced_vs_gated"] = float(r.max_abs_logit_diff_sliced_vs_gated)
    for r in study["seconds"].itertuples():
        out[f"{r.model}/seconds"] = float(r.seconds)
    return out
