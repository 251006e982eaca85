"""The cost of a graph before it runs: each step's seconds, the critical path, and the wall time predicted on K
workers by list scheduling (`python -m harp_src.runner --plan`).

A step's seconds are its stored compute seconds where it ran (whoever ran it), else an estimate from its size:
its declared size times the median seconds per unit of size of the stored steps of the same function. Under the full
profile the estimates are scaled so that a model's steps add up to that model's compute seconds recorded by the last
full run (figures/NN_metrics.json) where the study recorded them (its timing steps to its timing part where one
was recorded), else a notebook's steps to its last full run's wall time (figures/notebook_minutes.csv, the README's
table). A worker is one node like the one the seconds were
measured on (a step at a time, with all its CPUs), so a timing step is alone on its node by construction.
"""

from __future__ import annotations

import csv
import heapq
import json
import pickle
import statistics
from collections import defaultdict
from dataclasses import dataclass

from ..report.files import ROOT
from . import graph as store
from .graph import Graph, Step, stored_seconds

DEFAULT_RATE = 30.0  # seconds per unit of size where no step of a function has ever run (2-core CPU, fp32)


@dataclass
class Costed:
    """A step with its seconds and where they came from: "stored", "recorded" (scaled to a full run's totals) or
    "size" (an estimate)."""

    step: Step
    seconds: float
    source: str


def stored_rates(root=None) -> dict[str, float]:
    """{function: median seconds per unit of size} over every stored step in `root` (the store by default; any
    notebook, any key)."""
    rates = defaultdict(list)
    for path in (root or store.PARTS).glob("steps/*.pkl"):
        try:
            with path.open("rb") as f:
                kept = pickle.load(f)
        except (OSError, EOFError, pickle.UnpicklingError, AttributeError, ModuleNotFoundError):
            continue
        spec, seconds, size = kept.get("params", {}), kept.get("provenance", {}).get("seconds"), kept.get("size")
        if "fn" in spec and seconds and size:
            rates[spec["fn"]].append(seconds / size)
    return {fn: statistics.median(v) for fn, v in rates.items()}


def recorded_seconds(notebook: str) -> dict[str, float]:
    """{model: compute seconds} of a study's last full run, from its recorded metrics (each part's summed step
    seconds, or the part's own seconds where it kept no steps); {} where none were recorded."""
    path = ROOT / "figures" / f"{notebook}_metrics.json"
    if not path.exists():
        return {}
    out, recorded = {}, json.loads(path.read_text())
    metrics = recorded.get("metrics", {})
    for entry in recorded.get("models", []):
        parts = [entry] + [v for k, v in entry.items() if k.endswith("_part") and isinstance(v, dict)]
        total = 0.0
        for part in parts:
            steps = part.get("steps")
            if isinstance(steps, dict) and "compute_seconds" in steps:
                total += steps["compute_seconds"]
            elif part is entry and isinstance(part.get("part"), dict):
                total += part["part"].get("seconds", 0.0)
            elif part is not entry:
                total += part.get("seconds", 0.0)
        if "model_id" in entry and not total:  # a study that kept no parts records its seconds per model
            value = metrics.get(f"{entry['model_id']}/seconds")
            total = float(value) if isinstance(value, int | float) else 0.0
        if "model_id" in entry and total:
            out[entry["model_id"]] = total
    return out


def recorded_timing(notebook: str) -> dict[str, float]:
    """{model: compute seconds} of a study's timing part in its last full run (06 records one), {} where none: the
    timing steps (those that run alone) are scaled to it, the other steps to the rest."""
    path = ROOT / "figures" / f"{notebook}_metrics.json"
    out = {}
    for entry in json.loads(path.read_text()).get("models", []) if path.exists() else []:
        part = entry.get("timing_part")
        if isinstance(part, dict) and "model_id" in entry:
            steps = part.get("steps")
            out[entry["model_id"]] = steps["compute_seconds"] if isinstance(steps, dict) else part.get("seconds", 0.0)
    return {k: v for k, v in out.items() if v}


def notebook_seconds() -> dict[str, float]:
    """{notebook: wall seconds} of each notebook's last full run (figures/notebook_minutes.csv); {} without it."""
    path = ROOT / "figures" / "notebook_minutes.csv"
    if not path.exists():
        return {}
    with path.open() as f:
        return {r["notebook"]: 60 * float(r["minutes"]) for r in csv.DictReader(f)}


def cost(graph: Graph, recorded: bool = True) -> list[Costed]:
    """Seconds for every step of `graph` (see the module docstring)."""
    rates = stored_rates()
    costed = []
    for step in graph:
        seconds = stored_seconds(step)
        if seconds is not None:
            costed.append(Costed(step, seconds, "stored"))
        else:
            costed.append(Costed(step, step.size * rates.get(step.fn, DEFAULT_RATE), "size"))
    if recorded:
        _scale_to_recorded(costed)
    return costed


