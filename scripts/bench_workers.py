"""Benchmark: the steps of some studies run inline vs on a local Ray cluster of --workers workers, interleaved.

    python scripts/bench_workers.py --profile quick --only 06 09 [--workers 2] [--rounds 1]

Each round runs A B B A (A = inline, B = Ray), each into an empty store, after one warm-up of each; the times are
of the steps phase alone (what `--workers` changes: the notebooks then only read and plot), Ray's start included.
Prints both medians and the ratio inline / Ray. Take it on a quiet machine.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

from harp_src import runner
from harp_src.steps import context, executors
from harp_src.steps import graph as graph_mod


def cpu_name() -> str:
    """The CPU's model name (platform.processor() is empty on Linux)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def one_run(graph, executor: str, workers: int) -> float:
    """Seconds to compute every step of `graph` into an empty store."""
    with tempfile.TemporaryDirectory() as store:
        graph_mod.PARTS = Path(store)
        context.forget()  # inline keeps models between steps of one run, not between runs
        start = time.perf_counter()
        out = executors.run_steps(graph, reuse=False, executor=executor, workers=workers)
        seconds = time.perf_counter() - start
    if out.failed:
        raise RuntimeError(f"{executor}: {out.summary()}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default="quick")
    parser.add_argument("--only", nargs="+", default=["06", "09"])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1, help="A B B A rounds after the warm-up")
    parser.add_argument("--no-warmup", action="store_true")
    args = parser.parse_args()
    graph, _, _ = runner.study_graphs(args.profile, runner.select(args.only))
    print(f"{len(graph)} steps of {' '.join(args.only)} ({args.profile}); {os.cpu_count()} CPUs, "
          f"{cpu_name()}", flush=True)
    if not args.no_warmup:
        one_run(graph, "inline", args.workers)
        one_run(graph, "ray", args.workers)
    times = {"inline": [], "ray": []}
    for _ in range(args.rounds):
        for executor in ("inline", "ray", "ray", "inline"):
            times[executor].append(one_run(graph, executor, args.workers))
            print(f"  {executor}: {times[executor][-1]:.1f} s", flush=True)
    inline, ray = statistics.median(times["inline"]), statistics.median(times["ray"])
    print(f"median inline {inline:.1f} s, ray --workers {args.workers} {ray:.1f} s: inline / ray = {inline / ray:.2f}")


if __name__ == "__main__":
    main()
