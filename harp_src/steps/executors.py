"""Where a graph's steps run: `inline` (this process, in order; the default, no service) or `ray` (a local Ray
cluster of N workers, or an existing cluster by address). Both store every result in the same place, under the
same id, so a notebook finds a step whichever executor computed it, and a rerun computes only what is missing.

Ray schedules the graph itself: each missing step is one task whose inputs are its needs' task results, with the
resources the step declares (CPUs = its torch threads, a GPU on cuda, memory from the model's size). A timing step
asks for every CPU of the largest node, so nothing else runs beside it. A step that fails, by an exception or by its
worker being killed (the OOM killer), is retried once, then reported; every step that does not need it still runs.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable
from dataclasses import dataclass, field

from tqdm.auto import tqdm

from . import context
from .graph import RUN_ENV, Graph, Step, compute, save, stored

EXECUTORS = ("inline", "ray")
RETRIES = 1  # a failed step is tried once more, then reported


@dataclass
class Outcome:
    """What running a graph did: results by step id, and the ids computed, reused and failed (with why)."""

    results: dict = field(default_factory=dict)
    provenance: dict = field(default_factory=dict)
    computed: list = field(default_factory=list)
    reused: list = field(default_factory=list)
    failed: dict = field(default_factory=dict)

    def summary(self) -> str:
        return (f"{len(self.computed)} computed, {len(self.reused)} stored already, {len(self.failed)} failed"
                + "".join(f"\n  failed: {why}" for why in list(self.failed.values())[:10]))


def _inputs(step: Step, results: dict) -> dict:
    return {name: results[i] for name, i in step.needs.items()}


def run_inline(graph: Graph, reuse: bool, desc: str = "steps", threads: int | None = None) -> Outcome:
    """Every step in declaration order, in this process; a failure raises (as a notebook cell does)."""
    out = Outcome()
    for step in tqdm(list(graph), desc=desc):
        found, result, provenance = stored(step, reuse)
        if not found:
            result, provenance = compute(step, _inputs(step, out.results), threads)
            provenance = save(step, result, provenance)
            out.computed.append(step.id)
        else:
            out.reused.append(step.id)
        out.results[step.id], out.provenance[step.id] = result, provenance
    return out


def _remote_body(spec: dict, threads: int, **inputs):
    """A Ray task: rebuild the step from its fields and compute it with its CPUs as torch threads."""
    try:
        return compute(Step(**spec), inputs, threads)
    finally:
        context.release()  # a reused worker keeps no model the scheduler no longer counts, but a small one


def check_address(address: str, timeout: float = 5.0) -> None:
    """Refuse, in one line and before any work, a Ray address whose head does not answer (host:port, ray://host:port;
    "auto" is left to Ray, which finds a cluster started on this machine)."""
    if address == "auto":
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--ray-address {address!r} is not HOST:PORT, ray://HOST:PORT or auto")
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as err:
        raise ConnectionError(f"no Ray cluster answers at --ray-address {address} ({err.strerror or err}); start "
                              "one with `ray start --head` there, or check the address") from None


def start_ray(workers: int | None = None, address: str | None = None, threads: int | None = None):
    """Connect to the cluster at `address`, or start a local one for `workers` steps side by side (each with
    `threads` CPUs, by default this machine's CPUs shared among them)."""
    import ray

    if address:
        check_address(address)
        try:
            ray.init(address=address, log_to_driver=False, include_dashboard=False)
        except (ConnectionError, RuntimeError, ValueError) as err:
            why = " ".join(str(err).split())[:160]
            raise ConnectionError(f"no Ray cluster answers at --ray-address {address} ({why}); start one with "
                                  "`ray start --head` or check the address") from None
    else:
        # the workers see the repository as the driver does; RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO quiets a warning
        os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
        ray.init(num_cpus=max(1, workers or 1) * (threads or per_worker(workers)), include_dashboard=False,
                 log_to_driver=False,
                 runtime_env={"env_vars": {k: v for k, v in os.environ.items()
                                           if k.startswith(("HARP_", "HF_", "PYTHONPATH", "OMP_"))}})
    return ray


def per_worker(workers: int | None) -> int:
    """CPUs (torch threads) of each of `workers` steps side by side on this machine."""
    return max(1, (os.cpu_count() or 1) // max(1, workers or 1))


def node_cpus(ray) -> int:
    """The CPUs of the largest node: what a step that must run alone asks for."""
    return int(max(n["Resources"].get("CPU", 1) for n in ray.nodes() if n.get("Alive")))


def run_ray(graph: Graph, reuse: bool, workers: int | None = None, address: str | None = None,
            desc: str = "steps", threads: int | None = None) -> Outcome:
    """Every missing step as a Ray task (dependencies as task inputs), each result stored here as it arrives.
    `threads`: each step's CPUs (torch threads); by default a local cluster's CPUs shared by its workers. Where the
    caller has Ray open already, its session is used (`workers` and `address` are then the caller's) and stays open."""
    import ray

    ours = not ray.is_initialized()  # a session the caller opened (ray.init) is used and left open
    if ours:
        start_ray(workers, address, threads)
    try:
        return _submit_all(ray, graph, reuse, desc, threads or (None if address else per_worker(workers)))
    finally:
        if ours:
            ray.shutdown()


def _options(step: Step, whole_node: int, per_step: int | None) -> dict:
    cpus = whole_node if step.alone else max(1, min(per_step or step.cpus, whole_node))
    return {"num_cpus": cpus, "num_gpus": step.gpus, "memory": step.memory or None, "max_retries": RETRIES,
            "retry_exceptions": True, "name": step.label or step.fn}


def _submit_all(ray, graph: Graph, reuse: bool, desc: str, per_step: int | None) -> Outcome:
    out = Outcome()
    body = ray.remote(_remote_body)
    whole_node = node_cpus(ray)
    refs, pending = {}, {}
    for step in graph:
        found, result, provenance = stored(step, reuse)
        if found:
            out.reused.append(step.id)
            out.results[step.id], out.provenance[step.id] = result, provenance
            refs[step.id] = result
            continue
        options = _options(step, whole_node, per_step)
        threads = options["num_cpus"]
        inputs = {name: refs[i] for name, i in step.needs.items()}
        # two returns: dependents get the result alone (Ray resolves top-level refs), the driver its provenance too
        ref, made = body.options(num_returns=2, **options).remote(_fields(step), threads, **inputs)
        refs[step.id], pending[ref] = ref, (step, made)
    bar = tqdm(total=len(pending), desc=desc)
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1)
        step, made = pending.pop(done[0])
        try:
            result, provenance = ray.get([done[0], made])
        except Exception as err:  # a failed step is reported; the steps that do not need it go on
            out.failed[step.id] = f"{step.label or step.fn}: {_reason(err)}"
        else:
            provenance["run"] = os.environ.get(RUN_ENV, "")  # this run's, wherever the worker ran
            out.provenance[step.id] = save(step, result, provenance)
            out.results[step.id] = result
            out.computed.append(step.id)
        bar.update()
    bar.close()
    return out


def _fields(step: Step) -> dict:
    return {k: getattr(step, k) for k in ("notebook", "fn", "key", "needs", "label", "cpus", "gpus", "memory",
                                           "alone", "size")}


def _reason(err: Exception) -> str:
    """The last line of a Ray error (the step's own exception, or why its worker died)."""
    lines = [line for line in str(err).strip().splitlines() if line.strip()]
    return lines[-1][:200] if lines else type(err).__name__


def run_steps(graph: Graph, reuse: bool, executor: str = "inline", workers: int | None = None,
              address: str | None = None, threads: int | None = None) -> Outcome:
    """Run `graph` on `executor` (see the module docstring); stored steps are reused with `reuse`, or when this run
    stored them. `threads`: torch threads per step (inline: this process's, unchanged when None)."""
    desc = " ".join(sorted({step.notebook[:2] for step in graph})) + " steps"  # the progress bar's: "06 09 steps"
    if executor == "inline":
        return run_inline(graph, reuse, desc, threads)
    if executor == "ray":
        return run_ray(graph, reuse, workers, address, desc, threads)
    raise ValueError(f"unknown executor {executor!r}: choose one of {', '.join(EXECUTORS)}")


def results_of(graph: Graph, ids: Iterable[str], outcome: Outcome) -> list:
    """The results of `ids`, in order."""
    return [outcome.results[i] for i in ids]
