"""The notebooks' multi-model experiments: each returns a tidy table that a plot function takes."""

from __future__ import annotations

import math

import pandas as pd
from tqdm.auto import tqdm

from .data import ppl_windows
from .harp import HarpPlan, param_report, parse_layers
from .models import fingerprint, load_model, model_info
from .prefix import Boundaries, nll_of_plan


def n_values(n_layers: int, n_max_frac: float = 0.5, count: int = 8) -> list[int]:
    """About `count` values of N from 1 to n_layers · n_max_frac, always with 1, the maximum and the paper's
    N = depth · 8/32."""
    top = max(1, round(n_layers * n_max_frac))
    values = {max(1, round(1 + k * (top - 1) / max(count - 1, 1))) for k in range(count)}
    return sorted(values | {min(quarter_depth(n_layers), top)})


def removal_sweep(model, windows, name: str, selections=("top", "bottom"), alphas=(1.0, 0.0),
                  n_max_frac: float = 0.5, batch_size: int = 4) -> pd.DataFrame:
    """Test PPL for N pruned layers chosen top-N or bottom-N, for each fixed α; N = 0 is the dense model.

    Returns:
        DataFrame: model, selection, n_layers, alpha, ppl, params_removed, ratio_paper, ratio_model, kv_cache_cut
    """
    bounds = Boundaries(model, windows, batch_size)
    L = bounds.ad.n_layers
    nll, count = bounds.nll_from(0)
    rows = [dict(model=name, selection=s, n_layers=0, alpha=a, ppl=math.exp(nll / count), params_removed=0,
                 ratio_paper=0.0, ratio_model=0.0, kv_cache_cut=0.0) for s in selections for a in alphas]
    todo = [(s, n, a) for s in selections for n in n_values(L, n_max_frac) for a in alphas]
    for sel, n, alpha in tqdm(todo, desc=f"removal sweep {name}"):
        layers = parse_layers(f"{sel}:{n}", L)
        nll, count = nll_of_plan(bounds, layers, alpha)
        report = param_report(model.config, HarpPlan(fingerprint(model.config), dict.fromkeys(layers, alpha)))
        rows.append(dict(model=name, selection=sel, n_layers=n, alpha=alpha, ppl=math.exp(nll / count),
                         **{k: report[k] for k in ("params_removed", "ratio_paper", "ratio_model", "kv_cache_cut")}))
    return pd.DataFrame(rows).assign(n_layers_total=L)


def removal_study(models: list[str], n_windows: int, seq_len: int, seed: int, dtype: str, device: str,
                  n_max_frac: float = 0.5) -> tuple[pd.DataFrame, list[dict]]:
    """removal_sweep for each model on its enwiki-test windows; also returns each model's provenance."""
    tables, infos = [], []
    for name in models:
        model, tok = load_model(name, dtype=dtype, device=device)
        windows = ppl_windows(tok, "enwiki", "test", n_windows, seq_len, seed)
        tables.append(removal_sweep(model, windows, name, n_max_frac=n_max_frac))
        infos.append(model_info(model))
    return pd.concat(tables, ignore_index=True), infos


def savings_table(models: list[str], n_max_frac: float = 0.5) -> pd.DataFrame:
    """Parameter and KV-cache savings of top-N HARP (α = 1 and α = 0) from each model's config alone."""
    from transformers import AutoConfig

    from .models import resolve_source

    rows = []
    for name in models:
        config = AutoConfig.from_pretrained(resolve_source(name)[0])
        L = fingerprint(config)["num_layers"]
        for n in n_values(L, n_max_frac):
            for alpha in (1.0, 0.0):
                layers = parse_layers(f"top:{n}", L)
                r = param_report(config, HarpPlan(fingerprint(config), dict.fromkeys(layers, alpha)))
                for metric, key in [("parameters removed, paper convention", "ratio_paper"),
                                    ("parameters removed, whole model", "ratio_model"),
                                    ("KV cache removed", "kv_cache_cut")]:
                    rows.append(dict(model=name, n_layers=n, alpha=alpha, metric=metric, value=100 * r[key]))
    return pd.DataFrame(rows)


