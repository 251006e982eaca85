"""The α search benchmarked: cached and naive candidate evaluations interleaved (A B, B A, …) at fixed threads, with
the FLOP model's predicted ratio beside the measured one."""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable, Sequence

import torch
from tqdm.auto import tqdm

from ..method.harp import harp_applied
from ..method.prefix import Boundaries
from ..method.search import GRID, candidate_ppl, check_search, pick
from .flops import search_flops
from .timing import num_threads


def benchmark_search(model, calib: torch.Tensor, layers: Iterable[int] | str, grid: Sequence[float] = GRID, *,
                     batch_size: int = 4, threads: int | None = None, warmup: int = 1) -> dict:
    """Cached vs naive greedy search, timed so that the machine's drifts hit both alike: every candidate α is
    evaluated both ways back to back, the order flipping at each candidate (A B, B A, …), after `warmup` untimed
    candidate pairs, at a fixed thread count. The search follows the cached path's choices; at every layer the
    naive scores make their own greedy choice, and `same_alphas` says whether all of them agree.

    Returns:
        dict: alphas, cached_s (boundary pass + candidates), naive_s, measured_ratio (naive / cached), flop_ratio
        (`measure.flops.search_flops`), measured_over_flop, median_candidate_ratio, same_alphas, max_rel_ppl_diff,
        candidates, threads, history (layer, alpha, calib_ppl, naive_ppl, chosen).
    """
    order, grid = check_search(model, calib, layers, grid)
    times: dict[str, list[float]] = {"cached": [], "naive": []}
    chosen: dict[int, float] = {}
    history, same, worst = [], True, 0.0
    with num_threads(threads) as n_threads:
        start = time.perf_counter()
        bounds = Boundaries(model, calib, batch_size)
        boundary_s = time.perf_counter() - start
        for _ in range(warmup):
            candidate_ppl(model, calib, bounds, order[0], grid[0], batch_size)
            candidate_ppl(model, calib, None, order[0], grid[0], batch_size)
        k = 0
        for layer in tqdm(order, desc="α search, cached vs naive"):
            scores = {"cached": [], "naive": []}
            with harp_applied(model, list(chosen), chosen):
                for alpha in grid:
                    runs = [("cached", bounds), ("naive", None)]
                    for name, b in runs if k % 2 == 0 else runs[::-1]:
                        start = time.perf_counter()
                        scores[name].append(candidate_ppl(model, calib, b, layer, alpha, batch_size))
                        times[name].append(time.perf_counter() - start)
                    k += 1
            cached, naive = pick(grid, scores["cached"]), pick(grid, scores["naive"])
            same &= cached == naive
            worst = max([worst] + [abs(a / b - 1) for a, b in zip(scores["cached"], scores["naive"], strict=True)])
            history += [dict(layer=layer, alpha=a, calib_ppl=c, naive_ppl=v, chosen=a == cached)
                        for a, c, v in zip(grid, scores["cached"], scores["naive"], strict=True)]
            chosen[layer] = cached
    cached_s, naive_s = boundary_s + sum(times["cached"]), sum(times["naive"])
    flop_ratio = search_flops(model.config, order, len(grid), calib.shape[1])["predicted_ratio"]
    per_candidate = [v / c for c, v in zip(times["cached"], times["naive"], strict=True)]
    return {"alphas": dict(sorted(chosen.items())), "cached_s": cached_s, "naive_s": naive_s,
            "boundary_s": boundary_s, "measured_ratio": naive_s / cached_s, "flop_ratio": flop_ratio,
            "measured_over_flop": naive_s / cached_s / flop_ratio,
            "median_candidate_ratio": statistics.median(per_candidate), "same_alphas": bool(same),
            "max_rel_ppl_diff": worst, "candidates": len(per_candidate), "threads": n_threads, "history": history}
