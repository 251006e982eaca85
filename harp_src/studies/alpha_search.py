"""Notebook 03: which α does the greedy search pick per layer, and does rescaling beat α = 1, α = 0 and α*?"""

from __future__ import annotations

import functools
import itertools
import time
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import pandas as pd

from ..checkpoints import load_model
from ..data.corpora import calibration_samples, ppl_windows
from ..eval.fidelity import fidelity_windows, reference_states
from ..eval.stats import mean_ci, paired_difference
from ..method.accounting import param_report
from ..method.harp import HarpPlan, harp_applied
from ..method.layers import parse_layers, quarter_depth
from ..method.prefix import Boundaries, ppl_of_plan
from ..method.search import GRID, bootstrap_counts, closed_form_alphas, refine_alphas, resample_search, search_alphas
from ..model.adapter import fingerprint
from ..model.loading import model_info
from ..model.paper import LLAMA31_8B, official_llama31_8b_alphas
from ..report.params import StudyParams

SEARCHED, CLOSED_FORM, REFINED = "HARP, searched α", "HARP, closed-form α*", "HARP, searched + refined α"


@dataclass(frozen=True)
class AlphaSearchParams(StudyParams):
    """Notebook 03's parameters: the search and its evaluation (N_CALIB … REFINE_SWEEPS), and the calibration-size
    study (CAL_*: sizes of the disjoint samples, how many, the bootstrapped sample, resamples, test windows)."""

    NOTEBOOK: ClassVar[str] = "03_alpha_search"
    TYPES: ClassVar[dict] = {"CAL_SIZES": list | dict, "CAL_BOOT": int | dict}
    models: list[str]
    n_calib: int
    n_test: int
    seq_len: int
    n_layers: int
    refine_sweeps: int
    cal_sizes: list | dict
    cal_samples: int
    cal_boot: int | dict
    cal_n_boot: int
    cal_test: int
    cal_boot_plans: int
    seed: int
    dtype: str
    device: str


def _timed(timing: list, name: str, method: str, fn, *args, **kwargs):
    """fn(*args, **kwargs), appending its wall time to `timing` as one row."""
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    timing.append(dict(model=name, method=method, seconds=time.perf_counter() - start))
    return result


def _variants(model, calib, layers, refine_sweeps: int, timed, history: list) -> dict:
    """{variant: {layer: α}} for every way of setting α; `timed(method, fn, *args, **kwargs)` runs and times each
    search, `history` collects the greedy search's candidates."""
    variants = {SEARCHED: timed("greedy search (cached)", search_alphas, model, calib, layers, history=history)}
    variants[CLOSED_FORM] = timed("closed-form α*", closed_form_alphas, model, calib, layers)
    if refine_sweeps:
        variants[REFINED] = timed(f"refine ({refine_sweeps} sweep)", refine_alphas, model, calib, variants[SEARCHED],
                                  sweeps=refine_sweeps)
    fixed = {"HARP, α = 1": dict.fromkeys(layers, 1.0), "attention dropped, α = 0": dict.fromkeys(layers, 0.0)}
    return variants | fixed


def alpha_study(p: AlphaSearchParams) -> dict:
    """Greedy α search on enwiki-train, then enwiki-test PPL of dense vs HARP with searched / α = 1 / α = 0 /
    closed-form (and refined) α, per model. n_layers = 0 means the paper's depth · 8/32.

    Returns:
        dict of tables: curves (model, layer, alpha, calib_ppl), chosen (model, layer, rank_from_top, source,
        alpha), ablation (model, variant, test_ppl, params_removed, ratio_paper), timing, infos.
    """
    curves, chosen, ablation, timing, infos = [], [], [], [], []
    for name in p.models:
        model, tok = load_model(name, dtype=p.dtype, device=p.device)
        L = fingerprint(model.config)["num_layers"]
        layers = parse_layers(f"top:{p.n_layers or quarter_depth(L)}", L)
        calib = ppl_windows(tok, "enwiki", "train", p.n_calib, p.seq_len, p.seed)
        history: list = []
        variants = _variants(model, calib, layers, p.refine_sweeps, functools.partial(_timed, timing, name), history)
        curves += [dict(model=name, **{k: r[k] for k in ("layer", "alpha", "calib_ppl")}) for r in history]
        for source, alphas in variants.items():
            if "α =" not in source:
                chosen += [dict(model=name, layer=i, rank_from_top=L - i, source=source, alpha=a)
                           for i, a in alphas.items()]
        bounds = Boundaries(model, ppl_windows(tok, "enwiki", "test", p.n_test, p.seq_len, p.seed))
        for variant, alphas in {"dense": {}, **variants}.items():
            report = param_report(model.config, HarpPlan(fingerprint(model.config), alphas)) if alphas else {}
            ablation.append(dict(model=name, variant=variant, test_ppl=ppl_of_plan(bounds, alphas),
                                 params_removed=report.get("params_removed", 0),
                                 ratio_paper=report.get("ratio_paper", 0.0)))
        infos.append(model_info(model))
        del model, bounds
    depth = LLAMA31_8B["num_hidden_layers"]
    chosen += [dict(model="Llama-3.1-8B (official code)", layer=i, rank_from_top=depth - i, source="official list",
                    alpha=a) for i, a in official_llama31_8b_alphas().items()]
    return {"curves": pd.DataFrame(curves), "chosen": pd.DataFrame(chosen), "ablation": pd.DataFrame(ablation),
            "timing": pd.DataFrame(timing), "infos": infos}