def quarter_depth(n_layers: int) -> int:
    """The paper's N = 8 of 32 layers, scaled to this depth."""
    return max(1, round(n_layers * 8 / 32))


def side_by_side(models: list[str], prompt: str, dtype: str, device: str, max_new_tokens: int = 30) -> pd.DataFrame:
    """Greedy text of each dense model and of its top-N (N = depth/4) HARP versions with α = 1 and α = 0."""
    from .evaluate import greedy_text
    from .harp import apply_harp

    rows = []
    for name in models:
        for alpha in (None, 1.0, 0.0):
            model, tok = load_model(name, dtype=dtype, device=device)
            n = quarter_depth(fingerprint(model.config)["num_layers"])
            if alpha is not None:
                apply_harp(model, f"top:{n}", alpha)
            label = "dense" if alpha is None else f"top-{n}, α = {alpha}"
            rows.append(dict(model=name, variant=label, text=greedy_text(model, tok, prompt, max_new_tokens)))
    return pd.DataFrame(rows)


def summarise_removal(df: pd.DataFrame) -> dict:
    """Headline numbers: dense PPL and PPL at N = depth/4 for top/bottom × α = 1/0, per model."""
    out = {}
    for name, part in df.groupby("model"):
        out[f"{name}/dense_ppl"] = float(part[part.n_layers == 0].ppl.iloc[0])
        n = min(quarter_depth(int(part.n_layers_total.iloc[0])), int(part.n_layers.max()))
        for (sel, alpha), rows in part[part.n_layers == n].groupby(["selection", "alpha"]):
            out[f"{name}/ppl_{sel}{n}_alpha{alpha:g}"] = float(rows.ppl.iloc[0])
        out[f"{name}/ratio_paper_top{n}_alpha1"] = float(
            part[(part.n_layers == n) & (part.selection == "top") & (part.alpha == 1.0)].ratio_paper.iloc[0])
    return out


# official code's Llama-3.1-8B top-8 list, top layer first (DESIGN.md §5)
OFFICIAL_LLAMA31_8B_TOP_FIRST = (0.8, 0.2, 0.1, 0.1, 0.0, 0.1, 0.0, 0.0)


def _test_ppl(bounds: Boundaries, alphas: dict[int, float]) -> float:
    nll, count = nll_of_plan(bounds, sorted(alphas), alphas) if alphas else bounds.nll_from(0)
    return math.exp(nll / count)


