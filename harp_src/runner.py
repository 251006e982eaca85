"""Batch runner: execute every notebook with a profile's parameters via papermill, keep going past failures.

    python -m harp_src.runner --profile quick|full [--only 01 02]

A profile is the name of a file in notebooks/profiles/; an unknown name, a path, a malformed profile and an empty
--only are each refused in one line (exit 2) before anything runs.

Executed copies go to .runs/<profile>/ (git-ignored); a full-profile notebook that ran through is also written,
cleaned of run-to-run noise, to figures/notebooks/ beside its figures (a failed one leaves the committed copy as it
was). A summary table is printed; exit 1 if any failed.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

import papermill as pm
import yaml

from .report.executed import write_executed
from .report.files import ROOT
from .report.params import NOTEBOOKS, parameter_spec, parameters_source

PROFILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")


def profile_names() -> list[str]:
    return sorted(p.stem for p in (NOTEBOOKS / "profiles").glob("*.yaml"))


def load_profile(profile: str) -> dict:
    """A profile's blocks, checked: `profile` is the name of a file in notebooks/profiles/ (a name, not a path: a
    profile's outputs go to .runs/NAME/), holding valid YAML that maps `common` and notebook names to mappings of
    parameters. Anything else is one ValueError."""
    if not isinstance(profile, str) or not PROFILE_NAME.fullmatch(profile) or profile not in profile_names():
        raise ValueError(f"no profile {profile!r}: choose one of {profile_names()}; a profile is a name, not a path "
                         "(add your own as notebooks/profiles/NAME.yaml)")
    path = NOTEBOOKS / "profiles" / f"{profile}.yaml"
    try:
        spec = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ValueError(f"profile {path} is not valid YAML{where} ({getattr(err, 'problem', None) or err}); "
                         "fix its syntax") from None
    spec = {} if spec is None else spec
    if not isinstance(spec, dict):
        raise ValueError(f"profile {path} must map `common` and notebook names to parameters, not be a "
                         f"{type(spec).__name__}")
    notebooks = {p.stem for p in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb")}
    for key, block in spec.items():
        if key != "common" and key not in notebooks:
            raise ValueError(f"profile {path}: {key!r} is neither `common` nor a notebook's name, e.g. "
                             f"{min(notebooks)!r}")
        if not isinstance(block, dict) or not all(isinstance(name, str) for name in block):
            raise ValueError(f"profile {path}: `{key}` must map parameter names to values, not be {block!r:.60}")
    return spec


def profile_parameters(profile: str, notebook: str) -> dict:
    """Parameters for one notebook: the profile's `common` block, then its per-notebook block."""
    spec = load_profile(profile)
    return {"PROFILE": profile, **spec.get("common", {}), **spec.get(notebook, {})}


def check_profile(notebook: str, values: dict) -> dict:
    """Refuse a profile that sets a parameter the notebook's parameters cell does not have (a typo would otherwise
    be injected, ignored, and found hours later)."""
    known = parameter_spec(parameters_source(notebook))
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ValueError(f"the profile sets {unknown[0]!r}, which notebook {notebook} has no parameter of; its "
                         f"parameters are {sorted(known)}")
    return values


def run_notebook(path: Path, profile: str, out_dir: Path) -> tuple[str, float, str]:
    start = time.time()
    try:
        parameters = check_profile(path.stem, profile_parameters(profile, path.stem))
        pm.execute_notebook(str(path), str(out_dir / path.name), parameters=parameters,
                            cwd=str(NOTEBOOKS), progress_bar=False, request_save_on_cell_execute=True)
        return "ok", time.time() - start, ""
    except Exception as err:  # one failed notebook must not lose the others
        return "FAILED", time.time() - start, str(err).strip().splitlines()[-1][:160] if str(err) else repr(err)


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (exit 2), as the runner's own refusals are."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def select(only: list[str] | None) -> list[Path]:
    """The notebooks to run: all, or those whose number prefix `only` names."""
    notebooks = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
    if only is None or not notebooks:
        return notebooks
    unknown = [prefix for prefix in only if prefix not in {p.name[:2] for p in notebooks}]
    if unknown:
        raise ValueError(f"no notebook matches --only {' '.join(unknown)}; give number prefixes such as 02 06 "
                         f"(there are {notebooks[0].name[:2]} to {notebooks[-1].name[:2]})")
    return [p for p in notebooks if p.name[:2] in only]


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m harp_src.runner", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default="quick", help="quick (CI sizes) or full (the study; writes figures/)")
    parser.add_argument("--only", nargs="+", default=None, metavar="NN", help="notebook number prefixes, e.g. 01 03")
    args = parser.parse_args(argv)
    try:
        notebooks = select(args.only)
        load_profile(args.profile)  # refused now, not after the first notebook
    except ValueError as err:
        print(f"{parser.prog}: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    out_dir = ROOT / ".runs" / args.profile
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for path in notebooks:
        print(f"[{args.profile}] running {path.name} ...", flush=True)
        rows.append((path.name, *run_notebook(path, args.profile, out_dir)))
        if args.profile == "full" and rows[-1][1] == "ok":
            print(f"[full] executed copy: {write_executed(out_dir / path.name)}", flush=True)
        print(f"[{args.profile}] {path.name}: {rows[-1][1]} in {rows[-1][2] / 60:.1f} min", flush=True)
    width = max(len(r[0]) for r in rows)
    print(f"\n{'notebook'.ljust(width)}  status  minutes  note")
    for name, status, seconds, note in rows:
        print(f"{name.ljust(width)}  {status:6}  {seconds / 60:7.1f}  {note}")
    print(f"executed copies in {out_dir}")
    return int(any(r[1] != "ok" for r in rows))


if __name__ == "__main__":
    sys.exit(main())