def summarise_alpha(tables: dict) -> dict:
    """Headline numbers: test PPL per variant and model, and the searched α's (top layer first)."""
    out = {}
    for row in tables["ablation"].itertuples():
        out[f"{row.model}/test_ppl/{row.variant}"] = float(row.test_ppl)
    searched = tables["chosen"][tables["chosen"].source == SEARCHED]
    for name, part in searched.groupby("model"):
        out[f"{name}/searched_alphas_top_first"] = [float(a) for a in part.sort_values("rank_from_top").alpha]
    for row in tables["timing"].itertuples():
        out[f"{row.model}/seconds/{row.method}"] = float(row.seconds)
    return out


# ------------------------------------------------------------------------------------------ calibration size
SEARCH, STAR, REPLICATE = "greedy search", "closed-form α*", "greedy search, bootstrap replicate"
BOOT_BAND = "greedy search, bootstrap 5–95 %"
QUALITY_BATCH = 2  # test windows per forward when measuring a plan's KL to dense


def per_model(value, name: str):
    """`value[name]` when a profile gives one value per model, else `value` itself."""
    return value[name] if isinstance(value, dict) else value


def _plan_windows(model, ref_states, test, alphas: dict[int, float]) -> pd.DataFrame:
    """Per test window: KL to dense and NLL of the model with `alphas` applied. `model` stays the reference: its
    dense final states were computed beforehand (`ref_states`) and the LM head is the same module either way."""
    with harp_applied(model, list(alphas), alphas):
        return fidelity_windows(model, model, test, batch_size=QUALITY_BATCH, ref_states=ref_states, progress=False)


def _plan_rows(per_window: pd.DataFrame, alphas: dict[int, float], L: int, **keys) -> list[dict]:
    """One row per layer of a plan, with the plan's test PPL and mean KL to dense (and its interval over windows)."""
    kl, low, high = mean_ci(per_window.kl.to_numpy())
    quality = dict(test_ppl=float(np.exp(per_window.nll.mean())), kl_to_dense=kl, kl_low=low, kl_high=high)
    return [dict(**keys, layer=i, rank_from_top=L - i, alpha=a, **quality) for i, a in sorted(alphas.items())]


def _spread(plans: pd.DataFrame, boot: pd.DataFrame, source: dict[str, dict[int, float]], step: float
            ) -> pd.DataFrame:
    """Per size, method and layer: how far the α's of disjoint samples (or bootstrap resamples) lie apart.

    within_step: share of samples (resamples) whose α is within one grid step of the same method's α on the
    largest sample (the bootstrap source)."""
    rows = []
    real = plans[plans.method.isin([SEARCH, STAR])]
    for (tokens, method, layer), part in real.groupby(["calib_tokens", "method", "layer"]):
        a = part.alpha.to_numpy()
        rows.append(dict(calib_tokens=tokens, method=method, layer=layer, n=len(a), alpha_min=a.min(),
                         alpha_max=a.max(), spread=a.max() - a.min(), std=a.std(ddof=1) if len(a) > 1 else 0.0,
                         within_step=float(np.mean(np.abs(a - source[method][layer]) <= step + 1e-9))))
    for (tokens, layer), part in boot.groupby(["calib_tokens", "layer"]):
        a = part.alpha.to_numpy()
        q05, q95 = np.quantile(a, [0.05, 0.95])
        rows.append(dict(calib_tokens=tokens, method=BOOT_BAND, layer=layer, n=len(a), alpha_min=q05, alpha_max=q95,
                         spread=q95 - q05, std=a.std(ddof=1),
                         within_step=float(np.mean(np.abs(a - source[SEARCH][layer]) <= step + 1e-9))))
    return pd.DataFrame(rows)