def alpha_study(models: list[str], n_calib: int, n_test: int, seq_len: int, seed: int, dtype: str, device: str,
                n_layers: int = 0, refine_sweeps: int = 0) -> dict:
    """Greedy α search on enwiki-train, then enwiki-test PPL of dense vs HARP with searched / α = 1 / α = 0 /
    closed-form (and refined) α, per model. n_layers = 0 means the paper's depth · 8/32.

    Returns:
        dict of tables: curves (model, layer, alpha, calib_ppl), chosen (model, layer, rank_from_top, source,
        alpha), ablation (model, variant, test_ppl, params_removed, ratio_paper), timing, infos.
    """
    import time

    from .search import closed_form_alphas, refine_alphas, search_alphas

    curves, chosen, ablation, timing, infos = [], [], [], [], []
    for name in models:
        model, tok = load_model(name, dtype=dtype, device=device)
        L = fingerprint(model.config)["num_layers"]
        layers = parse_layers(f"top:{n_layers or quarter_depth(L)}", L)
        calib = ppl_windows(tok, "enwiki", "train", n_calib, seq_len, seed)
        history: list = []
        start = time.perf_counter()
        variants = {"HARP, searched α": search_alphas(model, calib, layers, history=history)}
        timing.append(dict(model=name, method="greedy search (cached)", seconds=time.perf_counter() - start))
        start = time.perf_counter()
        variants["HARP, closed-form α*"] = closed_form_alphas(model, calib, layers)
        timing.append(dict(model=name, method="closed-form α*", seconds=time.perf_counter() - start))
        if refine_sweeps:
            start = time.perf_counter()
            variants["HARP, searched + refined α"] = refine_alphas(model, calib, variants["HARP, searched α"],
                                                                 sweeps=refine_sweeps)
            timing.append(dict(model=name, method=f"refine ({refine_sweeps} sweep)",
                               seconds=time.perf_counter() - start))
        variants |= {"HARP, α = 1": dict.fromkeys(layers, 1.0), "attention dropped, α = 0": dict.fromkeys(layers, 0.0)}
        curves += [dict(model=name, **{k: r[k] for k in ("layer", "alpha", "calib_ppl")}) for r in history]
        for source, alphas in variants.items():
            if "α =" not in source:
                chosen += [dict(model=name, layer=i, rank_from_top=L - i, source=source, alpha=a)
                           for i, a in alphas.items()]
        bounds = Boundaries(model, ppl_windows(tok, "enwiki", "test", n_test, seq_len, seed))
        for variant, alphas in {"dense": {}, **variants}.items():
            report = param_report(model.config, HarpPlan(fingerprint(model.config), alphas)) if alphas else {}
            ablation.append(dict(model=name, variant=variant, test_ppl=_test_ppl(bounds, alphas),
                                 params_removed=report.get("params_removed", 0),
                                 ratio_paper=report.get("ratio_paper", 0.0)))
        infos.append(model_info(model))
        del model, bounds
    chosen += [dict(model="Llama-3.1-8B (official code)", layer=31 - k, rank_from_top=k + 1, source="official list",
                    alpha=a) for k, a in enumerate(OFFICIAL_LLAMA31_8B_TOP_FIRST)]
    return {"curves": pd.DataFrame(curves), "chosen": pd.DataFrame(chosen), "ablation": pd.DataFrame(ablation),
            "timing": pd.DataFrame(timing), "infos": infos}


def summarise_alpha(tables: dict) -> dict:
    """Headline numbers: test PPL per variant and model, and the searched α's (top layer first)."""
    out = {}
    for row in tables["ablation"].itertuples():
        out[f"{row.model}/test_ppl/{row.variant}"] = float(row.test_ppl)
    searched = tables["chosen"][tables["chosen"].source == "HARP, searched α"]
    for name, part in searched.groupby("model"):
        out[f"{name}/searched_alphas_top_first"] = [float(a) for a in part.sort_values("rank_from_top").alpha]
    for row in tables["timing"].itertuples():
        out[f"{row.model}/seconds/{row.method}"] = float(row.seconds)
    return out


def _selections(scores: pd.DataFrame, L: int, n: int, random_seeds) -> list[tuple[str, int, list[int]]]:
    import numpy as np

    from .importance import lowest

    out = [("top-N", 0, parse_layers(f"top:{n}", L)), ("bottom-N", 0, parse_layers(f"bottom:{n}", L)),
           ("lowest attention BI", 0, lowest(scores, "bi_attn", n)),
           ("lowest Taylor sensitivity", 0, lowest(scores, "taylor", n)),
           ("smallest bypass error", 0, lowest(scores, "bypass_error", n))]
    for seed in random_seeds:
        out.append(("random", seed, sorted(np.random.default_rng(seed).choice(L, n, replace=False).tolist())))
    return out


