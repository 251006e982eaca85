"""Notebook 04: how much faster and smaller is HARP at long context, measured interleaved beside a FLOP-model bound?"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pandas as pd

from ..checkpoints import load_model
from ..measure.flops import speedup_bound
from ..measure.timing import compare, harp_copy
from ..method.accounting import param_report
from ..method.harp import HarpPlan
from ..method.layers import quarter_depth
from ..model.adapter import fingerprint
from ..model.loading import model_info
from ..model.paper import PAPER_LLAMA31_8B, llama31_8b_config, official_llama31_8b_alphas
from ..report.params import StudyParams


@dataclass(frozen=True)
class LongContextParams(StudyParams):
    """Notebook 04's parameters: the models, the prompt lengths, the HARP variant, and how the timing is repeated."""

    NOTEBOOK: ClassVar[str] = "04_long_context_timing"
    TYPES: ClassVar[dict] = {"EXTRA_CSV": list[str]}
    models: list[str]
    seq_lens: list[int]
    n_layers: int
    alpha: float
    repeats: int
    warmup: int
    decode_steps: int
    threads: int
    extra_csv: list[str]
    seed: int
    dtype: str
    device: str


def timing_study(p: LongContextParams) -> dict:
    """Dense vs HARP (top-N, one α for every pruned layer) latency, KV bytes and memory per length and model.

    `extra_csv` adds rows measured elsewhere (`python -m harp_src timing --csv`, e.g. on a GPU) to the tables.

    Returns:
        dict of tables: summary (one row per model, device, length), latency (long: variant, phase, seconds),
        speedup (model, device, seq_len, speedup, flop_bound, decode_speedup, decode_flop_bound), kv (model,
        device, seq_len, variant, kv_bytes, peak_mem_bytes), infos.
    """
    parts, infos = [], []
    for name in p.models:
        model, _ = load_model(name, dtype=p.dtype, device=p.device)
        L = fingerprint(model.config)["num_layers"]
        harp, _ = harp_copy(model, f"top:{p.n_layers or quarter_depth(L)}", p.alpha)
        summary, _ = compare(model, harp, p.seq_lens, repeats=p.repeats, warmup=p.warmup,
                             decode_steps=p.decode_steps, threads=p.threads or None, seed=p.seed)
        parts.append(summary.assign(model=name))
        infos.append(model_info(model))
        del model, harp
    parts += [pd.read_csv(path) for path in p.extra_csv]
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
    config = llama31_8b_config()
    alphas = official_llama31_8b_alphas()
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
