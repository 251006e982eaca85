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

import numpy as np
import pandas as pd
import torch
from scipy import stats as sstats
from tqdm.auto import tqdm

from ..checkpoints import load_model
from ..data import ppl_windows
from ..evaluate import fidelity_windows, reference_states
from ..finetune import FinetuneSpec, check_steps, lora_finetune
from ..flops import attention_flops, layer_flops
from ..harp import apply_harp, kv_cache_bytes
from ..head_pruning import check_fraction, choose_heads, count_heads, iterative_schedule, without
from ..heads import (
    HeadGates,
    gate_gradients,
    head_statistics,
    most_redundant,
    per_layer_l2,
    slice_off_heads,
    taylor_head_scores,
)
from ..lrp import lrp_head_scores
from ..models import get_adapter, model_info, text_config
from ..prefix import Boundaries, harp_applied
from ..search import GRID, search_alphas
from ..stats import decided, mean_ci, paired_difference
from ..timing import latency_pair

HEAD_METRICS = ("taylor", "taylor_raw", "lrp", "entropy", "sink", "random")  # what ranks heads for pruning
SHOWN_SCORES = ("taylor", "taylor_raw", "lrp", "entropy_norm", "sink", "self")  # the heat maps and their correlations
ONE_SHOT, UNIFORM, ITERATIVE, ONE_SHOT_FT = "one-shot", "one-shot, uniform per layer", "iterative", "one-shot + FT"
HARP_SEARCHED, HARP_ONE = "HARP, searched α", "HARP, α = 1"
MIN_WINDOWS = 10  # fewer paired windows than this: an interval is reported but no difference is called


# ---------------------------------------------------------------------------------------------- scores
def keep_score(metric: str, raw: dict[str, torch.Tensor], seed: int = 0) -> torch.Tensor:
    """Keep scores (higher = keep) of one pruning metric from the raw per-head statistics it needs.

    taylor (normalised per layer, as Michel et al.), taylor_raw (not normalised: one scale over all layers), lrp: as
    measured; entropy: 1 − normalised entropy (near-uniform averaging heads go first); sink: 1 − mass on the first
    token (degenerate sink heads go first); random: uniform noise (seeded), shaped like any raw statistic.
    """
    if metric in ("taylor", "taylor_raw", "lrp"):
        return raw[metric].double()
    if metric == "entropy":
        return 1 - raw["entropy_norm"].double()
    if metric == "sink":
        return 1 - raw["sink"].double()
    shape = next(iter(raw.values())).shape
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def keep_scores(raw: dict[str, torch.Tensor], seed: int = 0) -> dict[str, torch.Tensor]:
    """`keep_score` of every metric of HEAD_METRICS."""
    return {m: keep_score(m, raw, seed) for m in HEAD_METRICS}


def _grid(heads: pd.DataFrame, column: str, shape) -> torch.Tensor:
    out = torch.full(shape, float("nan"), dtype=torch.float64)
    for r in heads.itertuples():
        out[r.layer, r.head] = getattr(r, column)
    return out


def head_scores(model, calib: torch.Tensor, progress: bool = True) -> tuple[dict[str, torch.Tensor], pd.DataFrame]:
    """Raw per-head statistics [n_layers, n_heads] (taylor, taylor_raw, lrp, entropy, entropy_norm, sink, self) and
    the pairs table of `heads.head_statistics` (js, cos per pair of heads in a layer)."""
    ad = get_adapter(model)
    heads, pairs = head_statistics(model, calib, progress)
    grads = gate_gradients(model, calib, progress).abs().mean(0).double()
    raw = {"taylor": per_layer_l2(grads), "taylor_raw": grads,
           "lrp": lrp_head_scores(model, calib, progress=progress).double()}
    raw |= {c: _grid(heads, c, (ad.n_layers, ad.n_heads)) for c in ("entropy", "entropy_norm", "sink", "self")}
    return raw, pairs


def scores_table(raw: dict[str, torch.Tensor], model: str) -> pd.DataFrame:
    """Long form: model, metric, layer, head, score."""
    rows = [dict(model=model, metric=m, layer=i, head=h, score=float(t[i, h]))
            for m, t in raw.items() for i in range(t.shape[0]) for h in range(t.shape[1])]
    return pd.DataFrame(rows)


