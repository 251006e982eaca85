"""What a step loads for itself, kept for the next step of the same process: the dense model by name, windows by
their spec, the dense final states on them. Inline, consecutive steps of one model load it once (as the study did
before it was steps). A Ray worker forgets a model after each step (`release`), since the scheduler counts only the
running step's memory, unless its weights are small (`KEEP_BYTES`): then the next step of the same model on that worker
skips the load, and an idle worker holds at most that much.
"""

from __future__ import annotations

import gc

from ..data.corpora import ppl_windows
from ..eval.fidelity import reference_states
from ..model.loading import load_pretrained

_HELD: dict = {}
KEEP_BYTES = 1 << 30  # weights a Ray worker may keep between steps: SmolLM2-135M in fp32 (0.5 GB), not a 1.5B model


def forget() -> None:
    """Drop every held model, windows and states."""
    _HELD.clear()
    gc.collect()


def release(keep_bytes: int = KEEP_BYTES) -> None:
    """After a step in a reused worker process: forget everything held unless its one model's weights take at most
    `keep_bytes` (then the model, its windows and states stay for the next step of that model)."""
    models = [v[0] for k, v in _HELD.items() if k[0] == "model"]
    held = sum(p.numel() * p.element_size() for m in models for p in m.parameters())
    if held > keep_bytes or len(models) != 1:
        forget()


def dense(setup: dict):
    """(model, tokenizer) of setup's model, dtype and device, loaded once per process (one model held at a time)."""
    key = ("model", setup["model"], setup["dtype"], setup["device"])
    if key not in _HELD:
        forget()  # one model at a time: a second would double the memory the scheduler planned for
        _HELD[key] = load_pretrained(setup["model"], dtype=setup["dtype"], device=setup["device"])
    return _HELD[key]


def windows(setup: dict, split: str) -> object:
    """The calibration ("train": n_calib × calib_len enwiki-train tokens) or evaluation ("test": n_eval × eval_len
    enwiki-test tokens) windows of `setup`, one name from the study to the pruner: `calib` and `windows`."""
    n, length = (setup["n_calib"], setup["calib_len"]) if split == "train" else (setup["n_eval"], setup["eval_len"])
    key = ("windows", setup["model"], split, n, length, setup["seed"])
    if key not in _HELD:
        _HELD[key] = ppl_windows(dense(setup)[1], "enwiki", split, n, length, setup["seed"])
    return _HELD[key]


def states(setup: dict) -> list:
    """The dense model's final states on the evaluation windows (fidelity compares every point with them)."""
    key = ("states", setup["model"], setup["n_eval"], setup["eval_len"], setup["seed"], setup["dtype"])
    if key not in _HELD:
        _HELD[key] = reference_states(dense(setup)[0], windows(setup, "test"))
    return _HELD[key]
