"""Notebook 03: which α does the greedy search pick per layer, and does rescaling beat α = 1, α = 0 and α*?"""

from __future__ import annotations

import functools
import itertools
import time
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import pandas as pd
import torch

from ..compare.points import ModelSteps
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
from ..report.params import OneWindowLength, StudyParams
from ..steps import context
from ..steps.executors import Outcome, run_steps
from ..steps.graph import Graph

SEARCHED, CLOSED_FORM, REFINED = "HARP, searched α", "HARP, closed-form α*", "HARP, searched + refined α"


@dataclass(frozen=True)
class AlphaSearchParams(OneWindowLength, StudyParams):
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


def variants_step(key: dict, inputs: dict) -> dict:
    """Every way of setting α of key's layers on the setup's calibration windows, each search timed: variants
    ({variant: {layer: α}}), history (the greedy search's candidates) and timing rows."""
    setup = key["setup"]
    model, calib = context.dense(setup)[0], context.windows(setup, "train")
    timing, history = [], []
    variants = _variants(model, calib, key["layers"], key["refine_sweeps"],
                         functools.partial(_timed, timing, setup["model"]), history)
    return {"variants": variants, "history": history, "timing": timing}


def ablation_step(key: dict, inputs: dict) -> dict:
    """Test perplexity of dense and of every variant's plan on the setup's test windows, with the parameters each
    plan removes: ablation rows and the model's provenance."""
    setup = key["setup"]
    model = context.dense(setup)[0]
    bounds = Boundaries(model, context.windows(setup, "test"))
    rows = []
    for variant, alphas in {"dense": {}, **inputs["search"]["variants"]}.items():
        report = param_report(model.config, HarpPlan(fingerprint(model.config), alphas)) if alphas else {}
        rows.append(dict(model=setup["model"], variant=variant, test_ppl=ppl_of_plan(bounds, alphas),
                         params_removed=report.get("params_removed", 0), ratio_paper=report.get("ratio_paper", 0.0)))
    return {"ablation": rows, "info": model_info(model)}


def _declare_variants(graph: Graph, p: AlphaSearchParams, name: str) -> dict:
    ms = ModelSteps.open(graph, p, name)
    layers = parse_layers(f"top:{p.n_layers or quarter_depth(ms.num_layers)}", ms.num_layers)
    search = ms.add(variants_step, {"layers": layers, "refine_sweeps": p.refine_sweeps}, label="α variants",
                    size=len(layers) * p.n_calib * p.seq_len / 256 * (2 + p.refine_sweeps))
    ablation = ms.add(ablation_step, {}, {"search": search}, "α ablation", size=p.n_test * p.seq_len / 256)
    return {"name": name, "num_layers": ms.num_layers, "search": search, "ablation": ablation}


def _alpha_tables(ids: dict, out: Outcome) -> dict:
    name, L = ids["name"], ids["num_layers"]
    search, ablation = out.results[ids["search"]], out.results[ids["ablation"]]
    curves = [dict(model=name, **{k: r[k] for k in ("layer", "alpha", "calib_ppl")}) for r in search["history"]]
    chosen = [dict(model=name, layer=i, rank_from_top=L - i, source=source, alpha=a)
              for source, alphas in search["variants"].items() if "α =" not in source for i, a in alphas.items()]
    return {"curves": curves, "chosen": chosen, "ablation": ablation["ablation"], "timing": search["timing"],
            "info": ablation["info"]}


def alpha_study(p: AlphaSearchParams) -> dict:
    """Greedy α search on enwiki-train, then enwiki-test PPL of dense vs HARP with searched / α = 1 / α = 0 /
    closed-form (and refined) α, per model. n_layers = 0 means the paper's depth · 8/32. Two stored steps per model
    (the searches, the ablation), run inline where the runner has not run them already.

    Returns:
        dict of tables: curves (model, layer, alpha, calib_ppl), chosen (model, layer, rank_from_top, source,
        alpha), ablation (model, variant, test_ppl, params_removed, ratio_paper), timing, infos.
    """
    graph = Graph()
    models = [_declare_variants(graph, p, name) for name in p.models]
    out = run_steps(graph, reuse=False)
    parts = [_alpha_tables(ids, out) for ids in models]
    chosen = [r for part in parts for r in part["chosen"]]
    depth = LLAMA31_8B["num_hidden_layers"]
    chosen += [dict(model="Llama-3.1-8B (official code)", layer=i, rank_from_top=depth - i, source="official list",
                    alpha=a) for i, a in official_llama31_8b_alphas().items()]
    return {**{k: pd.DataFrame([r for part in parts for r in part[k]]) for k in ("curves", "ablation", "timing")},
            "chosen": pd.DataFrame(chosen), "infos": [part["info"] for part in parts]}