def metric_correlations(scores: pd.DataFrame, metrics: tuple[str, ...] = SHOWN_SCORES) -> pd.DataFrame:
    """Spearman rank correlation over all heads of each pair of metrics, per model: model, a, b, rho, p."""
    rows = []
    for model, part in scores.groupby("model", sort=False):
        wide = part.pivot_table(index=["layer", "head"], columns="metric", values="score")
        for k, a in enumerate(metrics):
            for b in metrics[k + 1:]:
                res = sstats.spearmanr(wide[a], wide[b])
                rows.append(dict(model=model, a=a, b=b, rho=float(res.statistic), p=float(res.pvalue)))
    return pd.DataFrame(rows)


def redundancy_by_layer(pairs: pd.DataFrame, scores: pd.DataFrame) -> pd.DataFrame:
    """Per model and layer: the most similar pair's JS (bits), the highest output cosine, and the largest sink mass
    of any head; long form with metric, value (for one figure with a panel per metric)."""
    best = most_redundant(pairs)
    sink = scores[scores.metric == "sink"].groupby(["model", "layer"]).score.max().rename("max_sink").reset_index()
    wide = best.merge(sink, on=["model", "layer"])
    n = wide.groupby("model").layer.transform("max").clip(lower=1)
    wide["depth"] = wide.layer / n
    return wide.melt(id_vars=["model", "layer", "depth"], value_vars=["js", "cos", "max_sink"], var_name="metric",
                     value_name="value")


# ---------------------------------------------------------------------------------------------- sensitivity
def _ppl(nll_count: tuple[float, int]) -> float:
    return math.exp(nll_count[0] / nll_count[1])


def layer_sensitivity(model, calib: torch.Tensor, test: torch.Tensor, grid=GRID, progress: bool = True
                      ) -> pd.DataFrame:
    """Test perplexity with one layer changed at a time: all its heads gated off, HARP-bypassed with α = 1, and
    bypassed with its own α searched (on `calib`) over `grid` with only that layer pruned.

    Returns:
        layer, depth, intervention, ppl, alpha; plus one row per layer of the dense model ("dense").
    """
    ad = get_adapter(model)
    test_bounds, calib_bounds = Boundaries(model, test), Boundaries(model, calib)
    dense = _ppl(test_bounds.nll_from(ad.n_layers - 1))
    rows = []
    for i in tqdm(range(ad.n_layers), desc="layer sensitivity", disable=not progress):
        depth = i / max(ad.n_layers - 1, 1)
        with HeadGates(model) as gates:
            gates.close_heads({i: list(range(ad.n_heads))})
            rows.append(dict(layer=i, depth=depth, intervention="all heads off", ppl=_ppl(test_bounds.nll_from(i)),
                             alpha=float("nan")))
        calib_ppl = {}
        for alpha in grid:
            with harp_applied(model, [i], {i: alpha}):
                calib_ppl[alpha] = _ppl(calib_bounds.nll_from(i))
        best = min(grid, key=lambda a: (calib_ppl[a], a))
        for name, alpha in ((HARP_ONE, 1.0), (HARP_SEARCHED, best)):
            with harp_applied(model, [i], {i: alpha}):
                rows.append(dict(layer=i, depth=depth, intervention=name, ppl=_ppl(test_bounds.nll_from(i)),
                                 alpha=alpha))
        rows.append(dict(layer=i, depth=depth, intervention="dense", ppl=dense, alpha=float("nan")))
    return pd.DataFrame(rows)


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


def _rescore(model, metric: str, calib, seed: int) -> torch.Tensor:
    """Keep scores of `metric` on `model` as it is now (its gates included)."""
    if metric in ("taylor", "taylor_raw"):
        return taylor_head_scores(model, calib, normalise=metric == "taylor", progress=False)
    if metric == "lrp":
        return lrp_head_scores(model, calib, progress=False).double()
    ad = get_adapter(model)
    shape = (ad.n_layers, ad.n_heads)
    if metric == "random":
        return keep_score(metric, {"shape": torch.empty(shape)}, seed)
    heads, _ = head_statistics(model, calib, progress=False)
    return keep_score(metric, {c: _grid(heads, c, shape) for c in ("entropy_norm", "sink")}, seed)