def selection_study(models: list[str], n_calib: int, n_test: int, seq_len: int, seed: int, dtype: str,
                    device: str, n_layers: int = 0, grid: tuple = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0),
                    random_seeds: tuple = (0, 1, 2), n_max_frac: float = 0.5) -> dict:
    """The paper's ablations: which N layers to prune (top, bottom, by importance, random), with α searched on
    enwiki-train or α = 1, evaluated on enwiki-test and the out-of-domain Lee news test split; plus an N sweep
    for top-N (one greedy search of the deepest N gives every shallower top-N, since greedy works top-down).

    Returns:
        dict: selection (model, selection, seed, n_layers, alpha_mode, corpus, ppl, layers), n_sweep (model,
        n_layers, alpha_mode, ppl), scores (per-layer importance), infos.
    """
    from .importance import layer_scores
    from .search import search_alphas

    sel_rows, sweep_rows, score_tables, infos = [], [], [], []
    for name in models:
        model, tok = load_model(name, dtype=dtype, device=device)
        L = fingerprint(model.config)["num_layers"]
        n = n_layers or quarter_depth(L)
        calib = ppl_windows(tok, "enwiki", "train", n_calib, seq_len, seed)
        scores = layer_scores(model, calib)
        score_tables.append(scores.assign(model=name))
        tests = {c: Boundaries(model, ppl_windows(tok, c, "test", n_test, seq_len, seed)) for c in ("enwiki", "lee")}
        for corpus, bounds in tests.items():
            sel_rows.append(dict(model=name, selection="dense", seed=0, n_layers=0, alpha_mode="-", corpus=corpus,
                                 ppl=_test_ppl(bounds, {}), layers=""))
        memo: dict = {}  # searches share their top layers' α's (see search_alphas); the deepest top-N goes first
        deepest = parse_layers(f"top:{max(n_values(L, n_max_frac))}", L)
        greedy = search_alphas(model, calib, deepest, grid, memo=memo)
        for selection, rseed, layers in tqdm(_selections(scores, L, n, random_seeds), desc=f"selections {name}"):
            for mode in ("searched", "α = 1"):
                alphas = (search_alphas(model, calib, layers, grid, memo=memo) if mode == "searched"
                          else dict.fromkeys(layers, 1.0))
                for corpus, bounds in tests.items():
                    sel_rows.append(dict(model=name, selection=selection, seed=rseed, n_layers=n, alpha_mode=mode,
                                         corpus=corpus, ppl=_test_ppl(bounds, alphas),
                                         layers=" ".join(map(str, layers))))
        for k in n_values(L, n_max_frac):
            top = deepest[-k:]
            for mode, alphas in (("searched", {i: greedy[i] for i in top}), ("α = 1", dict.fromkeys(top, 1.0))):
                sweep_rows.append(dict(model=name, n_layers=k, alpha_mode=mode, corpus="enwiki",
                                       ppl=_test_ppl(tests["enwiki"], alphas)))
        infos.append(model_info(model))
        del model, tests
    return {"selection": pd.DataFrame(sel_rows), "n_sweep": pd.DataFrame(sweep_rows),
            "scores": pd.concat(score_tables, ignore_index=True), "infos": infos}


def summarise_selection(tables: dict) -> dict:
    """Headline numbers: test PPL per model, selection (random: mean over seeds), α mode and corpus."""
    df = tables["selection"]
    g = df.groupby(["model", "selection", "alpha_mode", "corpus"]).ppl.mean()
    return {f"{m}/{s}/{a}/{c}": float(v) for (m, s, a, c), v in g.items()}


# ---------------------------------------------------------------------------------------------- notebook 04
LLAMA31_8B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                  intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False)
PAPER_LLAMA31_8B = {"speedup_64k": 1.167, "param_ratio": 0.033}  # the paper's reported numbers


def timing_study(models: list[str], seq_lens: list[int], n_layers: int, alpha: float, repeats: int, warmup: int,
                 decode_steps: int, threads: int, seed: int, dtype: str, device: str,
                 extra_csv: tuple[str, ...] = ()) -> dict:
    """Dense vs HARP (top-N, one α for every pruned layer) latency, KV bytes and memory per length and model.

    `extra_csv` adds rows measured elsewhere (`python -m harp_src timing --csv`, e.g. on a GPU) to the tables.

    Returns:
        dict of tables: summary (one row per model, device, length), latency (long: variant, phase, seconds),
        speedup (model, device, seq_len, speedup, flop_bound, decode_speedup, decode_flop_bound), kv (model,
        device, seq_len, variant, kv_bytes, peak_mem_bytes), infos.
    """
    from .timing import compare, harp_copy

    parts, infos = [], []
    for name in models:
        model, _ = load_model(name, dtype=dtype, device=device)
        L = fingerprint(model.config)["num_layers"]
        harp, _ = harp_copy(model, f"top:{n_layers or quarter_depth(L)}", alpha)
        summary, _ = compare(model, harp, seq_lens, repeats, warmup, decode_steps, threads or None, seed)
        parts.append(summary.assign(model=name))
        infos.append(model_info(model))
        del model, harp
    parts += [pd.read_csv(path) for path in extra_csv]
    summary = pd.concat(parts, ignore_index=True)
    return {"summary": summary, **timing_tables(summary), "infos": infos}


