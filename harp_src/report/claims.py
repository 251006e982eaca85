"""Claims that are checked: every number in a notebook's conclusion (its markdown cell tagged `conclusion`) must be
found, at the precision it is printed with, among the numbers its full run wrote to figures/ (the notebook's CSVs
and metrics), the results of the notebooks the conclusion names ("03", "in 05"), or the numbers that are not results
(its full-profile parameters, facts of its models and of the paper).

A printed number matches a recorded value v when v, or v in a usual unit, rounds to it: v, 100·v and 100·(v − 1)
(per cent, and a ratio as a per-cent change), v / 60 (seconds as minutes), v / 2^20 and v / 2^30 (bytes as MiB and
GiB), v / 10^3 and v / 10^6 (thousands, millions). Signs may be dropped ("drops by 0.11" for −0.11). Not checked:
numbers inside `code`, and names that contain digits (SmolLM2-135M, Gemma-3, top-8, 2k).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from .files import ROOT

CONCLUSION = "conclusion"  # the cell tag
NUMBER = re.compile(r"(?<![\w.])([−+-]?\d{1,3}(?:,\d{3})+|[−+-]?\d+(?:\.\d+)?)(?![\w])(\s?%)?")
# code, and names with digits: hyphenated (SmolLM2-135M, top-8, Gemma-3), letters then digits (Qwen2.5), 2k, 8-bit
NAMES = re.compile(r"`[^`]*`|\b[A-Za-z][\w.]*(?:-[\w.]+)+|\b\w*[A-Za-z][\w.]*\d[\w.]*|\b\d+[A-Za-z]\w*|"
                   r"\b\d+(?:-[A-Za-z]\w*)+")
NOTEBOOK_REF = re.compile(r"(?<![\w.,])(0[1-9])(?![\w.,%])")
UNITS = (lambda v: v, lambda v: 100 * v, lambda v: 100 * (v - 1), lambda v: v / 60, lambda v: v / 2**20,
         lambda v: v / 2**30, lambda v: v / 1e3, lambda v: v / 1e6)


@dataclass(frozen=True)
class Claim:
    """One printed number: its text, value, decimals printed, and whether a per-cent sign follows it."""

    text: str
    value: float
    decimals: int
    percent: bool


def claims_in(text: str) -> list[Claim]:
    """The numbers a conclusion prints (see the module docstring for what is skipped)."""
    text = NAMES.sub(" ", text)
    out = []
    for m in NUMBER.finditer(text):
        raw = m.group(1).replace("−", "-").replace(",", "")
        decimals = len(raw.split(".")[1]) if "." in raw else 0
        out.append(Claim(m.group(1), float(raw), decimals, bool(m.group(2))))
    return out


def numbers_of(obj) -> list[float]:
    """Every finite number in a JSON-like object (dicts, lists, scalars; bools excluded)."""
    if isinstance(obj, dict):
        return [x for v in obj.values() for x in numbers_of(v)]
    if isinstance(obj, (list, tuple)):
        return [x for v in obj for x in numbers_of(v)]
    if isinstance(obj, (int, float)) and not isinstance(obj, bool) and math.isfinite(obj):
        return [float(obj)]
    return []


def recorded_values(prefix: str, figures: Path = ROOT / "figures") -> list[float]:
    """The numbers notebook `prefix` ("06") wrote: every numeric cell of its CSVs and every metric it recorded."""
    values = []
    for path in sorted(figures.glob(f"{prefix}_*.csv")):
        table = pd.read_csv(path)
        for column in table.columns:
            values += pd.to_numeric(table[column], errors="coerce").dropna().tolist()
    for path in sorted(figures.glob(f"{prefix}_*metrics.json")):
        values += numbers_of(json.loads(path.read_text()).get("metrics", {}))
    return values


def matches(claim: Claim, values: list[float]) -> bool:
    """Whether some value, in some usual unit, rounds to the claim at its printed precision (sign optional)."""
    units = UNITS[1:3] if claim.percent else UNITS
    target = abs(claim.value)
    return any(abs(round(abs(u(v)), claim.decimals) - target) < 10 ** -(claim.decimals + 3)
               for v in values for u in units)


def unmatched_claims(text: str, prefix: str, known: list[float], figures: Path = ROOT / "figures") -> list[str]:
    """The numbers of a conclusion found in none of the results it may quote (empty: every claim is backed).

    Args:
        known: numbers that are not results: the notebook's parameters, facts of its models (depth, heads,
            vocabulary) and of the paper.
    """
    values = recorded_values(prefix, figures) + list(known)
    for other in sorted(set(NOTEBOOK_REF.findall(text)) - {prefix}):
        values += recorded_values(other, figures)
    return [c.text + ("%" if c.percent else "") for c in claims_in(text) if not matches(c, values)]


def conclusion_cells(notebook: dict) -> list[str]:
    """The text of a notebook's cells tagged `conclusion` (a notebook as JSON)."""
    return ["".join(c["source"]) for c in notebook["cells"]
            if c["cell_type"] == "markdown" and CONCLUSION in c.get("metadata", {}).get("tags", [])]
