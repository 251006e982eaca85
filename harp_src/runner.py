"""Batch runner: execute every notebook with a profile's parameters via papermill, keep going past failures.

    python -m harp_src.runner --profile quick|full [--only 01 02]

Executed copies go to .runs/<profile>/ (git-ignored); a full-profile notebook that ran through is also written,
cleaned of run-to-run noise, to figures/notebooks/ beside its figures (a failed one leaves the committed copy as it
was). A summary table is printed; exit 1 if any failed.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import papermill as pm
import yaml

from .report.executed import write_executed
from .report.files import ROOT
from .report.params import NOTEBOOKS, parameter_spec, parameters_source


def profile_parameters(profile: str, notebook: str) -> dict:
    """Parameters for one notebook: the profile's `common` block, then its per-notebook block."""
    path = NOTEBOOKS / "profiles" / f"{profile}.yaml"
    if not path.exists():
        names = sorted(p.stem for p in (NOTEBOOKS / "profiles").glob("*.yaml"))
        raise SystemExit(f"no profile '{profile}': choose one of {names}")
    spec = yaml.safe_load(path.read_text()) or {}
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default="quick", help="quick (CI sizes) or full (the study; writes figures/)")
    parser.add_argument("--only", nargs="*", default=None, help="notebook number prefixes, e.g. 01 03")
    args = parser.parse_args(argv)
    notebooks = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
    if args.only:
        notebooks = [p for p in notebooks if p.name[:2] in args.only]
        if not notebooks:
            raise SystemExit(f"no notebook matches --only {args.only}")
    profile_parameters(args.profile, "")  # fail fast on an unknown profile
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
