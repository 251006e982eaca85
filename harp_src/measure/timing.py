"""Long-context efficiency: prefill and decode latency, KV-cache bytes and peak memory, dense vs HARP.

Both models are measured in one run, interleaved (dense, HARP, HARP, dense, …) after an untimed warm-up, at a
fixed thread count, so slow drifts of the machine hit both and cancel in the ratio. Prefill is timed the way
`generate` runs it: the whole prompt with the KV cache on and logits for the last token only. Every measured
ratio is paired with the FLOP model's bound (flops.py) for the same plan and length.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import gc
import json
import platform
import statistics
import threading
import time
from collections.abc import Callable, Iterable

import pandas as pd
import psutil
import torch
from tqdm.auto import tqdm

from ..method.harp import apply_harp
from ..model.adapter import head_dim, text_config
from ..model.modeling_harp import describe
from .flops import model_flops, speedup_bound
from .kv import kv_bytes_per_layer, kv_cache_bytes

VARIANTS = ("dense", "HARP")


# ---------------------------------------------------------------------------------------------- plumbing
def check_threads(threads: int | None) -> int | None:
    """None (torch's setting) or a whole number of threads >= 1; anything else is refused, not replaced."""
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads must be a whole number >= 1 (or None for torch's setting), got {threads!r}")
    return threads


@contextlib.contextmanager
def num_threads(threads: int | None):
    """Run with a fixed intra-op thread count (None: leave torch's setting)."""
    check_threads(threads)
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def interleaved(procedures: dict[str, Callable[[], object]], repeats: int = 3, warmup: int = 1,
                threads: int | None = None) -> tuple[dict[str, list[float]], int]:
    """Wall time of each procedure, `repeats` times, interleaved so that drifts of the machine hit all alike: after
    `warmup` untimed runs of each, the order flips every repeat (A B, B A, A B, …), at a fixed thread count.

    Returns:
        ({name: [seconds per repeat]}, the thread count used).
    """
    if repeats < 1 or warmup < 0:
        raise ValueError("need repeats >= 1 and warmup >= 0")
    names = list(procedures)
    samples: dict[str, list[float]] = {name: [] for name in names}
    with num_threads(threads) as n_threads:
        for name in names * warmup:
            procedures[name]()
        for r in range(repeats):
            for name in names if r % 2 == 0 else names[::-1]:
                start = time.perf_counter()
                procedures[name]()
                samples[name].append(time.perf_counter() - start)
    return samples, n_threads


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def trim_heap() -> None:
    """Give freed memory back to the OS so the next RSS baseline is honest (glibc only; a no-op elsewhere)."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class PeakMemory:
    """Peak memory added by the code inside the `with` block.

    CUDA: the allocator's exact peak. CPU: the process RSS sampled every `interval` s by a thread, minus the RSS
    just before (an estimate; a peak shorter than the interval can be missed).
    """

    def __init__(self, device: torch.device, interval: float = 0.002):
        self.device, self.interval, self.bytes = device, interval, 0
        self._stop = threading.Event()

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            return self
        trim_heap()
        self._proc = psutil.Process()
        self._base = self._peak = self._proc.memory_info().rss
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._peak = max(self._peak, self._proc.memory_info().rss)
            time.sleep(self.interval)

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.bytes = torch.cuda.max_memory_allocated(self.device) - self._base
        else:
            self._stop.set()
            self._thread.join()
            self._peak = max(self._peak, self._proc.memory_info().rss)
            self.bytes = self._peak - self._base
        return False


def _device(model) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def prefill(model, ids: torch.Tensor):
    """One prefill as `generate` does it: cache on, logits of the last position only. Returns (seconds, output)."""
    device = _device(model)
    _sync(device)
    start = time.perf_counter()
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    _sync(device)
    return time.perf_counter() - start, out


@torch.no_grad()
def decode_step(model, token: torch.Tensor, cache) -> tuple[float, torch.Tensor]:
    """One greedy decode step on top of `cache` (updated in place). Returns (seconds, next token)."""
    device = _device(model)
    _sync(device)
    start = time.perf_counter()
    out = model(input_ids=token, cache=cache, use_cache=True, logits_to_keep=1)
    _sync(device)
    return time.perf_counter() - start, out.logits[:, -1:].argmax(-1)


def random_prompt(vocab_size: int, seq_len: int, seed: int, device: torch.device) -> torch.Tensor:
    """Token ids [1, seq_len]; latency does not depend on the text, only on its length."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (1, seq_len), generator=gen, device="cpu").to(device)


def harp_copy(model, layers: Iterable[int] | str, alphas: float | dict[int, float] = 1.0, fold: bool = True,
              bypass: str = "identity"):
    """A pruned deep copy of `model` (the dense one is left as it is) and its plan."""
    pruned = copy.deepcopy(model)
    plan = apply_harp(pruned, layers, alphas, fold=fold, meta={"source": "timing"}, bypass=bypass)
    return pruned, plan


# ---------------------------------------------------------------------------------------------- measurement
def _check(seq_lens: list[int], repeats: int, warmup: int, decode_steps: int) -> None:
    if not seq_lens or any(int(t) < 2 for t in seq_lens):
        raise ValueError(f"seq_lens must be a non-empty list of lengths >= 2, got {seq_lens}")
    if repeats < 1 or warmup < 1 or decode_steps < 0:
        raise ValueError("need repeats >= 1, warmup >= 1 (peak memory and KV bytes are read in the warm-up) "
                         "and decode_steps >= 0")


def _check_pair(dense, harp):
    """The plan of `harp`; refuses a pair that is not (dense model, its pruned copy)."""
    plan = getattr(harp, "harp_plan", None)
    if plan is None:
        raise ValueError("the second model is not pruned: make it with harp_copy(model, layers) or apply_harp")
    if getattr(dense, "harp_plan", None) is not None:
        raise ValueError("the first model must be the dense one, but it carries a HARP plan")
    return plan


def _sample(t: int, variant: str, phase: str, repeat: int, seconds: float) -> dict:
    return {"seq_len": t, "variant": variant, "phase": phase, "repeat": repeat, "seconds": seconds}


def _warm_up(models: dict, ids: torch.Tensor, warmup: int, steps) -> dict:
    """Untimed prefills of each model; the first records peak memory, KV bytes and the cache decoding starts from."""
    state = {}
    for name, model in models.items():
        steps.set_postfix(seq_len=ids.shape[1], phase="warm-up", model=name)
        with PeakMemory(_device(model)) as peak:
            _, out = prefill(model, ids)
        state[name] = {"cache": out.cache, "token": out.logits[:, -1:].argmax(-1), "peak": peak.bytes,
                       "kv": kv_cache_bytes(out.cache), "per_layer": kv_bytes_per_layer(out.cache)}
        del out
        steps.update()
        for _ in range(warmup - 1):
            prefill(model, ids)
            steps.update()
    return state


def _decode(models: dict, state: dict, t: int, decode_steps: int, steps) -> list[dict]:
    """Greedy decode steps on top of each warm-up cache, alternating models; one sample per step."""
    samples = []
    for step in range(decode_steps):
        for name, model in models.items():
            steps.set_postfix(seq_len=t, phase="decode", model=name)
            s = state[name]
            seconds, s["token"] = decode_step(model, s["token"], s["cache"])
            samples.append(_sample(t, name, "decode", step, seconds))
            steps.update()
    return samples


def _memory(state: dict, plan) -> tuple[dict, dict]:
    """(KV bytes per variant plus the expected HARP bytes, peak memory per variant) from the warm-up."""
    kv = {name: s["kv"] for name, s in state.items()}
    # what HARP must keep: the dense cache of every layer it does not prune (exact for any layer type)
    kv["expected"] = sum(b for i, b in enumerate(state["dense"]["per_layer"]) if i not in plan.alphas)
    return kv, {name: s["peak"] for name, s in state.items()}


def _prefills(models: dict, ids: torch.Tensor, repeats: int, steps) -> list[dict]:
    """Timed prefills, the order flipping every repeat (dense, HARP, HARP, dense, …)."""
    t, samples = ids.shape[1], []
    for r in range(repeats):
        for name in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
            steps.set_postfix(seq_len=t, phase="prefill", model=name)
            seconds, out = prefill(models[name], ids)
            del out
            samples.append(_sample(t, name, "prefill", r, seconds))
            steps.update()
    return samples


def _measure_length(models: dict, plan, t: int, *, repeats: int, warmup: int, decode_steps: int, seed: int,
                    steps) -> tuple[dict, list[dict]]:
    """Warm-up, decode and interleaved prefills at one length: (summary row, timed samples)."""
    dense = models["dense"]
    ids = random_prompt(text_config(dense.config).vocab_size, t, seed, _device(dense))
    state = _warm_up(models, ids, warmup, steps)
    samples = _decode(models, state, t, decode_steps, steps)
    kv, peak = _memory(state, plan)
    state.clear()  # free the caches before the timed prefills
    trim_heap()
    samples += _prefills(models, ids, repeats, steps)
    return _summary_row(samples, dense.config, plan, t, kv, peak), samples


def compare(
    dense,
    harp,
    seq_lens: Iterable[int],
    *,
    repeats: int = 3,
    warmup: int = 1,
    decode_steps: int = 8,
    threads: int | None = None,
    seed: int = 0,
    progress: bool = True,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Measure `dense` and its pruned copy `harp` (from `harp_copy`/`apply_harp`) at each length, interleaved.

    Per length: `warmup` untimed prefills of each model (the first one also records peak memory and KV-cache
    bytes); `decode_steps` greedy decode steps on top of that cache, alternating models; then `repeats` timed
    prefills, the order flipping every repeat (dense, HARP, HARP, dense, …).

    Returns:
        (summary, samples): one summary row per length with `median_dense_s, median_harp_s, speedup,
        flop_bound, kv_bytes_dense, kv_bytes_harp`, decode ms/token and peak memory; and every timed call
        (`seq_len, variant, phase, repeat, seconds`).
    """
    seq_lens = [int(t) for t in seq_lens]
    _check(seq_lens, repeats, warmup, decode_steps)
    plan = _check_pair(dense, harp)
    models = {"dense": dense, "HARP": harp}
    samples, rows = [], []
    with num_threads(threads) as n_threads:
        steps = tqdm(total=len(seq_lens) * (2 * warmup + 2 * decode_steps + 2 * repeats), desc="timing",
                     disable=not progress)
        for t in seq_lens:
            row, timed = _measure_length(models, plan, t, repeats=repeats, warmup=warmup, decode_steps=decode_steps,
                                         seed=seed, steps=steps)
            rows.append(row)
            samples += timed
        steps.close()
    summary = pd.DataFrame(rows)
    summary.insert(0, "threads", n_threads)
    summary.insert(0, "dtype", str(next(dense.parameters()).dtype).removeprefix("torch."))
    summary.insert(0, "device", device_name(_device(dense)))
    return summary, pd.DataFrame(samples)


def _median(samples: list[dict], t: int, variant: str, phase: str) -> float:
    values = [s["seconds"] for s in samples if (s["seq_len"], s["variant"], s["phase"]) == (t, variant, phase)]
    return statistics.median(values) if values else float("nan")


def _summary_row(samples: list[dict], config, plan, t: int, kv: dict, peak: dict) -> dict:
    dense_s, harp_s = (_median(samples, t, v, "prefill") for v in VARIANTS)
    dec_dense, dec_harp = (_median(samples, t, v, "decode") for v in VARIANTS)
    L = text_config(config).num_hidden_layers
    return {
        "seq_len": t,
        "n_layers": L,
        "pruned_layers": len(plan.alphas),
        "median_dense_s": dense_s,
        "median_harp_s": harp_s,
        "speedup": dense_s / harp_s,
        "flop_bound": speedup_bound(config, t, plan.alphas, plan.fold, head_tokens=1),
        "decode_dense_ms": 1e3 * dec_dense,
        "decode_harp_ms": 1e3 * dec_harp,
        "decode_speedup": dec_dense / dec_harp,
        "decode_flop_bound": speedup_bound(config, 1, plan.alphas, plan.fold, head_tokens=1, past=t),
        "kv_bytes_dense": kv["dense"],
        "kv_bytes_harp": kv["HARP"],
        "kv_ratio": kv["HARP"] / kv["dense"] if kv["dense"] else float("nan"),
        "kv_ratio_expected": (L - len(plan.alphas)) / L,
        "kv_bytes_expected": kv["expected"],
        "peak_mem_dense": peak["dense"],
        "peak_mem_harp": peak["HARP"],
        "gflops_dense": model_flops(config, t, None, plan.fold, head_tokens=1) / 1e9,
        "gflops_harp": model_flops(config, t, plan.alphas, plan.fold, head_tokens=1) / 1e9,
    }


def device_name(device: torch.device | str) -> str:
    """'cpu: <processor>' or the GPU's name, for the `device` column."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({cpu_model()}, {psutil.cpu_count(logical=True)} cores)"


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def kv_bytes_formula(config, seq_len: int, n_pruned: int = 0, dtype: torch.dtype = torch.float32) -> int:
    """K and V bytes of a full-attention cache after `seq_len` tokens: 2·(L − N)·kv_heads·head_dim·T·bytes.

    Exact for models whose every layer attends globally (Llama, Mistral without a window, Qwen2); Gemma's
    sliding-window layers keep at most their window.
    """
    cfg = text_config(config)
    size = dtype.itemsize
    return 2 * (cfg.num_hidden_layers - n_pruned) * cfg.num_key_value_heads * head_dim(cfg) * seq_len * size


def flop_bounds(config, alphas: dict[int, float], seq_lens: Iterable[int], fold: bool = True) -> pd.DataFrame:
    """The FLOP model alone (no measurement): prefill and decode bounds per length, e.g. for a config-only model."""
    return pd.DataFrame([{"seq_len": t,
                          "flop_bound": speedup_bound(config, t, alphas, fold, head_tokens=1),
                          "decode_flop_bound": speedup_bound(config, 1, alphas, fold, head_tokens=1, past=t)}
                         for t in seq_lens])


REFERENCE = "reference"


def latency_group(reference, models: dict, seq_len: int, *, repeats: int = 3, warmup: int = 1,
                  decode_steps: int = 8, threads: int | None = None, seed: int = 0) -> dict[str, dict]:
    """Prefill and per-token decode latency of several models and of `reference` (their dense model) at one prompt
    length, all interleaved in one round-robin (`interleaved`: warm-up first, the order reversing every repeat, fixed
    threads, medians), so the reference is timed once per round for all of them.

    Works for any pruned model (baselines as well as HARP). Decoding runs `decode_steps` greedy steps per repeat on
    top of the cache of its last timed prefill (0: no decoding timed; with decoding, the KV bytes that cache holds
    are reported too). `warmup` untimed prefills per model come first (0 when the models were just warmed, e.g. at a
    shorter length); decoding always warms up at least once. Returns {name: medians in seconds and their ratios
    (reference / model)}; the reference's own figures under REFERENCE.
    """
    if REFERENCE in models:
        raise ValueError(f"no model may be named {REFERENCE!r}: that name is the reference's")
    ids = random_prompt(text_config(reference.config).vocab_size, seq_len, seed, _device(reference))
    every = {REFERENCE: reference, **models}
    last: dict = {}  # each model's latest prefill output: decoding continues from its cache (no extra prefill)

    def run(name: str) -> None:
        last[name] = None  # free the previous cache before the next prefill
        out = prefill(every[name], ids)[1]
        last[name] = out if decode_steps else None

    prefills, n_threads = interleaved({n: (lambda n=n: run(n)) for n in every}, repeats, warmup, threads)
    p = {n: statistics.median(v) for n, v in prefills.items()}
    # decode warm-up is cheap next to a long prefill: always at least one, even when the prefill had none
    d, kv = _decode_medians(every, last, decode_steps, repeats=repeats, warmup=max(warmup, 1), threads=threads)
    out = {}
    for name in every:
        out[name] = {"seq_len": seq_len, "threads": n_threads, "prefill_reference_s": p[REFERENCE],
                     "prefill_s": p[name], "prefill_speedup": p[REFERENCE] / p[name]}
        if d:
            out[name] |= {"decode_reference_ms": 1e3 * d[REFERENCE], "decode_ms": 1e3 * d[name],
                          "decode_speedup": d[REFERENCE] / d[name], "decode_tokens_per_s": 1 / d[name],
                          "kv_bytes": kv[name]}
    return out


def shape_key(model, record=None) -> str:
    """What a model's speed depends on: its structure against the dense model (and, for unstructured pruning that
    keeps every shape, that it is such a model; `record`: its PruneRecord). One key, the same kernels."""
    zeroed = record is not None and record.weights_zeroed > 0
    return json.dumps([describe(model), zeroed], sort_keys=True)


def time_shapes(reference, builders: dict[str, Callable], seq_lens: tuple[int, int], *, repeats: int,
                decode_steps: int, groups: list[list[str]], seed: int = 0, store: Callable | None = None,
                desc: str = "timing") -> dict[str, tuple[dict, dict]]:
    """Prefill at two prompt lengths (decode at the longer) of many pruned models against `reference`, their dense
    model: the models are built a group at a time (their copies are held at once) and each group is timed in one
    round-robin with the reference (`latency_group`), first at the short length, which warms every model up, then
    at the long one without another warm-up (on a CPU one more long prefill per model costs a minute).

    Args:
        builders: {name: function returning a pruned copy}; a name may not be REFERENCE.
        groups: the names of `builders`, each once, in the groups to time.
        store: called as store(names, compute) per group, returning compute()'s result or a stored one (so an
            interrupted run keeps its finished groups); None: compute.
    Returns:
        {name: (short-length figures, long-length figures)}, the reference's own under REFERENCE (last group's).
    """
    named = [name for chosen in groups for name in chosen]
    if sorted(named) != sorted(builders) or not all(groups):
        raise ValueError(f"groups must name each of the {len(builders)} builders once, in non-empty groups; got "
                         f"{groups}")
    short, long = seq_lens
    out = {}
    def one_group(chosen: list[str]) -> dict:
        trim_heap()  # what earlier work freed goes back to the system before the copies are built
        models = {name: builders[name]() for name in chosen}
        fast = latency_group(reference, models, short, repeats=repeats, decode_steps=0, seed=seed)
        slow = latency_group(reference, models, long, repeats=repeats, warmup=0, decode_steps=decode_steps, seed=seed)
        return {name: (fast[name], slow[name]) for name in [*models, REFERENCE]}

    for chosen in tqdm(groups, desc=desc):
        out |= store(chosen, lambda c=chosen: one_group(c)) if store else one_group(chosen)
    return out


def _decode_medians(models: dict, prefilled: dict, steps: int, *, repeats: int, warmup: int,
                    threads: int | None) -> tuple[dict[str, float], dict[str, int]]:
    """(median seconds per greedy decode step, KV bytes of the prompt's cache) of each model, decoding on top of its
    own prefill output (`prefilled`: name -> model output with its cache), interleaved."""
    if not steps:
        return {}, {}
    state = {name: [out.cache, out.logits[:, -1:].argmax(-1)] for name, out in prefilled.items()}
    prefilled.clear()
    kv = {name: kv_cache_bytes(s[0]) for name, s in state.items()}

    def decode(name: str) -> None:
        for _ in range(steps):
            _, state[name][1] = decode_step(models[name], state[name][1], state[name][0])

    decodes, _ = interleaved({n: (lambda n=n: decode(n)) for n in models}, repeats, warmup, threads)
    state.clear()
    trim_heap()
    return {n: statistics.median(v) / steps for n, v in decodes.items()}, kv


def latency_pair(reference, model, seq_len: int, *, repeats: int = 3, warmup: int = 1, decode_steps: int = 8,
                 threads: int | None = None, seed: int = 0) -> dict:
    """Prefill and per-token decode latency of `model` and `reference` (its dense model) at one prompt length,
    interleaved (`latency_group` with one model). Returns medians in seconds and their ratios (reference / model)."""
    row = latency_group(reference, {"model": model}, seq_len, repeats=repeats, warmup=warmup,
                        decode_steps=decode_steps, threads=threads, seed=seed)["model"]
    for key in ("decode_tokens_per_s", "kv_bytes"):
        row.pop(key, None)
    return row