def _scale_to_recorded(costed: list[Costed]) -> None:
    """Scale each (notebook, model)'s estimated steps so the model's steps add up to its recorded full-run seconds;
    in a notebook that recorded none per model, its estimated steps so they add up to its recorded wall time."""
    groups = defaultdict(list)
    for c in costed:
        groups[(c.step.notebook, c.step.key.get("setup", {}).get("model"))].append(c)
    totals = {nb: recorded_seconds(nb) for nb in {nb for nb, _ in groups}}
    walls = notebook_seconds()
    for nb in [nb for nb, per_model in totals.items() if not per_model and nb in walls]:
        totals[nb] = {None: walls[nb]}
        groups[(nb, None)] = [c for (n, _), members in list(groups.items()) if n == nb for c in members]
    timing = {nb: recorded_timing(nb) for nb in totals}
    for (nb, model), members in groups.items():
        target, timed = totals[nb].get(model), timing[nb].get(model)
        if not target:
            continue
        if timed and timed < target:
            _scale([c for c in members if c.step.alone], timed)
            _scale([c for c in members if not c.step.alone], target - timed)
        else:
            _scale(members, target)


def _scale(members: list[Costed], target: float) -> None:
    """Scale the estimated ones of `members` so that all of them add up to `target` seconds."""
    estimated = [c for c in members if c.source == "size"]
    if not estimated:
        return
    known = sum(c.seconds for c in members if c.source != "size")
    factor = max(target - known, 0.0) / max(sum(c.seconds for c in estimated), 1e-9)
    for c in estimated:
        c.seconds, c.source = c.seconds * factor, "recorded"


def critical_path(costed: list[Costed]) -> tuple[float, list[Costed]]:
    """The longest chain of dependent steps: (its seconds, its steps in order)."""
    by_id = {c.step.id: c for c in costed}
    finish, before = {}, {}
    for c in costed:  # declaration order is topological
        start, prev = 0.0, None
        for i in c.step.needs.values():
            if finish[i] > start:
                start, prev = finish[i], i
        finish[c.step.id], before[c.step.id] = start + c.seconds, prev
    if not finish:
        return 0.0, []
    end = max(finish, key=finish.get)
    chain, node = [], end
    while node is not None:
        chain.append(by_id[node])
        node = before[node]
    return finish[end], chain[::-1]


def list_schedule(costed: list[Costed], workers: int) -> float:
    """Predicted wall seconds on `workers` identical workers: whenever a worker is free it takes the ready step with
    the longest path to the end of the graph (HLFET list scheduling)."""
    if workers < 1:
        raise ValueError(f"--workers must be at least 1, got {workers}")
    by_id = {c.step.id: c for c in costed}
    users = defaultdict(list)
    for c in costed:
        for i in c.step.needs.values():
            users[i].append(c.step.id)
    level = {}
    for c in reversed(costed):
        level[c.step.id] = c.seconds + max((level[u] for u in users[c.step.id]), default=0.0)
    waiting = {c.step.id: len(set(c.step.needs.values())) for c in costed}
    ready = [(-level[i], n, i) for n, (i, w) in enumerate(waiting.items()) if w == 0]
    heapq.heapify(ready)
    running, now, free, order = [], 0.0, workers, len(costed)
    while ready or running:
        while ready and free:
            _, _, i = heapq.heappop(ready)
            heapq.heappush(running, (now + by_id[i].seconds, i))
            free -= 1
        now, done = heapq.heappop(running)
        free += 1
        for u in users[done]:
            waiting[u] -= 1
            if waiting[u] == 0:
                order += 1
                heapq.heappush(ready, (-level[u], order, u))
    return now


def plan_text(graph: Graph, workers: list[int], whole: dict[str, float] | None = None, recorded: bool = True) -> str:
    """What `--plan` prints: steps per notebook and where their seconds come from, the critical path, and the
    predicted wall time on each K of `workers`. `whole`: notebooks that are not graphs, as one step each of the
    given seconds (their last full run); `recorded`: scale estimates to the last full run (the full profile only)."""
    costed = cost(graph, recorded)
    for nb, seconds in (whole or {}).items():
        costed.append(Costed(Step(nb, "whole notebook", {"notebook": nb}, label=f"{nb} (whole notebook)"), seconds,
                             "recorded"))
    lines = [f"{len(costed)} steps, {sum(c.seconds for c in costed) / 3600:.1f} h of compute in all"]
    per_nb = defaultdict(list)
    for c in costed:
        per_nb[c.step.notebook].append(c)
    for nb, members in sorted(per_nb.items()):
        sources = defaultdict(int)
        for c in members:
            sources[c.source] += 1
        lines.append(f"  {nb}: {len(members)} steps, {sum(c.seconds for c in members) / 60:.1f} min "
                     f"({', '.join(f'{n} {s}' for s, n in sorted(sources.items()))})")
    length, chain = critical_path(costed)
    lines.append(f"critical path: {length / 60:.1f} min over {len(chain)} steps")
    lines += [f"  {c.seconds / 60:7.1f} min  {c.step.notebook}  {c.step.label or c.step.fn}" for c in chain]
    lines.append("predicted wall time (list scheduling; a worker is one node like the one the seconds came from):")
    lines.append("  workers  hours  speed-up")
    one = list_schedule(costed, 1)
    for k in workers:
        wall = list_schedule(costed, k)
        lines.append(f"  {k:7d}  {wall / 3600:5.2f}  {one / wall:8.2f}")
    return "\n".join(lines)