def alpha_graph(p: AlphaSearchParams) -> tuple[Graph, list[dict]]:
    """Notebook 03's steps, both studies' (for the runner): each model's searches and ablation, then its
    calibration-size runs and bootstrap."""
    graph = Graph()
    every_size = _every_size(p)
    return graph, [_declare_variants(graph, p, name) | {"calibration": _declare_calibration(graph, p, name,
                                                                                             every_size)}
                   for name in p.models]


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


def _test_reference(model, tok, p_test: int, seq_len: int, seed: int) -> tuple[torch.Tensor, list]:
    """The calibration study's enwiki-test windows and the dense final states on them."""
    test = ppl_windows(tok, "enwiki", "test", p_test, seq_len, seed)
    return test, reference_states(model, test, QUALITY_BATCH)


def _evaluated(model, ref, test, alphas: dict[int, float], L: int, name: str, **keys) -> tuple[pd.DataFrame, list]:
    """(per test window, per layer rows) of one plan: see `_plan_windows` and `_plan_rows`."""
    per_window = _plan_windows(model, ref, test, alphas).assign(model=name, **keys)
    return per_window, _plan_rows(per_window, alphas, L, model=name, **keys)


def calibration_run_step(key: dict, inputs: dict) -> dict:
    """One calibration sample (sample `index` of size `n`, or the bootstrap source with index None) searched greedily
    and in closed form, each plan measured on the test windows: found ({method: {layer: α}}), timing, windows, plans,
    and for the bootstrap source the search's per-window NLLs (record)."""
    setup = key["setup"]
    model, tok = context.dense(setup)
    name, seq_len, n, index = setup["model"], setup["calib_len"], key["n"], key["index"]
    samples, source = calibration_samples(tok, key["cal_samples"], key["sizes"], seq_len, setup["seed"],
                                          extra=key["boot_n"])
    calib = source if index is None else samples[n][index]
    sample = "bootstrap source" if index is None else f"s{index + 1}"
    L, layers = fingerprint(model.config)["num_layers"], key["layers"]
    test, ref = _test_reference(model, tok, key["cal_test"], seq_len, setup["seed"])
    record, timing, windows, plans = {}, [], [], []
    start = time.perf_counter()
    found = {SEARCH: search_alphas(model, calib, layers, window_nll=record)}
    timing.append(dict(model=name, calib_tokens=n * seq_len, method=SEARCH, seconds=time.perf_counter() - start))
    start = time.perf_counter()
    found[STAR] = closed_form_alphas(model, calib, layers)
    timing.append(dict(model=name, calib_tokens=n * seq_len, method=STAR, seconds=time.perf_counter() - start))
    for method, alphas in found.items():
        per_window, rows = _evaluated(model, ref, test, alphas, L, name, calib_tokens=n * seq_len, sample=sample,
                                      method=method)
        windows.append(per_window)
        plans += rows
    return {"found": found, "timing": timing, "windows": windows, "plans": plans,
            "record": record if index is None else None}


def bootstrap_step(key: dict, inputs: dict) -> dict:
    """The bootstrap source's search resampled at its own size and every smaller size of any model (`resample_search`
    on its per-window NLLs), and the first CAL_BOOT_PLANS replicates at its size measured on the test windows."""
    setup = key["setup"]
    model, tok = context.dense(setup)
    name, seq_len, boot_n = setup["model"], setup["calib_len"], key["boot_n"]
    L = fingerprint(model.config)["num_layers"]
    boot = []
    for n in sorted({n for n in key["every_size"] if n < boot_n} | {boot_n}):
        counts = bootstrap_counts(boot_n, n, key["cal_n_boot"], setup["seed"] + n)
        boot.append(resample_search(inputs["source"]["record"], counts, GRID).assign(calib_tokens=n * seq_len))
    boot = pd.concat(boot, ignore_index=True).assign(model=name)
    boot["rank_from_top"] = L - boot.layer
    largest = boot[boot.calib_tokens == boot_n * seq_len]
    test, ref = _test_reference(model, tok, key["cal_test"], seq_len, setup["seed"]) if key["plans"] else (None, None)
    windows, plans = [], []
    for r in range(key["plans"]):
        part = largest[largest.replicate == r]
        per_window, rows = _evaluated(model, ref, test, dict(zip(part.layer, part.alpha, strict=True)), L, name,
                                      calib_tokens=boot_n * seq_len, sample=f"resample {r + 1}", method=REPLICATE)
        windows.append(per_window)
        plans += rows
    return {"boot": boot, "windows": windows, "plans": plans, "info": model_info(model)}