_LATENCY = [("dense", "prefill", "median_dense_s", "s per prompt"),
            ("HARP", "prefill", "median_harp_s", "s per prompt"),
            ("dense", "decode", "decode_dense_ms", "ms per token"),
            ("HARP", "decode", "decode_harp_ms", "ms per token")]


def timing_tables(summary: pd.DataFrame) -> dict:
    """The plotted tables, derived from summary rows (this run's and any added CSV's)."""
    keys = ["model", "device", "seq_len"]
    latency = pd.concat([summary[keys].assign(variant=v, phase=p, latency=summary[col], unit=unit)
                         for v, p, col, unit in _LATENCY], ignore_index=True)
    speedup = summary[keys + ["speedup", "flop_bound", "decode_speedup", "decode_flop_bound"]].assign(
        measured_over_bound=summary.speedup / summary.flop_bound)
    dense = summary[keys].assign(variant="dense", kv_bytes=summary.kv_bytes_dense,
                                 kv_expected=summary.kv_bytes_dense, peak_mem_bytes=summary.peak_mem_dense)
    harp = summary[keys].assign(variant="HARP", kv_bytes=summary.kv_bytes_harp,
                                kv_expected=summary.kv_bytes_expected,
                                peak_mem_bytes=summary.peak_mem_harp)
    return {"latency": latency, "speedup": speedup, "kv": pd.concat([dense, harp], ignore_index=True)}


def llama31_8b_bound(seq_lens: list[int]) -> pd.DataFrame:
    """FLOP-model bound for the public Llama-3.1-8B config with the official top-8 α's, beside the paper's numbers."""
    from transformers import LlamaConfig

    from .flops import speedup_bound

    config = LlamaConfig(**LLAMA31_8B)
    alphas = {31 - i: a for i, a in enumerate(OFFICIAL_LLAMA31_8B_TOP_FIRST)}
    ratio = param_report(config, HarpPlan(fingerprint(config), alphas))["ratio_paper"]
    return pd.DataFrame([{"model": "Llama-3.1-8B (config only)", "seq_len": t,
                          "flop_bound": speedup_bound(config, t, alphas, head_tokens=1),
                          "decode_flop_bound": speedup_bound(config, 1, alphas, head_tokens=1, past=t),
                          "param_ratio_paper_convention": ratio,
                          "paper_speedup_64k": PAPER_LLAMA31_8B["speedup_64k"],
                          "paper_param_ratio": PAPER_LLAMA31_8B["param_ratio"]} for t in seq_lens])


def summarise_timing(tables: dict) -> dict:
    """Headline numbers per model and device at the longest measured length (for record_metrics)."""
    out = {}
    s = tables["summary"]
    for (model, device), part in s.groupby(["model", "device"]):
        row = part.sort_values("seq_len").iloc[-1]
        key = f"{model}/{'cpu' if str(device).startswith('cpu') else device}"
        out |= {f"{key}/longest_seq_len": int(row.seq_len), f"{key}/speedup": float(row.speedup),
                f"{key}/flop_bound": float(row.flop_bound),
                f"{key}/measured_over_bound": float(row.speedup / row.flop_bound),
                f"{key}/decode_speedup": float(row.decode_speedup),
                f"{key}/kv_ratio": float(row.kv_ratio), f"{key}/kv_ratio_expected": float(row.kv_ratio_expected)}
    llama = tables.get("llama")
    if llama is not None:
        at64k = llama[llama.seq_len == 65536]
        if len(at64k):
            out["llama31_8b/flop_bound_64k"] = float(at64k.flop_bound.iloc[0])
            out["llama31_8b/param_ratio_paper_convention"] = float(at64k.param_ratio_paper_convention.iloc[0])
    return out