def _agreement(plans: pd.DataFrame, boot: pd.DataFrame) -> pd.DataFrame:
    """Bootstrap vs real resampling at each size that has both: per layer, the real searches' α's against the
    bootstrap's 5–95 % range and standard deviation."""
    rows = []
    real = plans[plans.method == SEARCH]
    for (tokens, layer), part in real.groupby(["calib_tokens", "layer"]):
        b = boot[(boot.calib_tokens == tokens) & (boot.layer == layer)].alpha.to_numpy()
        if len(b) == 0 or len(part) < 2:
            continue
        q05, q95 = np.quantile(b, [0.05, 0.95])
        a = part.alpha.to_numpy()
        rows.append(dict(calib_tokens=tokens, layer=layer, real_alphas=" ".join(f"{x:g}" for x in a),
                         real_std=a.std(ddof=1), boot_std=b.std(ddof=1), boot_q05=q05, boot_q95=q95,
                         real_inside=int(((a >= q05 - 1e-9) & (a <= q95 + 1e-9)).sum()), n_real=len(a)))
    return pd.DataFrame(rows)


def _moves(windows: pd.DataFrame) -> pd.DataFrame:
    """Does test quality still depend on the calibration sample? Per size and method, the paired difference in
    KL to dense (same test windows) between every two disjoint samples' plans."""
    rows = []
    for (tokens, method), part in windows.groupby(["calib_tokens", "method"]):
        by_sample = {s: g.sort_values("window").kl.to_numpy() for s, g in part.groupby("sample")}
        for a, b in itertools.combinations(sorted(by_sample), 2):
            rows.append(dict(calib_tokens=tokens, method=method, sample_a=a, sample_b=b,
                             **paired_difference(by_sample[a], by_sample[b])))
    return pd.DataFrame(rows)


def _model_calibration(name: str, p: AlphaSearchParams, every_size: list[int]) -> dict:
    """The calibration-size study of one model (see `calibration_study`); `every_size`: all models' sample sizes,
    at which the bootstrap also resamples."""
    model, tok = load_model(name, dtype=p.dtype, device=p.device)
    L = fingerprint(model.config)["num_layers"]
    layers = parse_layers(f"top:{p.n_layers or quarter_depth(L)}", L)
    sizes, boot_n, seq_len = list(per_model(p.cal_sizes, name)), int(per_model(p.cal_boot, name)), p.seq_len
    samples, source_sample = calibration_samples(tok, p.cal_samples, sizes, seq_len, p.seed, extra=boot_n)
    runs = [(n, f"s{k + 1}", calib) for n in sorted(samples) for k, calib in enumerate(samples[n])]
    runs.append((boot_n, "bootstrap source", source_sample))  # disjoint from every sample above
    test = ppl_windows(tok, "enwiki", "test", p.cal_test, seq_len, p.seed)
    ref = reference_states(model, test, QUALITY_BATCH)
    plans, windows, timing, record = [], [], [], {}

    def evaluate(alphas, **keys):
        per_window = _plan_windows(model, ref, test, alphas).assign(model=name, **keys)
        windows.append(per_window)
        plans.extend(_plan_rows(per_window, alphas, L, model=name, **keys))

    for n, sample, calib in runs:
        record = {}
        start = time.perf_counter()
        found = {SEARCH: search_alphas(model, calib, layers, window_nll=record)}
        timing.append(dict(model=name, calib_tokens=n * seq_len, method=SEARCH, seconds=time.perf_counter() - start))
        start = time.perf_counter()
        found[STAR] = closed_form_alphas(model, calib, layers)
        timing.append(dict(model=name, calib_tokens=n * seq_len, method=STAR, seconds=time.perf_counter() - start))
        for method, alphas in found.items():
            evaluate(alphas, calib_tokens=n * seq_len, sample=sample, method=method)
    source = found  # the last run: the bootstrap source, the largest sample; `record` is its search
    boot = []
    for n in sorted({n for n in every_size if n < boot_n} | {boot_n}):
        counts = bootstrap_counts(boot_n, n, p.cal_n_boot, p.seed + n)
        boot.append(resample_search(record, counts, GRID).assign(calib_tokens=n * seq_len))
    boot = pd.concat(boot, ignore_index=True).assign(model=name)
    boot["rank_from_top"] = L - boot.layer
    largest = boot[boot.calib_tokens == boot_n * seq_len]
    for r in range(p.cal_boot_plans):
        part = largest[largest.replicate == r]
        evaluate(dict(zip(part.layer, part.alpha, strict=True)), calib_tokens=boot_n * seq_len,
                 sample=f"resample {r + 1}", method=REPLICATE)
    plans = pd.DataFrame(plans)
    dense_ppl = float(np.exp(pd.concat(windows).drop_duplicates("window").nll_reference.mean()))
    spread = _spread(plans, boot, source, step=GRID[1] - GRID[0]).assign(model=name)
    agreement = _agreement(plans, boot).assign(model=name)
    windows = pd.concat(windows, ignore_index=True)
    info = model_info(model)
    return {"plans": plans, "windows": windows, "bootstrap": boot, "spread": spread, "agreement": agreement,
            "moves": _moves(windows[windows.method != REPLICATE]).assign(model=name), "timing": pd.DataFrame(timing),
            "dense": pd.DataFrame([dict(model=name, test_ppl=dense_ppl, layers=" ".join(map(str, layers)))]),
            "infos": [info]}


