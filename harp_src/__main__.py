"""Command line: `python -m harp_src prune|search|ppl|timing ...`, each printing one JSON object.

    python -m harp_src prune --model smollm2-135m --layers top:8 --alphas 1.0 --out plan.json [--ppl] [--save DIR]
    python -m harp_src search --model smollm2-135m --layers top:8 --out plan.json [--compare-naive] [--save DIR]
    python -m harp_src ppl --model smollm2-135m [--plan plan.json] [--corpus lee]
    python -m harp_src timing --model smollm2-135m --layers top:8 --seq-lens 1024,4096,16384 [--csv rows.csv]
    python -m harp_src evalbench --model smollm2-135m --tasks arc_easy --limit 200 [--fewshot 0] [--threads 2]
    python -m harp_src --cleanup DIR    (remove what interrupted saves of DIR left beside it)

Every output (--save, --out, --csv) is checked before any work starts, and --save DIR is claimed until the command
ends: a second command saving to DIR meanwhile is refused.
"""

from __future__ import annotations

import argparse
import copy
import json
import signal
import sys
import threading
import time
from contextlib import ExitStack
from pathlib import Path

from .checkpoints import cleanup, load_model, save_checkpoint, save_claim
from .data.corpora import ppl_windows
from .eval.perplexity import perplexity
from .measure.evalbench import bench_task, check_task
from .measure.flops import search_flops
from .measure.search_bench import benchmark_search
from .measure.timing import check_threads, compare, harp_copy
from .method.accounting import param_report
from .method.harp import HarpPlan, apply_harp, check_bypass, check_keep_for, check_kv_kept
from .method.layers import check_layers, parse_layer_key
from .method.search import GRID, search_alphas
from .model.adapter import fingerprint, get_adapter
from .model.loading import model_info
from .model.paper import llama31_8b_config
from .report.files import atomic_path, check_writable
from .report.results import run_info


def parse_alphas(text: str) -> float | dict[int, float]:
    """'0.5' (one α for all layers) or '22=0.5,23=0.3' (per layer); each layer at most once."""
    try:
        if "=" not in text:
            return float(text)
        out: dict[int, float] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, value = item.split("=")
            layer = parse_layer_key(key.strip())
            if layer in out:
                raise ValueError(f"layer {layer} is given twice")
            out[layer] = float(value)
        return out
    except ValueError as err:
        raise ValueError(f"--alphas {text!r}: {err}; write one α (0.5) or layer=α pairs (22=0.5,23=0.3)") from None


def parse_keep_heads(items: list[str] | None) -> dict[int, list[int]]:
    """--keep-heads 22:3,4,5 23:1 -> {22: [3, 4, 5], 23: [1]}: the query heads each bypassed layer keeps."""
    out: dict[int, list[int]] = {}
    for item in items or []:
        try:
            key, _, heads = item.partition(":")
            layer = parse_layer_key(key.strip())
            if layer in out or not heads.strip():
                raise ValueError("each layer once, with at least one head")
            out[layer] = [parse_layer_key(h.strip()) for h in heads.split(",")]
        except ValueError as err:
            raise ValueError(f"--keep-heads {item!r}: {err}; write LAYER:HEAD,HEAD per layer, such as "
                             "--keep-heads 22:3,4,5 23:1") from None
    return out


def check_plan_target(path: str | None) -> None:
    """Refuse an --out path that would replace something other than a plan file (before the model loads)."""
    if path is None or not Path(path).exists():
        return
    try:
        HarpPlan.from_json(path)
    except ValueError:
        raise ValueError(f"--out {path} exists and is not a plan file; nothing was written. Choose another "
                         "name (only an earlier plan is replaced)") from None


def read_plan(path: str | None) -> HarpPlan | None:
    """The plan of --plan, read and checked before the model loads."""
    return None if path is None else HarpPlan.from_json(path)