def _every_size(p: AlphaSearchParams) -> list[int]:
    """All models' sample sizes: the bootstrap of each model also resamples at these."""
    return sorted({int(n) for name in p.models for n in per_model(p.cal_sizes, name)})


def _declare_calibration(graph: Graph, p: AlphaSearchParams, name: str, every_size: list[int]) -> dict:
    """One model's calibration-size steps: a step per sample (and the bootstrap source), then the bootstrap."""
    ms = ModelSteps.open(graph, p, name)
    layers = parse_layers(f"top:{p.n_layers or quarter_depth(ms.num_layers)}", ms.num_layers)
    sizes, boot_n = [int(n) for n in per_model(p.cal_sizes, name)], int(per_model(p.cal_boot, name))
    common = {"layers": layers, "sizes": sizes, "cal_samples": p.cal_samples, "boot_n": boot_n,
              "cal_test": p.cal_test}
    runs = [(n, k) for n in sorted(set(sizes)) for k in range(p.cal_samples)] + [(boot_n, None)]
    ids = [ms.add(calibration_run_step, common | {"n": n, "index": k},
                  label=f"calibration {n * p.seq_len} tokens {'source' if k is None else f's{k + 1}'}",
                  size=len(layers) * n * p.seq_len / 256 + 2 * p.cal_test * p.seq_len / 256) for n, k in runs]
    boot = ms.add(bootstrap_step, common | {"every_size": every_size, "cal_n_boot": p.cal_n_boot,
                                            "plans": p.cal_boot_plans}, {"source": ids[-1]}, "bootstrap",
                  size=p.cal_boot_plans * p.cal_test * p.seq_len / 256 + p.cal_n_boot / 1000)
    return {"runs": ids, "boot": boot, "layers": layers}


def _calibration_tables(name: str, ids: dict, out: Outcome, step: float) -> dict:
    runs = [out.results[i] for i in ids["runs"]]
    boot = out.results[ids["boot"]]
    windows = [w for r in runs for w in r["windows"]] + boot["windows"]
    plans = pd.DataFrame([row for r in runs for row in r["plans"]] + boot["plans"])
    dense_ppl = float(np.exp(pd.concat(windows).drop_duplicates("window").nll_reference.mean()))
    spread = _spread(plans, boot["boot"], runs[-1]["found"], step=step).assign(model=name)
    agreement = _agreement(plans, boot["boot"]).assign(model=name)
    windows = pd.concat(windows, ignore_index=True)
    layers = " ".join(map(str, ids["layers"]))
    return {"plans": plans, "windows": windows, "bootstrap": boot["boot"], "spread": spread, "agreement": agreement,
            "moves": _moves(windows[windows.method != REPLICATE]).assign(model=name),
            "timing": pd.DataFrame([t for r in runs for t in r["timing"]]),
            "dense": pd.DataFrame([dict(model=name, test_ppl=dense_ppl, layers=layers)]), "infos": [boot["info"]]}


def calibration_study(p: AlphaSearchParams) -> dict:
    """How many calibration tokens does the α search need? Per model, on the top-N layers (N = 0: depth · 8/32):

    - greedy search and closed-form α* on CAL_SAMPLES disjoint enwiki-train samples of each size in CAL_SIZES
      (windows of SEQ_LEN tokens; a list, or one list per model);
    - one more disjoint sample of CAL_BOOT windows, searched once with per-window NLLs recorded and then
      bootstrapped (CAL_N_BOOT resamples) at its own size and at every size of any model's CAL_SIZES below it
      (`resample_search`; validated against the real samples);
    - every plan's test PPL and KL to dense on CAL_TEST enwiki-test windows, and CAL_BOOT_PLANS bootstrap plans.

    A stored step per sample and one for the bootstrap, run inline where the runner has not run them already.

    Returns:
        dict of tables: plans (model, calib_tokens, sample, method, layer, alpha, test_ppl, kl_to_dense, …),
        windows (per test window and plan), bootstrap (replicate, layer, alpha per size), spread, agreement,
        moves (paired KL differences between samples), timing, dense, infos.
    """
    graph, every_size = Graph(), _every_size(p)
    models = [(name, _declare_calibration(graph, p, name, every_size)) for name in p.models]
    out = run_steps(graph, reuse=False)
    tables: dict[str, list] = {}
    for name, ids in models:
        for key, value in _calibration_tables(name, ids, out, GRID[1] - GRID[0]).items():
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