def iterative_rows(dense, metric: str, target: float, step: float, calib, ft_windows, spec: FinetuneSpec, test,
                   states, seed: int = 0) -> tuple[list[pd.DataFrame], list[dict], dict[int, list[int]]]:
    """Remove `step` of the remaining heads, fine-tune (LoRA, on a copy), re-score, repeat up to `target`.

    Returns the per-window measurements after every round, one record per round (heads, fine-tune losses, test
    perplexity), and the final head set.
    """
    check_steps(spec.steps)
    ad = get_adapter(dense)
    total = ad.n_layers * ad.n_heads
    model = copy.deepcopy(dense)
    removed: dict[int, list[int]] = {}
    out, log = [], []
    with HeadGates(model) as gates:
        for k, count in enumerate(tqdm(iterative_schedule(ad, target, step), desc=f"iterative {metric}")):
            scores = without(_rescore(model, metric, calib, seed + k), removed)
            removed = choose_heads(scores, ad, count)
            gates.close_heads(removed)
            ft = lora_finetune(model, ft_windows, FinetuneSpec(**{**spec.to_dict(), "seed": spec.seed + k}),
                               progress=False)
            part = _measure(dense, model, test, states, metric=metric, schedule=ITERATIVE, target=target,
                            frac_heads_removed=count_heads(removed) / total)
            out.append(part)
            log.append(dict(round=k + 1, heads_removed=count_heads(removed), ft_loss_first=ft["losses"][0],
                            ft_loss_last=ft["losses"][-1], trainable_params=ft["trainable_params"],
                            test_ppl=math.exp(part.nll.mean())))
    return out, log, removed


