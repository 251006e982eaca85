"""Where results go, what is recorded with them (versions, seed, commit), and notebook parameter checks."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path

import pandas as pd
import torch
import transformers

from .files import ROOT, atomic_path, write_json


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