def apply_plan_file(plan: HarpPlan, path: str, model) -> None:
    """Apply the plan read from `path`; a plan that does not fit the model is refused naming the file."""
    try:
        plan.apply(model)
    except ValueError as err:
        raise ValueError(f"plan file {path}: {err}") from None


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
    alphas, keep = parse_alphas(args.alphas), parse_keep_heads(args.keep_heads)
    check_bypass(args.bypass)
    check_plan_target(args.out)
    model, tok = load_model(args.model, dtype=args.dtype, device=args.device)
    layers = check_layers(get_adapter(model), args.layers)
    keep = check_keep_for(get_adapter(model), layers, keep)
    check_kv_kept(get_adapter(model), layers, args.bypass, keep)
    out = {"model": model_info(model), "layers": layers}
    if args.ppl:
        out["ppl_before"] = _ppl(model, tok, args)
    plan = apply_harp(model, layers, alphas, fold=not args.no_fold, bypass=args.bypass, keep_heads=keep,
                      meta={"source": "cli prune", "model_id": model.harp_source["model_id"]})
    out |= {"alphas": plan.alphas, **param_report(model.config, plan)}
    if args.ppl:
        out |= {"ppl_after": _ppl(model, tok, args), "corpus": f"{args.corpus}/test",
                "n_windows": args.n_windows, "seq_len": args.seq_len, "seed": args.seed}
    if args.out:
        plan.to_json(args.out)
        out["plan"] = args.out
    if args.save:
        out["checkpoint"] = save_checkpoint(model, args.save, tok, overwrite=args.overwrite)
    return out


def cmd_ppl(args) -> dict:
    plan = read_plan(args.plan)
    model, tok = load_model(args.model, dtype=args.dtype, device=args.device)
    out = {"model": model_info(model)}
    if plan is not None:
        apply_plan_file(plan, args.plan, model)
        out["plan"] = plan.to_dict()
    return out | {"ppl": _ppl(model, tok, args), "corpus": f"{args.corpus}/test", "n_windows": args.n_windows,
                  "seq_len": args.seq_len, "seed": args.seed, "metric": "perplexity = exp(mean token NLL)"}


def parse_grid(text: str | None) -> tuple[float, ...]:
    """--grid '0,0.5,1' -> (0.0, 0.5, 1.0); the default grid when not given."""
    if text is None:
        return GRID
    try:
        grid = tuple(float(a) for a in text.split(",") if a.strip())
    except ValueError:
        grid = ()
    if not grid or not all(0.0 <= a <= 1.0 for a in grid):
        raise ValueError(f"--grid {text!r}: give comma-separated α values in [0, 1], such as 0,0.5,1")
    return grid


def cmd_search(args) -> dict:
    grid, keep = parse_grid(args.grid), parse_keep_heads(args.keep_heads)
    check_bypass(args.bypass)
    if args.compare_naive and (args.bypass != "identity" or keep):
        raise ValueError("--compare-naive benchmarks HARP's own search (identity bypass, no kept heads); drop "
                         "--bypass / --keep-heads or --compare-naive")
    check_threads(args.threads)
    check_plan_target(args.out)
    model, tok = load_model(args.model, dtype=args.dtype, device=args.device)
    layers = check_layers(get_adapter(model), args.layers)
    keep = check_keep_for(get_adapter(model), layers, keep)
    check_kv_kept(get_adapter(model), layers, args.bypass, keep)
    calib = ppl_windows(tok, args.corpus, "train", args.n_windows, args.seq_len, args.seed)
    out = {"model": model_info(model), "layers": layers, "calib": f"{args.corpus}/train", "n_windows": args.n_windows,
           "seq_len": args.seq_len, "seed": args.seed}
    if args.compare_naive:  # cached and naive candidate evaluations interleaved (A B, B A, ...), fixed threads
        bench = benchmark_search(model, calib, layers, grid, batch_size=args.batch_size, threads=args.threads)
        alphas, history = bench.pop("alphas"), bench.pop("history")
        llama = search_flops(llama31_8b_config(), list(range(24, 32)), len(grid), args.seq_len)  # paper: top-8
        out |= {**bench, "search_s": bench["cached_s"], "llama31_8b_flop_ratio": llama["predicted_ratio"],
                "llama31_8b_layers": "top:8"}
    else:
        history = []
        start = time.perf_counter()
        alphas = search_alphas(model, calib, layers, grid, batch_size=args.batch_size, history=history,
                               bypass=args.bypass, keep_heads=keep)
        out["search_s"] = time.perf_counter() - start
    out |= {"alphas": alphas, "calib_ppl": {f"{r['layer']}@{r['alpha']:g}": round(r["calib_ppl"], 4) for r in history}}
    plan = HarpPlan(fingerprint(model.config), alphas,
                    meta={"source": "greedy α search", "model_id": model.harp_source["model_id"],
                          "calib": f"{args.corpus}/train {args.n_windows}x{args.seq_len} seed {args.seed}",
                          "grid": list(grid)}, bypass=args.bypass, keep_heads=keep)
    if args.out:
        plan.to_json(args.out)
        out["plan"] = args.out
    if args.save:
        plan.apply(model)  # the search left the model dense
        out["checkpoint"] = save_checkpoint(model, args.save, tok, overwrite=args.overwrite)
    return out