def one_shot_finetuned(dense, heads: dict[int, list[int]], metric: str, target: float, ft_windows,
                       spec: FinetuneSpec, test, states) -> pd.DataFrame:
    """The one-shot head set with the iterative loop's total fine-tuning after it (the fair contrast)."""
    ad = get_adapter(dense)
    model = copy.deepcopy(dense)
    with HeadGates(model) as gates:
        gates.close_heads(heads)
        lora_finetune(model, ft_windows, spec, progress=False)
        return _measure(dense, model, test, states, metric=metric, schedule=ONE_SHOT_FT, target=target,
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


# ---------------------------------------------------------------------------------------------- savings
def heads_attention_flops(config, kept: dict[int, int], seq_len: int, past: int = 0) -> float:
    """Attention FLOPs of all layers when layer i keeps kept[i] query heads (KV heads stay unless none is kept)."""
    kv = text_config(config).num_key_value_heads
    return sum(attention_flops(config, seq_len, past, h, kv) if h else 0.0 for h in kept.values())


def bypass_flops(config, alphas: dict[int, float], seq_len: int, past: int = 0) -> float:
    """Attention FLOPs of all layers under a HARP plan: dense layers in full, bypassed ones V and O only (an empty
    plan gives the dense model's attention FLOPs)."""
    total = 0.0
    for i in range(text_config(config).num_hidden_layers):
        if i in alphas:
            total += layer_flops(config, seq_len, alphas[i]) - layer_flops(config, seq_len, 0.0)
        else:
            total += attention_flops(config, seq_len, past)
    return total


def half_heads_bound(config, seq_len: int) -> dict:
    """The background's "50 % of heads → 2× in attention", computed: dense attention FLOPs over those with half the
    query heads of every layer (K and V stay, as GQA requires), at prefill of `seq_len` and one decode step there."""
    cfg = text_config(config)
    h, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    out = {}
    for phase, t, past in (("prefill", seq_len, 0), ("decode", 1, seq_len)):
        out[f"{phase}_attention_flop_ratio"] = (attention_flops(config, t, past)
                                                / attention_flops(config, t, past, h / 2, kv))
    return out


@torch.no_grad()
def _kv_bytes(model, seq_len: int) -> int:
    ids = torch.randint(3, 1000, (1, seq_len), generator=torch.Generator().manual_seed(0))
    out = model(input_ids=ids.to(next(model.parameters()).device), use_cache=True)
    return kv_cache_bytes(out.past_key_values)


def savings_row(dense, model, label: str, frac: float, seq_len: int, repeats: int, dense_kv: int,
                dense_params: int) -> dict:
    """What one really pruned model saves against dense: parameters, KV bytes at `seq_len`, and prefill / decode
    latency there, interleaved with dense (`timing.latency_pair`; `repeats` 0 skips the timing)."""
    lat = latency_pair(dense, model, seq_len, repeats=repeats) if repeats else {}
    kv = _kv_bytes(model, seq_len)
    removed = dense_params - sum(p.numel() for p in model.parameters())
    return dict(config=label, frac_heads_removed=frac, params_removed=removed, kv_bytes=kv, kv_ratio=kv / dense_kv,
                **lat)


def savings_table(dense, heads_sets: dict[str, tuple[float, dict[int, list[int]]]], alphas: dict[int, float],
                  fractions: list[float], test: torch.Tensor, seq_len: int, repeats: int) -> tuple[pd.DataFrame, dict]:
    """Slice each head set off a copy (checked: same logits as the gated model), build HARP at the same heads, and
    measure what each saves. Returns the table and the largest |sliced − gated| logit difference."""
    ad = get_adapter(dense)
    cfg = dense.config
    dense_params = sum(p.numel() for p in dense.parameters())
    dense_kv = _kv_bytes(dense, seq_len)
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
        row = savings_row(dense, model, label, frac, seq_len, repeats, dense_kv, dense_params)
        row |= dict(attn_prefill_flop_ratio=prefill_dense / heads_attention_flops(cfg, kept, seq_len),
                    attn_decode_flop_ratio=decode_dense / heads_attention_flops(cfg, kept, 1, seq_len))
        rows.append(row)
        del model
    for frac in fractions:
        n = max(1, round(frac * ad.n_layers))
        plan = {i: alphas[i] for i in range(ad.n_layers - n, ad.n_layers)}
        model = copy.deepcopy(dense)
        apply_harp(model, sorted(plan), plan)
        row = savings_row(dense, model, f"{HARP_SEARCHED}, top {frac:.0%} of layers", n / ad.n_layers, seq_len,
                          repeats, dense_kv, dense_params)
        row |= dict(attn_prefill_flop_ratio=prefill_dense / bypass_flops(cfg, plan, seq_len),
                    attn_decode_flop_ratio=decode_dense / bypass_flops(cfg, plan, 1, seq_len))
        rows.append(row)
        del model
    return pd.DataFrame(rows), {"max_abs_logit_diff_sliced_vs_gated": worst}


# ---------------------------------------------------------------------------------------------- the study
def _model_part(name: str, spec: dict) -> dict:
    start = time.perf_counter()
    dense, tok = load_model(name, dtype=spec["dtype"], device=spec["device"])
    ad = get_adapter(dense)
    calib = ppl_windows(tok, "enwiki", "train", spec["n_calib"], spec["seq_len"], spec["seed"])
    ft_windows = ppl_windows(tok, "enwiki", "train", spec["n_calib"] + spec["n_ft"], spec["seq_len"],
                             spec["seed"])[spec["n_calib"]:]  # disjoint from the scoring windows
    test = ppl_windows(tok, "enwiki", "test", spec["n_test"], spec["seq_len"], spec["seed"])
    states = reference_states(dense, test)
    seconds = {}

    def lap(what):
        seconds[what] = time.perf_counter() - start - sum(seconds.values())

    raw, pairs = head_scores(dense, calib)
    keep = keep_scores(raw, spec["seed"])
    lap("scores")
    sensitivity = layer_sensitivity(dense, calib, test[: spec["n_sens"]], spec["sensitivity_grid"]).assign(model=name)
    lap("sensitivity")
    windows = one_shot_rows(dense, keep, spec["fractions"], test, states)
    windows.append(_measure(dense, dense, test, states, metric="dense", schedule="dense", target=0.0,
                            frac_heads_removed=0.0))
    lap("one_shot")
    spec_ft = FinetuneSpec(steps=spec["ft_steps"], lr=spec["ft_lr"], seed=spec["seed"])
    rounds = []
    total = ad.n_layers * ad.n_heads
    final_sets = {}
    for metric in spec["iterative_metrics"]:
        parts, log, removed = iterative_rows(dense, metric, spec["target"], spec["step"], calib, ft_windows, spec_ft,
                                             test, states, spec["seed"])
        windows += parts
        rounds += [dict(model=name, metric=metric, **r) for r in log]
        one = choose_heads(keep[metric], ad, count_heads(removed))
        all_steps = FinetuneSpec(**{**spec_ft.to_dict(), "steps": spec_ft.steps * len(log)})
        windows.append(one_shot_finetuned(dense, one, metric, spec["target"], ft_windows, all_steps, test, states))
        final_sets[f"{metric} one-shot, {count_heads(one) / total:.0%} heads"] = (count_heads(one) / total, one)
    lap("iterative")
    top = max(1, round(max(spec["fractions"]) * ad.n_layers))
    alphas = search_alphas(dense, calib, list(range(ad.n_layers - top, ad.n_layers)))
    windows += harp_points(dense, alphas, spec["fractions"], test, states)
    lap("harp")
    for frac in spec["savings_fractions"]:
        heads = choose_heads(keep["taylor"], ad, round(frac * total))
        final_sets.setdefault(f"taylor one-shot, {count_heads(heads) / total:.0%} heads", (count_heads(heads) / total,
                                                                                           heads))
    savings, check = savings_table(dense, final_sets, alphas, spec["savings_fractions"], test, spec["savings_len"],
                                   spec["savings_repeats"])
    lap("savings")
    return {"scores": scores_table(raw, name), "pairs": pairs.assign(model=name), "sensitivity": sensitivity,
            "windows": pd.concat(windows, ignore_index=True).assign(model=name),
            "rounds": pd.DataFrame(rounds), "savings": savings.assign(model=name),
            "bound": dict(model=name, **half_heads_bound(dense.config, spec["savings_len"])),
            "alphas": pd.DataFrame([dict(model=name, layer=i, alpha=a) for i, a in alphas.items()]),
            "check": dict(model=name, **check), "info": model_info(dense),
            "seconds": dict(model=name, seconds=time.perf_counter() - start, **seconds)}


def head_importance_study(models: list[str], n_calib: int, n_ft: int, n_test: int, n_sens: int, seq_len: int,
                          fractions: list[float], target: float, step: float, iterative_metrics: list[str],
                          ft_steps: int, ft_lr: float, sensitivity_grid: list[float], savings_fractions: list[float],
                          savings_len: int, savings_repeats: int, seed: int, dtype: str, device: str) -> dict:
    """Everything notebook 07 shows, for each model; tables concatenated over models. The sensitivity profile uses
    the first `n_sens` test windows (it runs 3 configurations per layer).

    Returns:
        dict: scores (model, metric, layer, head, score), pairs, sensitivity, windows (per test window of every
        pruned configuration: metric, schedule, target, frac_heads_removed, kl, nll), rounds (the iterative log),
        savings, bounds, alphas, checks, infos, seconds.
    """
    fractions = [check_fraction(f) for f in fractions]
    check_fraction(target)
    check_fraction(step, "step fraction")
    for f in savings_fractions:
        check_fraction(f, "savings fraction")
    bad = [m for m in iterative_metrics if m not in HEAD_METRICS]
    if bad:
        raise ValueError(f"unknown metric {bad[0]!r} in ITERATIVE_METRICS; choose from {HEAD_METRICS}")
    if iterative_metrics:
        check_steps(ft_steps)
    if not 1 <= n_sens <= n_test:
        raise ValueError(f"N_SENS (the sensitivity profile's test windows) must be in 1..N_TEST={n_test}, got {n_sens}")
    spec = dict(n_calib=n_calib, n_ft=n_ft, n_test=n_test, n_sens=n_sens, seq_len=seq_len, fractions=fractions,
                target=target, step=step, iterative_metrics=iterative_metrics, ft_steps=ft_steps, ft_lr=ft_lr,
                sensitivity_grid=tuple(sensitivity_grid), savings_fractions=savings_fractions,
                savings_len=savings_len, savings_repeats=savings_repeats, seed=seed, dtype=dtype, device=device)
    parts = [_model_part(name, spec) for name in models]

    def cat(key):
        return pd.concat([p[key] for p in parts], ignore_index=True)
    return {**{k: cat(k) for k in ("scores", "pairs", "sensitivity", "windows", "rounds", "savings", "alphas")},
            "bounds": pd.DataFrame([p["bound"] for p in parts]), "checks": pd.DataFrame([p["check"] for p in parts]),
            "infos": [p["info"] for p in parts], "seconds": pd.DataFrame([p["seconds"] for p in parts])}


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
