"""`python -m harp_src evalbench`: lm-eval's stock HFLM vs FastHFLM on the same log-likelihood requests, interleaved.

The requests are built once by lm-eval itself (`eval.tasks.task_requests`, exactly as run_tasks builds them); both
scorers then score that same list in the order stock, fast, fast, stock, … after an untimed warm-up of each, at a
fixed thread count. Reported: the median seconds of each, items/s (documents per second), their ratio, and how far
apart the two scorers' answers are (largest |Δ log-likelihood|, identical is_greedy).
"""

from __future__ import annotations

import statistics

from ..eval.tasks import CLOZE, DISCRIMINATIVE, GOLD_BPB, PAPER_SHOTS, available_tasks, make_lm, task_requests
from .timing import interleaved

SCORED = DISCRIMINATIVE + CLOZE + GOLD_BPB  # tasks whose requests are log-likelihoods (the fast scorer's part)


def check_task(task: str) -> str:
    """`task` if its requests are log-likelihoods (the part the fast scorer replaces); else one clear error."""
    if task not in SCORED:
        raise ValueError(f"evalbench compares log-likelihood scorers: task {task!r} is not one of {list(SCORED)} "
                         f"(available tasks are {available_tasks()}; generation tasks do not use the scorer)")
    return task


def bench_task(model, tok, task: str, limit: int | None, num_fewshot: int | None, *, repeats: int = 3,
               warmup: int = 1, threads: int | None = None) -> dict:
    """Stock vs fast scorer on one task's requests; see the module docstring.

    Returns:
        dict: task, shots, items, requests, stock_s, fast_s (medians), stock_items_per_s, fast_items_per_s,
        speedup, max_abs_diff (log-likelihood), same_greedy, repeats, threads.
    """
    requests = task_requests(model, tok, check_task(task), limit, num_fewshot)
    lms = {"stock": make_lm(model, tok, fast=False), "fast": make_lm(model, tok, fast=True)}
    answers: dict[str, list] = {}

    def score(name: str):
        def run():
            answers[name] = lms[name].loglikelihood(requests, disable_tqdm=True)
        return run

    samples, n_threads = interleaved({name: score(name) for name in lms}, repeats, warmup, threads)
    seconds = {name: statistics.median(samples[name]) for name in lms}
    items = len({(r.task_name, r.doc_id) for r in requests})
    pairs = list(zip(answers["stock"], answers["fast"], strict=True))
    return {"task": task, "shots": PAPER_SHOTS[task] if num_fewshot is None else num_fewshot, "items": items,
            "requests": len(requests), "stock_s": seconds["stock"], "fast_s": seconds["fast"],
            "stock_items_per_s": items / seconds["stock"], "fast_items_per_s": items / seconds["fast"],
            "speedup": seconds["stock"] / seconds["fast"], "max_abs_diff": max(abs(a[0] - b[0]) for a, b in pairs),
            "same_greedy": all(a[1] == b[1] for a, b in pairs), "repeats": repeats, "threads": n_threads}