def cmd_timing(args) -> dict:
    try:
        seq_lens = [int(t) for t in args.seq_lens.split(",") if t.strip()]
    except ValueError:
        seq_lens = []
    if not seq_lens or min(seq_lens) < 2:
        raise ValueError(f"--seq-lens must be comma-separated lengths >= 2, got {args.seq_lens!r} (seq_lens)")
    check_threads(args.threads)
    plan = read_plan(args.plan)
    alphas = parse_alphas(args.alphas)
    bypass = check_bypass(args.bypass or (plan.bypass if plan else "identity"))
    if plan is not None and plan.bypass != bypass:
        raise ValueError(f"plan file {args.plan} was made for the {plan.bypass} bypass (its α's and folded weights "
                         f"belong to it), not --bypass {args.bypass}; drop --bypass or search a {args.bypass} plan")
    model, _ = load_model(args.model, dtype=args.dtype, device=args.device)
    if plan is not None:  # e.g. the searched α's from `search --out`; refused if made for another model
        harp = copy.deepcopy(model)
        apply_plan_file(plan, args.plan, harp)
    else:
        layers = check_layers(get_adapter(model), args.layers)
        harp, plan = harp_copy(model, layers, alphas, bypass=bypass)
    summary, _ = compare(model, harp, seq_lens, repeats=args.repeats, warmup=args.warmup,
                         decode_steps=args.decode_steps, threads=args.threads,
                         seed=args.seed)
    summary.insert(0, "model", args.model)
    if args.csv:
        with atomic_path(args.csv) as tmp:
            summary.to_csv(tmp, index=False)
    return {"model": model_info(model), "plan": plan.to_dict(), "info": run_info(args.seed, args.device),
            "rows": summary.astype(object).where(summary.notna(), None).to_dict(orient="records")}  # NaN -> null


def cmd_evalbench(args) -> dict:
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise ValueError(f"--tasks {args.tasks!r} names no task; give e.g. --tasks arc_easy,piqa")
    for task in tasks:  # refuse an unknown task, or a bad count, before the model loads
        check_task(task)
    check_threads(args.threads)
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit must be >= 1 items per task, got {args.limit}")
    model, tok = load_model(args.model, dtype=args.dtype, device=args.device)
    rows = [bench_task(model, tok, task, args.limit, args.fewshot, repeats=args.repeats, warmup=args.warmup,
                       threads=args.threads)
            for task in tasks]
    return {"model": model_info(model), "info": run_info(0, args.device), "rows": rows}