def calibration_study(p: AlphaSearchParams) -> dict:
    """How many calibration tokens does the α search need? Per model, on the top-N layers (N = 0: depth · 8/32):

    - greedy search and closed-form α* on CAL_SAMPLES disjoint enwiki-train samples of each size in CAL_SIZES
      (windows of SEQ_LEN tokens; a list, or one list per model);
    - one more disjoint sample of CAL_BOOT windows, searched once with per-window NLLs recorded and then
      bootstrapped (CAL_N_BOOT resamples) at its own size and at every size of any model's CAL_SIZES below it
      (`resample_search`; validated against the real samples);
    - every plan's test PPL and KL to dense on CAL_TEST enwiki-test windows, and CAL_BOOT_PLANS bootstrap plans.

    Returns:
        dict of tables: plans (model, calib_tokens, sample, method, layer, alpha, test_ppl, kl_to_dense, …),
        windows (per test window and plan), bootstrap (replicate, layer, alpha per size), spread, agreement,
        moves (paired KL differences between samples), timing, dense, infos.
    """
    tables: dict[str, list] = {}
    every_size = sorted({int(n) for name in p.models for n in per_model(p.cal_sizes, name)})
    for name in p.models:
        for key, value in _model_calibration(name, p, every_size).items():
            tables.setdefault(key, []).append(value)
    infos = [i for part in tables.pop("infos") for i in part]
    return {k: pd.concat(v, ignore_index=True) for k, v in tables.items()} | {"infos": infos}


def calibration_table(tables: dict) -> pd.DataFrame:
    """What `report.plots.alpha_spread` draws: every plan's α per layer (with the plan's test PPL and KL to dense), and
    per size and layer the bootstrap's median α with its 5–95 % range (alpha_low, alpha_high)."""
    boot = tables["bootstrap"]
    bands = (boot.groupby(["model", "calib_tokens", "layer", "rank_from_top"]).alpha
             .agg(alpha="median", alpha_low=lambda a: a.quantile(0.05), alpha_high=lambda a: a.quantile(0.95))
             .reset_index().assign(sample="bootstrap", method=BOOT_BAND))
    return pd.concat([tables["plans"], bands], ignore_index=True)


def plan_table(tables: dict) -> pd.DataFrame:
    """One row per plan: model, calib_tokens, sample, method, test_ppl, kl_to_dense and its interval, α's."""
    plans = tables["plans"]
    keys = ["model", "calib_tokens", "sample", "method"]
    first = plans.groupby(keys, sort=False)[["test_ppl", "kl_to_dense", "kl_low", "kl_high"]].first()
    alphas = plans.sort_values("rank_from_top").groupby(keys, sort=False).alpha.agg(
        lambda a: " ".join(f"{x:.2f}" for x in a)).rename("alphas_top_first")
    return first.join(alphas).reset_index()


def summarise_calibration(tables: dict) -> dict:
    """Headline numbers per model and calibration size: how far α's of disjoint samples (and of bootstrap
    resamples) lie apart, the test PPL range over samples, and how many sample-vs-sample differences in KL to dense
    are decided."""
    out = {}
    spread, plans = tables["spread"], plan_table(tables)
    for (name, tokens, method), part in spread.groupby(["model", "calib_tokens", "method"]):
        if part.n.iloc[0] > 1:
            out[f"{name}/calibration/{tokens}/{method}/max_spread"] = float(part.spread.max())
            out[f"{name}/calibration/{tokens}/{method}/min_within_step"] = float(part.within_step.min())
    for (name, tokens, method), part in plans.groupby(["model", "calib_tokens", "method"]):
        out[f"{name}/calibration/{tokens}/{method}/test_ppl_range"] = [float(part.test_ppl.min()),
                                                                       float(part.test_ppl.max())]
    for (name, tokens, method), part in tables["moves"].groupby(["model", "calib_tokens", "method"]):
        out[f"{name}/calibration/{tokens}/{method}/kl_pairs_decided"] = f"{int(part.decided.sum())} of {len(part)}"
    for name, part in tables["agreement"].groupby("model"):
        out[f"{name}/calibration/bootstrap_covers_real"] = f"{int(part.real_inside.sum())} of {int(part.n_real.sum())}"
    for (name, tokens, method), part in tables["timing"].groupby(["model", "calib_tokens", "method"]):
        out[f"{name}/calibration/{tokens}/{method}/seconds"] = float(part.seconds.median())
    return out
