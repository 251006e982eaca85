"""Batch runner: execute every notebook with a profile's parameters via papermill, keep going past failures.

    python -m harp_src.runner --profile quick|full|paper [--only 01 02] [--workers N | --ray-address ADDR]
    python -m harp_src.runner --plan --profile full [--workers K]

The studies declared as graphs of steps (03, 06–10: `harp_src.studies.graphs`) run their steps first, on the
executor: inline by default (the notebooks compute them, as always; no service), or on Ray with `--workers N` (a
local cluster started for this run) or `--ray-address ADDR` (an existing cluster). The notebooks then execute with
papermill and find every step stored by this run. `--plan` runs nothing: it prints the graph's steps, the critical
path and the wall time predicted on K workers.

A profile is the name of a file in notebooks/profiles/; an unknown name, a path, a malformed profile and an empty
--only are each refused in one line (exit 2) before anything runs.

Executed copies go to .runs/<profile>/ (git-ignored); a full-profile notebook that ran through is also written,
cleaned of run-to-run noise, to figures/notebooks/ beside its figures (a failed one leaves the committed copy as it
was). A summary table is printed; exit 1 if any failed.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
import uuid
from pathlib import Path

import papermill as pm
import yaml

from .report.executed import write_executed
from .report.files import ROOT
from .report.params import NOTEBOOKS, parameter_spec, parameters_source, profile_names
from .steps.executors import check_address, run_steps
from .steps.graph import RUN_ENV, Graph
from .steps.plan import notebook_seconds, plan_text
from .studies import graphs

PROFILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")
PLAN_WORKERS = (1, 2, 4, 8, 16, 32)
EXECUTOR_CHOICES = ("inline", "ray")


def load_profile(profile: str) -> dict:
    """A profile's blocks, checked: `profile` is the name of a file in notebooks/profiles/ (a name, not a path: a
    profile's outputs go to .runs/NAME/), holding valid YAML that maps `common` and notebook names to mappings of
    parameters. Anything else is one ValueError."""
    names = profile_names(NOTEBOOKS)
    if not isinstance(profile, str) or not PROFILE_NAME.fullmatch(profile) or profile not in names:
        raise ValueError(f"no profile {profile!r}: choose one of {names}; a profile is a name, not a path "
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


def study_graphs(profile: str, notebooks: list[Path]) -> tuple[Graph, list[str], list[object]]:
    """The steps of the selected notebooks that are graphs, under the profile's parameters (declared, nothing
    run), the notebooks that are not, and the studies' parameter objects."""
    known, graph, whole, params = graphs(), Graph(), [], []
    for path in notebooks:
        if path.stem not in known:
            whole.append(path.stem)
            continue
        cls, declare = known[path.stem]
        values = check_profile(path.stem, profile_parameters(profile, path.stem))
        p = cls.defaults(**values)
        graph.merge(declare(p)[0])
        params.append(p)
    return graph, whole, params


def check_devices(params: list, address: str | None) -> None:
    """Refuse a cuda profile where no GPU is: on this machine (inline, or a local Ray cluster), or in the cluster
    at `address`."""
    cuda = [p.NOTEBOOK for p in params if str(getattr(p, "device", "cpu")).startswith("cuda")]
    if not cuda or address:
        return
    import torch

    if not torch.cuda.is_available():
        raise ValueError(f"the profile puts {', '.join(cuda)} on DEVICE cuda, but this machine has no CUDA GPU "
                         "(torch.cuda.is_available() is False); run it on a GPU machine or a Ray cluster with GPUs "
                         "(--ray-address), or use a cpu profile")


def recorded_whole(notebooks: list[str], profile: str) -> dict[str, float]:
    """Seconds of the notebooks that are not graphs, for `--plan` (one step each): under the full profile, their
    last full run's wall time (figures/notebook_minutes.csv, the README's table); none under other profiles."""
    walls = notebook_seconds() if profile == "full" else {}
    return {nb: walls[nb] for nb in notebooks if nb in walls}


def run_graph_steps(graph: Graph, executor: str, workers: int | None, address: str | None,
                    threads: int | None = None) -> int:
    """Run every step on `executor` before the notebooks: 0, or 1 when some failed (reported; the rest stored)."""
    print(f"[steps] {len(graph)} steps on {executor}"
          + (f" ({address})" if address else f" ({workers} workers)" if workers else "")
          + (f", {threads} torch threads each" if threads else ""), flush=True)
    out = run_steps(graph, reuse=False, executor=executor, workers=workers, address=address, threads=threads)
    print(f"[steps] {out.summary()}", flush=True)
    return int(bool(out.failed))