def _add_evalbench(sub) -> None:
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m harp_src", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cleanup", metavar="DIR", help="remove what interrupted saves of DIR left beside it "
                                                         "(hidden .partial folders; an old checkpoint set aside is "
                                                         "put back) and exit")
    sub = parser.add_subparsers(dest="command")
    prune = sub.add_parser("prune", help="apply HARP to a model, print savings (and PPL), save the plan")
    _model_args(prune)
    prune.add_argument("--layers", required=True, help="top:N, bottom:N, a-b or a,b,c (0-based)")
    prune.add_argument("--alphas", default="1.0", help="one α for all layers, or 22=0.5,23=0.3")
    prune.add_argument("--no-fold", action="store_true", help="keep the repeat and α outside the weights")
    prune.add_argument("--bypass", default="identity", help="identity (HARP) or mean (the causal-mean bypass)")
    prune.add_argument("--keep-heads", nargs="+", metavar="LAYER:HEADS",
                       help="query heads a bypassed layer keeps, e.g. 22:3,4,5 23:1 (the others take --bypass)")
    prune.add_argument("--ppl", action="store_true", help="also measure test PPL before and after")
    prune.add_argument("--out", help="write the plan (JSON) here")
    prune.add_argument("--save", help="write the pruned model here as a checkpoint (from_pretrained loads it); "
                                      "a new or empty folder, or an earlier checkpoint with --overwrite")
    prune.add_argument("--overwrite", action="store_true", help="replace the checkpoint already at --save")
    _windows_args(prune)
    prune.set_defaults(func=cmd_prune)
    search = sub.add_parser("search", help="greedy top-down α search on enwiki-train windows; save the plan")
    _model_args(search)
    search.add_argument("--layers", required=True, help="top:N, bottom:N, a-b or a,b,c (0-based)")
    search.add_argument("--grid", help="comma-separated α values (default 0.0,0.1,...,1.0)")
    search.add_argument("--bypass", default="identity", help="identity (HARP) or mean (the causal-mean bypass)")
    search.add_argument("--keep-heads", nargs="+", metavar="LAYER:HEADS",
                        help="query heads a searched layer keeps, e.g. 22:3,4,5 23:1; α scales only the others")
    search.add_argument("--compare-naive", action="store_true",
                        help="benchmark: cached and naive candidate evaluations interleaved (A B, B A); "
                             "times, ratio, FLOP ratio, same_alphas")
    search.add_argument("--threads", type=int, default=2, help="torch intra-op threads, fixed for both (benchmark)")
    search.add_argument("--out", help="write the plan (JSON) here")
    search.add_argument("--save", help="write the model pruned with the searched α's here as a checkpoint")
    search.add_argument("--overwrite", action="store_true", help="replace the checkpoint already at --save")
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
    timing.add_argument("--bypass", default=None, help="identity (HARP, the default) or mean; a plan's own")
    timing.add_argument("--seq-lens", default="1024,4096,16384", help="comma-separated prompt lengths")
    timing.add_argument("--repeats", type=int, default=3, help="timed prefills per model and length (median)")
    timing.add_argument("--warmup", type=int, default=1, help="untimed prefills per model and length")
    timing.add_argument("--decode-steps", type=int, default=8, help="timed decode steps per model and length")
    timing.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    timing.add_argument("--seed", type=int, default=0, help="seed of the random prompt")
    timing.add_argument("--csv", help="also write the rows as CSV here")
    timing.set_defaults(func=cmd_timing)
    _add_evalbench(sub)
    return parser


# Failures a user can cause and fix: bad values (ValueError, JSON errors included), files that are missing,
# unreadable or not what they should be (OSError, ConnectionError among them), a package not installed. Anything
# else is a bug and keeps its traceback.
EXPECTED = (ValueError, OSError, ImportError)


def one_line(err: BaseException) -> str:
    """The error's message on one line (transformers' OSErrors span several)."""
    text = " ".join(str(err).split())
    if isinstance(err, OSError) and err.filename and str(err.filename) not in text:
        text += f" ({err.filename})"
    return text or type(err).__name__


def claim_outputs(stack: ExitStack, args: argparse.Namespace) -> None:
    """Check every output before any work starts, naming the user's path; hold the claim on --save until the
    command ends (a second save to the same folder is refused meanwhile)."""
    for flag in ("out", "csv"):
        path = getattr(args, flag, None)
        if path:
            check_writable(path, f"--{flag} {path}")
    if getattr(args, "save", None):
        stack.enter_context(save_claim(args.save, args.overwrite))


def run(args: argparse.Namespace) -> dict:
    if args.cleanup is not None:
        if args.command:
            raise ValueError("--cleanup DIR runs alone; give it without a command")
        return {"directory": args.cleanup, "cleaned_up": cleanup(args.cleanup)}
    with ExitStack() as stack:
        claim_outputs(stack, args)
        return args.func(args)


def terminated(signum, frame) -> None:
    """SIGTERM ends the command as an error would: temporary folders are removed and claims released on the way."""
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None and args.cleanup is None:
        parser.error("give a command (prune, search, ppl, timing, evalbench) or --cleanup DIR")
    main_thread = threading.current_thread() is threading.main_thread()  # only it may set signal handlers
    previous = signal.signal(signal.SIGTERM, terminated) if main_thread else None
    try:
        result = run(args)
    except EXPECTED as err:
        print(json.dumps({"error": one_line(err)}, ensure_ascii=False), file=sys.stderr)
        return 2
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
    print(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
