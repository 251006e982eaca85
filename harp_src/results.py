"""Where results go, what is recorded with them (versions, seed, commit), and notebook parameter checks."""

from __future__ import annotations

import ast
import json
import os
import platform
import subprocess
import types
import typing
from pathlib import Path

import pandas as pd
import torch
import transformers

from .files import atomic_path, write_json
from .models import ROOT

PROFILES = ("quick", "full")


def output_dir(profile: str, override: str | os.PathLike = "") -> Path:
    """figures/ for the full profile; a scratch folder outside git (.runs/<profile>/figures) otherwise.

    Tests pass `override` so a run never overwrites committed results.
    """
    if override:
        path = Path(override)
    elif profile == "full":
        path = ROOT / "figures"
    else:
        path = ROOT / ".runs" / profile / "figures"
    path.mkdir(parents=True, exist_ok=True)
    return path


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=5)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def run_info(seed: int, device: str = "cpu") -> dict:
    """Versions, device, seed and commit: printed by every notebook and stored with its metrics."""
    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "device": device if device == "cpu" or not torch.cuda.is_available() else torch.cuda.get_device_name(),
        "threads": torch.get_num_threads(),
        "seed": seed,
        "commit": git_commit(),
    }


def record_metrics(name: str, metrics: dict, out_dir: str | Path, info: dict, models: list[dict]) -> Path:
    """Write out_dir/name_metrics.json: headline numbers (metric name -> value) plus provenance.

    Tests read this file back and compare each metric with its own tolerance.
    """
    path = Path(out_dir) / f"{name}_metrics.json"
    write_json(path, {"metrics": metrics, "run": info, "models": models})
    return path


def save_table(table: pd.DataFrame, name: str, out_dir: str | Path) -> Path:
    """Write out_dir/name.csv atomically, numbers as save_figure writes them (a table that has no figure)."""
    path = Path(out_dir) / f"{name}.csv"
    with atomic_path(path) as tmp:
        table.to_csv(tmp, index=False, float_format="%.6g")
    return path


def read_metrics(name: str, out_dir: str | Path) -> dict:
    return json.loads((Path(out_dir) / f"{name}_metrics.json").read_text())["metrics"]


# ---------------------------------------------------------------------------------------------- notebook parameters
NOTEBOOKS = ROOT / "notebooks"


def parameters_source(notebook: str) -> str:
    """The source of the cell tagged `parameters` in notebooks/<notebook>.ipynb."""
    path = NOTEBOOKS / f"{notebook}.ipynb"
    if not path.exists():
        raise FileNotFoundError(f"no notebook {path}: pass the name of a notebook in notebooks/, without .ipynb")
    cells = json.loads(path.read_text())["cells"]
    tagged = [c for c in cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    if len(tagged) != 1:
        raise ValueError(f"{path.name} must have exactly one cell tagged 'parameters', found {len(tagged)}")
    source = tagged[0]["source"]
    return "".join(source) if isinstance(source, list) else source


def kinds_of_type(tp) -> tuple:
    """A type expression (`int`, `int | dict | None`, `list[str]`) -> accepted kinds; a kind is a type or
    ("list", element kinds)."""
    if isinstance(tp, types.UnionType):
        return tuple(k for arg in typing.get_args(tp) for k in kinds_of_type(arg))
    if typing.get_origin(tp) is list:
        return (("list", kinds_of_type(typing.get_args(tp)[0])),)
    if tp is None:
        return (type(None),)
    if isinstance(tp, type):
        return (tp,)
    raise TypeError(f"{tp!r} is not a type: use e.g. int, int | dict | None or list[str]")


def _kinds_of_default(value) -> tuple:
    """The kinds a default admits: its own type (an int where the default is a float), a list of its elements'."""
    if isinstance(value, bool):
        return (bool,)
    if isinstance(value, float):
        return (float, int)
    if isinstance(value, (list, tuple)):
        elements = tuple(dict.fromkeys(k for v in value for k in _kinds_of_default(v)))
        return (("list", elements),)
    return (type(value),)


def parameter_spec(source: str, **types_: object) -> dict[str, tuple]:
    """{NAME: accepted kinds} for each assignment of a parameters cell: the type of its default, or the type given
    for it in `types_` where the default alone does not say (`LIMIT=int | dict`, `EXTRA_CSV=list[str]`)."""
    spec = {}
    for stmt in ast.parse(source).body:
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            spec[stmt.targets[0].id] = _kinds_of_default(ast.literal_eval(stmt.value))
    unknown = set(types_) - set(spec)
    if unknown:
        raise ValueError(f"types given for {sorted(unknown)}, which the parameters cell does not set")
    return spec | {name: kinds_of_type(tp) for name, tp in types_.items()}


def _matches(value, kind) -> bool:
    if isinstance(kind, tuple):  # ("list", element kinds); no element kinds: any elements
        return isinstance(value, (list, tuple)) and (not kind[1] or all(
            any(_matches(v, k) for k in kind[1]) for v in value))
    if kind in (int, float) and isinstance(value, bool):
        return False
    return isinstance(value, kind)


def _describe(kinds: tuple) -> str:
    names = [f"a list of {' or '.join(_describe((e,)) for e in k[1]) or 'values'}" if isinstance(k, tuple)
             else "None" if k is type(None) else k.__name__ for k in kinds]
    return " or ".join(names)


def check_values(values: dict, spec: dict[str, tuple]) -> None:
    """Raise one clear error naming every value whose type `spec` (from parameter_spec) does not admit."""
    problems = [f"{name}={values[name]!r} must be {_describe(kinds)}" for name, kinds in spec.items()
                if name in values and not any(_matches(values[name], k) for k in kinds)]
    if problems:
        raise TypeError("bad notebook parameter: " + "; ".join(problems))
    if "PROFILE" in values and values["PROFILE"] not in PROFILES:
        raise ValueError(f"PROFILE={values['PROFILE']!r}: choose one of {PROFILES}")


def check_parameters(notebook: str, namespace: dict, **types_: object) -> None:
    """Fail a notebook's first code cell with one clear message when a (papermill) parameter has the wrong type.

    Args:
        notebook: the notebook's name in notebooks/ (e.g. "01_over_smoothing"); its parameters cell's defaults give
            the expected types.
        namespace: the notebook's `globals()`, holding the parameters' current values.
        types_: the type of a parameter whose default does not say it all, e.g. `LIMIT=int | dict`.
    """
    spec = parameter_spec(parameters_source(notebook), **types_)
    check_values({name: namespace[name] for name in spec if name in namespace}, spec)
