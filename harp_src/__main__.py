"""Command line: `python -m harp_src prune|search|ppl|timing ...`, each printing one JSON object.

    python -m harp_src prune --model smollm2-135m --layers top:8 --alphas 1.0 --out plan.json [--ppl] [--save DIR]
    python -m harp_src search --model smollm2-135m --layers top:8 --out plan.json [--compare-naive] [--save DIR]
    python -m harp_src ppl --model smollm2-135m [--plan plan.json] [--corpus lee]
    python -m harp_src timing --model smollm2-135m --layers top:8 --seq-lens 1024,4096,16384 [--csv rows.csv]
    python -m harp_src evalbench --model smollm2-135m --tasks arc_easy --limit 200 [--fewshot 0] [--threads 2]
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time

from .checkpoints import save_checkpoint
from .data import ppl_windows
from .evalbench import bench_task, check_task
from .evaluate import perplexity
from .files import atomic_path
from .flops import search_flops
from .harp import HarpPlan, apply_harp, param_report, parse_layers
from .models import fingerprint, get_adapter, load_model, model_info
from .paper import llama31_8b_config
from .results import run_info
from .search import GRID, benchmark_search, search_alphas
from .timing import compare, harp_copy


def parse_alphas(text: str, layers: list[int]) -> float | dict[int, float]:
    """'0.5' (one α for all layers) or '22=0.5,23=0.3' (per layer)."""
    if "=" not in text:
        return float(text)
    pairs = (item.split("=") for item in text.split(",") if item)
    return {int(k): float(v) for k, v in pairs}


def _windows_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--corpus", default="enwiki", choices=["enwiki", "lee"])
    p.add_argument("--n-windows", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=4)


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="packaged name, local dir or Hub id")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")


def _ppl(model, tok, args) -> float:
    windows = ppl_windows(tok, args.corpus, "test", args.n_windows, args.seq_len, args.seed)
    return perplexity(model, windows, args.batch_size)


def cmd_prune(args) -> dict:
    model, tok = load_model(args.model, dtype=args.dtype, device=args.device)
    layers = parse_layers(args.layers, get_adapter(model).n_layers)
    out = {"model": model_info(model), "layers": layers}
    if args.ppl:
        out["ppl_before"] = _ppl(model, tok, args)
    plan = apply_harp(model, layers, parse_alphas(args.alphas, layers), fold=not args.no_fold,
                      meta={"source": "cli prune", "model_id": model.harp_source["model_id"]})
    out |= {"alphas": plan.alphas, **param_report(model.config, plan)}
    if args.ppl:
        out |= {"ppl_after": _ppl(model, tok, args), "corpus": f"{args.corpus}/test",
                "n_windows": args.n_windows, "seq_len": args.seq_len, "seed": args.seed}
    if args.out:
        plan.to_json(args.out)
        out["plan"] = args.out
    if args.save:
        out["checkpoint"] = save_checkpoint(model, args.save, tok)
    return out


def cmd_ppl(args) -> dict:
    model, tok = load_model(args.model, dtype=args.dtype, device=args.device)
    out = {"model": model_info(model)}
    if args.plan:
        plan = HarpPlan.from_json(args.plan)
        plan.apply(model)
        out["plan"] = plan.to_dict()
    return out | {"ppl": _ppl(model, tok, args), "corpus": f"{args.corpus}/test", "n_windows": args.n_windows,
                  "seq_len": args.seq_len, "seed": args.seed, "metric": "perplexity = exp(mean token NLL)"}


def cmd_search(args) -> dict:
    model, tok = load_model(args.model, dtype=args.dtype, device=args.device)
    layers = parse_layers(args.layers, get_adapter(model).n_layers)
    grid = tuple(float(a) for a in args.grid.split(",")) if args.grid else GRID
    calib = ppl_windows(tok, args.corpus, "train", args.n_windows, args.seq_len, args.seed)
    out = {"model": model_info(model), "layers": layers, "calib": f"{args.corpus}/train", "n_windows": args.n_windows,
           "seq_len": args.seq_len, "seed": args.seed}
    if args.compare_naive:  # cached and naive candidate evaluations interleaved (A B, B A, ...), fixed threads
        bench = benchmark_search(model, calib, layers, grid, args.batch_size, args.threads)
        alphas, history = bench.pop("alphas"), bench.pop("history")
        llama = search_flops(llama31_8b_config(), list(range(24, 32)), len(grid), args.seq_len)  # paper: top-8
        out |= {**bench, "search_s": bench["cached_s"], "llama31_8b_flop_ratio": llama["predicted_ratio"],
                "llama31_8b_layers": "top:8"}
    else:
        history = []
        start = time.perf_counter()
        alphas = search_alphas(model, calib, layers, grid, batch_size=args.batch_size, history=history)
        out["search_s"] = time.perf_counter() - start
    out |= {"alphas": alphas, "calib_ppl": {f"{r['layer']}@{r['alpha']:g}": round(r["calib_ppl"], 4) for r in history}}
    plan = HarpPlan(fingerprint(model.config), alphas,
                    meta={"source": "greedy α search", "model_id": model.harp_source["model_id"],
                          "calib": f"{args.corpus}/train {args.n_windows}x{args.seq_len} seed {args.seed}",
                          "grid": list(grid)})
    if args.out:
        plan.to_json(args.out)
        out["plan"] = args.out
    if args.save:
        plan.apply(model)  # the search left the model dense
        out["checkpoint"] = save_checkpoint(model, args.save, tok)
    return out


def cmd_timing(args) -> dict:
    seq_lens = [int(t) for t in args.seq_lens.split(",") if t.strip()]
    if not seq_lens or min(seq_lens) < 2:
        raise ValueError(f"--seq-lens must be comma-separated lengths >= 2, got {args.seq_lens!r} (seq_lens)")
    model, _ = load_model(args.model, dtype=args.dtype, device=args.device)
    if args.plan:  # e.g. the searched α's from `search --out`; refused if made for another model
        plan = HarpPlan.from_json(args.plan)
        harp = copy.deepcopy(model)
        plan.apply(harp)
    else:
        layers = parse_layers(args.layers, get_adapter(model).n_layers)
        harp, plan = harp_copy(model, layers, parse_alphas(args.alphas, layers))
    summary, _ = compare(model, harp, seq_lens, args.repeats, args.warmup, args.decode_steps, args.threads,
                         args.seed)
    summary.insert(0, "model", args.model)
    if args.csv:
        with atomic_path(args.csv) as tmp:
            summary.to_csv(tmp, index=False)
    return {"model": model_info(model), "plan": plan.to_dict(), "info": run_info(args.seed, args.device),
            "rows": summary.astype(object).where(summary.notna(), None).to_dict(orient="records")}  # NaN -> null


def cmd_evalbench(args) -> dict:
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    for task in tasks:  # refuse an unknown task before the model loads
        check_task(task)
    model, tok = load_model(args.model, dtype=args.dtype, device=args.device)
    rows = [bench_task(model, tok, task, args.limit, args.fewshot, args.repeats, args.warmup, args.threads)
            for task in tasks]
    return {"model": model_info(model), "info": run_info(0, args.device), "rows": rows}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m harp_src", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    prune = sub.add_parser("prune", help="apply HARP to a model, print savings (and PPL), save the plan")
    _model_args(prune)
    prune.add_argument("--layers", required=True, help="top:N, bottom:N, a-b or a,b,c (0-based)")
    prune.add_argument("--alphas", default="1.0", help="one α for all layers, or 22=0.5,23=0.3")
    prune.add_argument("--no-fold", action="store_true", help="keep the repeat and α outside the weights")
    prune.add_argument("--ppl", action="store_true", help="also measure test PPL before and after")
    prune.add_argument("--out", help="write the plan (JSON) here")
    prune.add_argument("--save", help="write the pruned model here as a checkpoint (from_pretrained loads it)")
    _windows_args(prune)
    prune.set_defaults(func=cmd_prune)
    search = sub.add_parser("search", help="greedy top-down α search on enwiki-train windows; save the plan")
    _model_args(search)
    search.add_argument("--layers", required=True, help="top:N, bottom:N, a-b or a,b,c (0-based)")
    search.add_argument("--grid", help="comma-separated α values (default 0.0,0.1,...,1.0)")
    search.add_argument("--compare-naive", action="store_true",
                        help="benchmark: cached and naive candidate evaluations interleaved (A B, B A); "
                             "times, ratio, FLOP ratio, same_alphas")
    search.add_argument("--threads", type=int, default=2, help="torch intra-op threads, fixed for both (benchmark)")
    search.add_argument("--out", help="write the plan (JSON) here")
    search.add_argument("--save", help="write the model pruned with the searched α's here as a checkpoint")
    _windows_args(search)
    search.set_defaults(func=cmd_search)
    ppl = sub.add_parser("ppl", help="test perplexity of a model, optionally with a saved plan applied")
    _model_args(ppl)
    ppl.add_argument("--plan", help="a plan JSON from `prune`")
    _windows_args(ppl)
    ppl.set_defaults(func=cmd_ppl)
    timing = sub.add_parser("timing", help="prefill/decode latency, KV bytes and peak memory, dense vs HARP, "
                                           "interleaved, with the FLOP-model bound")
    _model_args(timing)
    timing.add_argument("--layers", default="top:8", help="top:N, bottom:N, a-b or a,b,c (0-based)")
    timing.add_argument("--alphas", default="1.0", help="one α for all layers, or 22=0.5,23=0.3 (0 drops V, O too)")
    timing.add_argument("--plan", help="a plan JSON (from `search` or `prune`) instead of --layers/--alphas")
    timing.add_argument("--seq-lens", default="1024,4096,16384", help="comma-separated prompt lengths")
    timing.add_argument("--repeats", type=int, default=3, help="timed prefills per model and length (median)")
    timing.add_argument("--warmup", type=int, default=1, help="untimed prefills per model and length")
    timing.add_argument("--decode-steps", type=int, default=8, help="timed decode steps per model and length")
    timing.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    timing.add_argument("--seed", type=int, default=0, help="seed of the random prompt")
    timing.add_argument("--csv", help="also write the rows as CSV here")
    timing.set_defaults(func=cmd_timing)
    bench = sub.add_parser("evalbench", help="benchmark: lm-eval's stock HFLM vs FastHFLM on the same requests, "
                                             "interleaved; items/s, ratio, largest log-likelihood difference")
    _model_args(bench)
    bench.add_argument("--tasks", default="arc_easy", help="comma-separated log-likelihood tasks")
    bench.add_argument("--limit", type=int, default=100, help="items per task (mmlu: per subject)")
    bench.add_argument("--fewshot", type=int, default=None, help="shots for every task (default: the paper's)")
    bench.add_argument("--repeats", type=int, default=3, help="timed runs of each scorer (median)")
    bench.add_argument("--warmup", type=int, default=1, help="untimed runs of each scorer first")
    bench.add_argument("--threads", type=int, default=2, help="torch intra-op threads, fixed for both")
    bench.set_defaults(func=cmd_evalbench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result = args.func(args)
    except (ValueError, ConnectionError, ModuleNotFoundError) as err:
        print(json.dumps({"error": str(err)}), file=sys.stderr)
        return 2
    print(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