def make_parser() -> argparse.ArgumentParser:
    """The runner's arguments."""
    parser = OneLineParser(prog="python -m harp_src.runner", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default="quick", help="a name in notebooks/profiles/: quick (CI sizes), full "
                        "(the study; writes figures/), paper (the paper's 7-9B models on cuda), ...")
    parser.add_argument("--only", nargs="+", default=None, metavar="NN", help="notebook number prefixes, e.g. 01 03")
    parser.add_argument("--executor", choices=EXECUTOR_CHOICES, default=None,
                        help="where the studies' steps run: inline (default) or ray (implied by --workers or "
                             "--ray-address)")
    parser.add_argument("--workers", type=int, default=None, metavar="N",
                        help="run the steps on a local Ray cluster of N workers; with --plan, predict for N")
    parser.add_argument("--ray-address", default=None, metavar="ADDR",
                        help="run the steps on an existing Ray cluster (e.g. ray://head:10001 or auto)")
    parser.add_argument("--threads", type=int, default=None, metavar="N",
                        help="torch threads of each step (and of the notebooks' kernels); default: inline uses all "
                             "CPUs, --workers N shares them. Numbers agree byte for byte only at equal threads")
    parser.add_argument("--plan", action="store_true", help="run nothing: print the graph, its critical path and "
                        "the predicted wall time on K workers (K = --workers, else 1, 2, 4, 8, 16 and 32)")
    return parser


def run_notebooks(notebooks: list[Path], profile: str, out_dir: Path) -> list[tuple]:
    """Execute each notebook with papermill: [(name, status, seconds, note)]; a full run's executed copies kept."""
    rows = []
    for path in notebooks:
        print(f"[{profile}] running {path.name} ...", flush=True)
        rows.append((path.name, *run_notebook(path, profile, out_dir)))
        if profile == "full" and rows[-1][1] == "ok":
            print(f"[full] executed copy: {write_executed(out_dir / path.name)}", flush=True)
        print(f"[{profile}] {path.name}: {rows[-1][1]} in {rows[-1][2] / 60:.1f} min", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    try:
        notebooks = select(args.only)
        load_profile(args.profile)  # refused now, not after the first notebook
        executor = check_executor(args)
        graph, whole, params = study_graphs(args.profile, notebooks)
        if not args.plan:
            check_devices(params, args.ray_address)
    except (ValueError, TypeError, ModuleNotFoundError) as err:
        print(f"{parser.prog}: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    if args.plan:
        print(f"[plan] profile {args.profile}: {len(graph)} steps in {len(notebooks) - len(whole)} studies; "
              f"{len(whole)} notebooks are not graphs and count as one step each")
        workers = [args.workers] if args.workers else list(PLAN_WORKERS)
        print(plan_text(graph, workers, recorded_whole(whole, args.profile), recorded=args.profile == "full"))
        return 0
    os.environ.setdefault(RUN_ENV, uuid.uuid4().hex[:12])  # the notebooks reuse what this run's steps stored
    print(f"[run] {RUN_ENV}={os.environ[RUN_ENV]}: run again with it set to reuse every step this run stored",
          flush=True)
    if args.threads:  # the notebooks' kernels inherit it; torch reads it when it starts
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    out_dir = ROOT / ".runs" / args.profile
    out_dir.mkdir(parents=True, exist_ok=True)
    failed_steps = 0
    if executor == "ray" and len(graph):
        try:
            failed_steps = run_graph_steps(graph, executor, args.workers, args.ray_address, args.threads)
        except ConnectionError as err:
            print(f"{parser.prog}: error: {' '.join(str(err).split())}", file=sys.stderr)
            return 2
    rows = run_notebooks(notebooks, args.profile, out_dir)
    width = max(len(r[0]) for r in rows)
    print(f"\n{'notebook'.ljust(width)}  status  minutes  note")
    for name, status, seconds, note in rows:
        print(f"{name.ljust(width)}  {status:6}  {seconds / 60:7.1f}  {note}")
    print(f"executed copies in {out_dir}")
    return int(any(r[1] != "ok" for r in rows) or failed_steps)


def check_executor(args) -> str:
    """The executor the arguments ask for, refused in one line where they disagree or are out of range."""
    if args.workers is not None and args.workers < 1:
        raise ValueError(f"--workers must be at least 1, got {args.workers}")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be at least 1, got {args.threads}")
    executor = args.executor or ("ray" if (args.workers or args.ray_address) else "inline")
    if executor == "inline" and (args.ray_address or (args.workers and not args.plan)):
        raise ValueError("--workers and --ray-address run the steps on Ray: drop --executor inline, or drop them")
    if args.workers and args.ray_address:
        raise ValueError("give --workers (a local Ray cluster) or --ray-address (an existing one), not both")
    if executor == "ray" and not args.plan:
        try:
            import ray  # noqa: F401
        except ImportError:
            raise ValueError("the ray executor needs Ray: pip install -r requirements/base.txt") from None
        if args.ray_address:
            try:
                check_address(args.ray_address)
            except ConnectionError as err:
                raise ValueError(str(err)) from None
    return executor


if __name__ == "__main__":
    sys.exit(main())
