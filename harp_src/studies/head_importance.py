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
import time
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from ..checkpoints import load_model
from ..data.corpora import ppl_windows
from ..eval.fidelity import fidelity_windows, reference_states
from ..eval.stats import decided, mean_ci, paired_difference
from ..heads.choice import check_fraction, choose_heads, count_heads, iterative_schedule, without
from ..heads.finetune import FinetuneSpec, check_steps, lora_finetune
from ..heads.gates import HeadGates
from ..heads.removal import slice_off_heads
from ..heads.scores import HEAD_METRICS, head_scores, keep_scores, rescore, scores_table
from ..heads.sensitivity import HARP_ONE, HARP_SEARCHED, layer_sensitivity
from ..measure.flops import bypass_flops, half_heads_bound, heads_attention_flops
from ..measure.kv import prompt_kv_bytes
from ..measure.timing import latency_pair
from ..method.harp import apply_harp, harp_applied
from ..method.search import search_alphas
from ..model.adapter import get_adapter
from ..model.loading import model_info
from ..model.weights import n_params
from ..report.params import StudyParams

ONE_SHOT, UNIFORM, ITERATIVE, ONE_SHOT_FT = "one-shot", "one-shot, uniform per layer", "iterative", "one-shot + FT"




MIN_WINDOWS = 10  # fewer paired windows than this: an interval is reported but no difference is called


@dataclass(frozen=True)
class HeadImportanceParams(StudyParams):
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


def iterative_rows(run: ModelRun, metric: str, p: HeadImportanceParams, spec: FinetuneSpec
                   ) -> tuple[list[pd.DataFrame], list[dict], dict[int, list[int]]]:
    """Remove STEP of the remaining heads, fine-tune (LoRA, on a copy), re-score, repeat up to TARGET.

    Returns the per-window measurements after every round, one record per round (heads, fine-tune losses, test
    perplexity), and the final head set.
    """
    check_steps(spec.steps)
    dense, target, seed = run.dense, p.target, p.seed
    ad = get_adapter(dense)
    total = ad.n_layers * ad.n_heads
    model = copy.deepcopy(dense)
    removed: dict[int, list[int]] = {}
    out, log = [], []
    with HeadGates(model) as gates:
        for k, count in enumerate(tqdm(iterative_schedule(ad, target, p.step), desc=f"iterative {metric}")):
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


def savings_row(dense, model, p: HeadImportanceParams, dense_kv: int, dense_params: int) -> dict:
    """What one really pruned model saves against dense: parameters, KV bytes at SAVINGS_LEN, and prefill / decode
    latency there, interleaved with dense (`measure.timing.latency_pair`; SAVINGS_REPEATS 0 skips the timing)."""
    seq_len, repeats = p.savings_len, p.savings_repeats
    lat = latency_pair(dense, model, seq_len, repeats=repeats) if repeats else {}
    kv = prompt_kv_bytes(model, seq_len)
    removed = dense_params - n_params(model)
    return dict(params_removed=removed, kv_bytes=kv, kv_ratio=kv / dense_kv, **lat)


def savings_table(run: ModelRun, heads_sets: dict[str, tuple[float, dict[int, list[int]]]], alphas: dict[int, float],
                  p: HeadImportanceParams) -> tuple[pd.DataFrame, dict]:
    """Slice each head set off a copy (checked: same logits as the gated model), build HARP at the same heads (the
    SAVINGS_FRACTIONS of layers), and measure what each saves. Returns the table and the largest |sliced − gated|
    logit difference."""
    dense, test, seq_len = run.dense, run.test, p.savings_len
    ad = get_adapter(dense)
    cfg = dense.config
    dense_params = n_params(dense)
    dense_kv = prompt_kv_bytes(dense, seq_len)
    prefill_dense, decode_dense = bypass_flops(cfg, {}, seq_len), bypass_flops(cfg, {}, 1, seq_len)
    rows, worst = [], 0.0
    probe = test[:1]
    for label, (frac, heads) in heads_sets.items():
        with HeadGates(dense) as gates:
            gates.close_heads(heads)
            with torch.no_grad():
                gated = dense(input_ids=probe).logits
        model = copy.deepcopy(dense)
        slice_off_heads(model, heads)
        with torch.no_grad():
            worst = max(worst, float((model(input_ids=probe).logits - gated).abs().max()))
        kept = {i: ad.n_heads - len(heads.get(i, [])) for i in range(ad.n_layers)}
        row = dict(config=label, frac_heads_removed=frac) | savings_row(dense, model, p, dense_kv, dense_params)
        row |= dict(attn_prefill_flop_ratio=prefill_dense / heads_attention_flops(cfg, kept, seq_len),
                    attn_decode_flop_ratio=decode_dense / heads_attention_flops(cfg, kept, 1, seq_len))
        rows.append(row)
        del model
    for frac in p.savings_fractions:
        n = max(1, round(frac * ad.n_layers))
        plan = {i: alphas[i] for i in range(ad.n_layers - n, ad.n_layers)}
        model = copy.deepcopy(dense)
        apply_harp(model, sorted(plan), plan)
        row = dict(config=f"{HARP_SEARCHED}, top {frac:.0%} of layers", frac_heads_removed=n / ad.n_layers)
        row |= savings_row(dense, model, p, dense_kv, dense_params)
        row |= dict(attn_prefill_flop_ratio=prefill_dense / bypass_flops(cfg, plan, seq_len),
                    attn_decode_flop_ratio=decode_dense / bypass_flops(cfg, plan, 1, seq_len))
        rows.append(row)
        del model
    return pd.DataFrame(rows), {"max_abs_logit_diff_sliced_vs_gated": worst}


