"""A long study as data: steps with a key, the steps they need, and a function of (key, inputs).

A step's function is named by its import path ("harp_src.compare.points:search_step"), so any process can run it:
it loads what it needs itself (the model by name, windows by their spec) and returns a picklable result. Its id is
a hash of (function, key, the ids it needs): the same work has the same id wherever it is declared, and a step whose
stored key disagrees with the code's gets another id, so it is computed again, never mixed in.

Results are stored under `.runs/parts/steps/<id>.pkl` (the `report.parts` store, one folder for every study: a step
two studies declare is computed once) with their provenance: commit, source digest, compute seconds, host and the run
that made them.
"""

from __future__ import annotations

import importlib
import json
import os
import pickle
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..report.files import atomic_path
from ..report.parts import PARTS, part_key, source_digest
from ..report.results import git_commit

RUN_ENV = "HARP_RUN"  # set by the runner: steps stored by this run are reused by its notebooks even without REUSE_PARTS


def plain(value):
    """`value` as JSON gives it back (tuples become lists, int dict keys strings): the form keys are compared in."""
    return json.loads(json.dumps(value, sort_keys=True, default=str))


@dataclass(frozen=True)
class Step:
    """One unit of a study's work.

    Attributes:
        notebook: the study that declared it first (for --plan).
        fn: "module:function" of `fn(key, inputs) -> result`.
        key: what the result depends on (JSON-able): model, method, scope, level, sizes, seeds.
        needs: {input name: step id} of the steps whose results it reads.
        label: a short human name for progress and `--plan`.
        cpus: torch threads (and Ray CPUs) it runs with; gpus: 1 on cuda.
        memory: bytes it may hold at once (two copies of the model and activations), for the scheduler.
        alone: a timing step: it runs with every CPU of its node, so nothing runs beside it.
        size: a relative amount of work, for estimates where the step never ran.
    """

    notebook: str
    fn: str
    key: dict
    needs: dict = field(default_factory=dict)
    label: str = ""
    cpus: int = 1
    gpus: int = 0
    memory: int = 0
    alone: bool = False
    size: float = 1.0

    @property
    def spec(self) -> dict:
        """What identifies the step's result: its function, key and inputs (by id)."""
        return plain({"fn": self.fn, "key": self.key, "needs": self.needs})

    @property
    def id(self) -> str:
        return part_key(self.spec)

    @property
    def path(self) -> Path:
        return PARTS / "steps" / f"{self.id}.pkl"  # not per notebook: a step two studies declare is one result


class Graph:
    """Steps in the order they were declared (every step after the steps it needs)."""

    def __init__(self) -> None:
        self.steps: dict[str, Step] = {}

    def add(self, step: Step) -> str:
        """Add `step` (once: the same work declared twice is one step) and return its id."""
        missing = [i for i in step.needs.values() if i not in self.steps]
        if missing:
            raise ValueError(f"step {step.label or step.fn} needs {missing[0]}, which is not declared before it")
        self.steps.setdefault(step.id, step)
        return step.id

    def __len__(self) -> int:
        return len(self.steps)

    def __iter__(self):
        return iter(self.steps.values())

    def merge(self, other: Graph) -> Graph:
        """One graph of this one's steps and `other`'s (the runner runs every notebook's steps together)."""
        for step in other:
            self.add(step)
        return self


def function(step: Step):
    """The step's function, imported by name."""
    module, _, name = step.fn.partition(":")
    return getattr(importlib.import_module(module), name)


def stored(step: Step, reuse: bool) -> tuple[bool, object, dict]:
    """(found, result, provenance) of `step` in the store: found when its stored spec equals the code's and either
    `reuse` is set or this run (RUN_ENV) stored it."""
    if not step.path.exists():
        return False, None, {}
    try:
        with step.path.open("rb") as f:
            kept = pickle.load(f)
    except (OSError, EOFError, pickle.UnpicklingError):
        return False, None, {}  # an unreadable file is computed again
    provenance = kept.get("provenance", {})
    this_run = os.environ.get(RUN_ENV)
    if kept.get("params") != step.spec or not (reuse or (this_run and provenance.get("run") == this_run)):
        return False, None, {}
    return True, kept["part"], provenance | {"reused": True, "file": str(step.path)}


def stored_seconds(step: Step) -> float | None:
    """The compute seconds of `step`'s stored result, whoever made it; None where it never ran (for `--plan`)."""
    try:
        with step.path.open("rb") as f:
            kept = pickle.load(f)
    except (OSError, EOFError, pickle.UnpicklingError):
        return None
    return kept.get("provenance", {}).get("seconds") if kept.get("params") == step.spec else None


def save(step: Step, result, provenance: dict) -> dict:
    """Store `result` atomically under the step's id; returns the provenance with the file."""
    with atomic_path(step.path) as tmp, tmp.open("wb") as f:
        pickle.dump({"params": step.spec, "part": result, "provenance": provenance, "size": step.size,
                     "label": step.label}, f)
    return provenance | {"file": str(step.path)}


def compute(step: Step, inputs: dict, threads: int | None = None) -> tuple[object, dict]:
    """Run the step's function on `inputs` ({name: result}): (result, provenance). With `threads`, torch uses that
    many (a worker's threads are its CPUs)."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    start = time.perf_counter()
    result = function(step)(step.key, inputs)
    return result, {"commit": git_commit(), "source_digest": source_digest(), "reused": False,
                    "seconds": time.perf_counter() - start, "host": socket.gethostname(),
                    "run": os.environ.get(RUN_ENV, ""), "threads": torch.get_num_threads()}
