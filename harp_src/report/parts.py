"""Per-model parts of a long study, kept on disk so that a run can stop and resume (one model per session, say).

A part is stored under `.runs/parts/<notebook>/` with the parameters it was computed with, the commit and a digest
of the package's sources. It is reused only for exactly the same parameters, and the reuse is reported with the
commit and digest that made it, so a reader can tell when a figure mixes parts made by different code.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import time
from collections.abc import Callable
from pathlib import Path

from .files import ROOT, atomic_path
from .results import git_commit

PARTS = ROOT / ".runs" / "parts"
PACKAGE = ROOT / "harp_src"


def source_digest(package: Path = PACKAGE) -> str:
    """A short hash of every .py file of the package (path and bytes): which code computed a part."""
    h = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        h.update(str(path.relative_to(package)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:12]


def part_key(params: dict) -> str:
    """A short, stable name for a set of parameters (JSON-serialisable values)."""
    return hashlib.sha256(json.dumps(params, sort_keys=True, default=str).encode()).hexdigest()[:16]


def stored_part(notebook: str, params: dict, compute: Callable[[], object], reuse: bool,
                folder: Path | None = None) -> tuple[object, dict]:
    """`compute()`'s result for `params`, or the stored one when `reuse` is set and one exists.

    Every computed part is stored (atomically), so a later run can reuse it. Returns (part, provenance): provenance
    says whether it was reused, and the commit, source digest and parameters that made it.
    """
    path = (folder or PARTS / notebook) / f"{part_key(params)}.pkl"
    if reuse and path.exists():
        with path.open("rb") as f:
            stored = pickle.load(f)
        if stored["params"] == json.loads(json.dumps(params, default=str)):
            return stored["part"], stored["provenance"] | {"reused": True, "file": str(path)}
    provenance = {"commit": git_commit(), "source_digest": source_digest(), "reused": False}
    start = time.perf_counter()
    part = compute()
    provenance["seconds"] = time.perf_counter() - start  # the compute time, whatever session it ran in
    with atomic_path(path) as tmp, tmp.open("wb") as f:
        pickle.dump({"params": json.loads(json.dumps(params, default=str)), "part": part,
                     "provenance": provenance}, f)
    return part, provenance | {"file": str(path)}


def stored_step(notebook: str, key: dict, compute: Callable, reuse: bool, made: list) -> object:
    """One step of a part (a search, a point, a timing group), stored like a part under `.runs/parts/<notebook>/steps`
    so an interrupted run resumes at its first missing step; its provenance is appended to `made`."""
    value, provenance = stored_part(notebook, key, compute, reuse, PARTS / notebook / "steps")
    made.append(provenance)
    return value


def steps_summary(made: list[dict]) -> dict:
    """How a part's steps came about: how many, how many reused, their summed compute seconds (the part's cost even
    when it ran over several sessions), and the commits and source digests that made them (more than one: the part
    mixes code versions)."""
    return {"steps": len(made), "reused": sum(m["reused"] for m in made),
            "compute_seconds": sum(m.get("seconds", 0.0) for m in made),
            "made_by": sorted({f"{m['commit']}/{m['source_digest']}" for m in made})}
