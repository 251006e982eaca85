"""Where results go, what is recorded with them (versions, seed, commit), and notebook parameter checks."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import tempfile
from pathlib import Path

import torch

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
    import transformers

    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "device": device if device == "cpu" or not torch.cuda.is_available() else torch.cuda.get_device_name(),
        "threads": torch.get_num_threads(),
        "seed": seed,
        "commit": git_commit(),
    }


def write_json(path: Path, obj) -> None:
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".json")
    with os.fdopen(fd, "w") as handle:
        json.dump(obj, handle, indent=1, default=str)
        handle.write("\n")
    os.replace(tmp, path)


def record_metrics(name: str, metrics: dict, out_dir: str | Path, info: dict, models: list[dict]) -> Path:
    """Write out_dir/name_metrics.json: headline numbers (metric name -> value) plus provenance.

    Tests read this file back and compare each metric with its own tolerance.
    """
    path = Path(out_dir) / f"{name}_metrics.json"
    write_json(path, {"metrics": metrics, "run": info, "models": models})
    return path


def read_metrics(name: str, out_dir: str | Path) -> dict:
    return json.loads((Path(out_dir) / f"{name}_metrics.json").read_text())["metrics"]


def check_parameters(**params) -> None:
    """Fail on the first cell with one clear message when a papermill parameter has the wrong type.

    Each keyword is NAME=(value, expected type or tuple of types); lists are checked element-wise via
    (value, list, element type).
    """
    problems = []
    for name, spec in params.items():
        value, kind = spec[0], spec[1]
        if kind is list:
            if not isinstance(value, (list, tuple)) or not all(isinstance(v, spec[2]) for v in value):
                problems.append(f"{name}={value!r} must be a list of {spec[2].__name__}")
        elif isinstance(value, bool) and kind in (int, float):
            problems.append(f"{name}={value!r} must be {kind.__name__}, not bool")
        elif not isinstance(value, kind):
            names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
            problems.append(f"{name}={value!r} must be {names}")
    if problems:
        raise TypeError("bad notebook parameter: " + "; ".join(problems))
    profile = params.get("PROFILE", (None,))[0]
    if profile is not None and profile not in PROFILES:
        raise ValueError(f"PROFILE={profile!r}: choose one of {PROFILES}")