# ---------------------------------------------------------------------------------------------- the study
def _iterative_part(run: ModelRun, p: HeadImportanceParams, keep: dict) -> tuple[list, list, dict]:
    """Iterative prune → fine-tune per metric, and the same final head count one-shot with the same total
    fine-tuning: (per-window measurements, the rounds' log, {label: (fraction, head set)} of the one-shot sets)."""
    ad = get_adapter(run.dense)
    total = ad.n_layers * ad.n_heads
    spec_ft = FinetuneSpec(steps=p.ft_steps, lr=p.ft_lr, seed=p.seed)
    windows, rounds, final_sets = [], [], {}
    for metric in p.iterative_metrics:
        parts, log, removed = iterative_rows(run, metric, p, spec_ft)
        windows += parts
        rounds += [dict(model=run.name, metric=metric, **r) for r in log]
        one = choose_heads(keep[metric], ad, count_heads(removed))
        all_steps = FinetuneSpec(**{**spec_ft.to_dict(), "steps": spec_ft.steps * len(log)})
        windows.append(one_shot_finetuned(run, one, metric, p.target, all_steps))
        final_sets[f"{metric} one-shot, {count_heads(one) / total:.0%} heads"] = (count_heads(one) / total, one)
    return windows, rounds, final_sets


def _model_part(name: str, p: HeadImportanceParams) -> dict:
    start = time.perf_counter()
    dense, tok = load_model(name, dtype=p.dtype, device=p.device)
    ad = get_adapter(dense)
    calib = ppl_windows(tok, "enwiki", "train", p.n_calib, p.seq_len, p.seed)
    ft_windows = ppl_windows(tok, "enwiki", "train", p.n_calib + p.n_ft, p.seq_len,
                             p.seed)[p.n_calib:]  # disjoint from the scoring windows
    test = ppl_windows(tok, "enwiki", "test", p.n_test, p.seq_len, p.seed)
    run = ModelRun(name, dense, calib, ft_windows, test, reference_states(dense, test))
    seconds = {}

    def lap(what):
        seconds[what] = time.perf_counter() - start - sum(seconds.values())

    raw, pairs = head_scores(dense, calib)
    keep = keep_scores(raw, p.seed)
    lap("scores")
    sensitivity = layer_sensitivity(dense, calib, test[: p.n_sens], tuple(p.sensitivity_grid)).assign(model=name)
    lap("sensitivity")
    windows = one_shot_rows(dense, keep, p.fractions, test, run.states)
    windows.append(_measure(dense, dense, test, run.states, metric="dense", schedule="dense", target=0.0,
                            frac_heads_removed=0.0))
    lap("one_shot")
    parts, rounds, final_sets = _iterative_part(run, p, keep)
    windows += parts
    lap("iterative")
    top = max(1, round(max(p.fractions) * ad.n_layers))
    alphas = search_alphas(dense, calib, list(range(ad.n_layers - top, ad.n_layers)))
    windows += harp_points(dense, alphas, p.fractions, test, run.states)
    lap("harp")
    total = ad.n_layers * ad.n_heads
    for frac in p.savings_fractions:
        heads = choose_heads(keep["taylor"], ad, round(frac * total))
        final_sets.setdefault(f"taylor one-shot, {count_heads(heads) / total:.0%} heads", (count_heads(heads) / total,
                                                                                           heads))
    savings, check = savings_table(run, final_sets, alphas, p)
    lap("savings")
    return {"scores": scores_table(raw, name), "pairs": pairs.assign(model=name), "sensitivity": sensitivity,
            "windows": pd.concat(windows, ignore_index=True).assign(model=name),
            "rounds": pd.DataFrame(rounds), "savings": savings.assign(model=name),
            "bound": dict(model=name, **half_heads_bound(dense.config, p.savings_len)),
            "alphas": pd.DataFrame([dict(model=name, layer=i, alpha=a) for i, a in alphas.items()]),
            "check": dict(model=name, **check), "info": model_info(dense),
            "seconds": dict(model=name, seconds=time.perf_counter() - start, **seconds)}


def head_importance_study(p: HeadImportanceParams) -> dict:
    """Everything notebook 07 shows, for each model; tables concatenated over models. The sensitivity profile uses
    the first N_SENS test windows (it runs 3 configurations per layer).

    Returns:
        dict: scores (model, metric, layer, head, score), pairs, sensitivity, windows (per test window of every
        pruned configuration: metric, schedule, target, frac_heads_removed, kl, nll), rounds (the iterative log),
        savings, bounds, alphas, checks, infos, seconds.
    """
    p.check()
    parts = [_model_part(name, p) for name in p.models]

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
