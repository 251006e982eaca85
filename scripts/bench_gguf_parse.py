"""Benchmark: loading a packaged model's GGUF as its conversion does (tokenizer, then the model with its config), with
transformers parsing the file for each (A) against one parse shared through `one_gguf_parse` (B), interleaved.

    python scripts/bench_gguf_parse.py [gemma3-270m] [--threads 2]

A B B A after a warm-up of each (the file in the page cache), in one process with fixed threads; prints each time,
both medians and the ratio A / B. Take it on a quiet machine.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from harp_src.model.loading import PACKAGED, one_gguf_parse


def load_seconds(gguf, shared: bool) -> float:
    """Seconds to load the tokenizer and the fp32 model from `gguf`, with one shared parse or one per load."""
    start = time.perf_counter()
    with one_gguf_parse(gguf) if shared else contextlib.nullcontext():
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default="gemma3-270m", choices=sorted(PACKAGED))
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gguf = PACKAGED[args.model].gguf_path()
    load_seconds(gguf, False)
    load_seconds(gguf, True)
    times = {False: [], True: []}
    for shared in (False, True, True, False):
        times[shared].append(load_seconds(gguf, shared))
        print(f"  {'one parse' if shared else 'a parse per load'}: {times[shared][-1]:.1f} s", flush=True)
    each, once = statistics.median(times[False]), statistics.median(times[True])
    print(f"{args.model}: a parse per load {each:.1f} s, one parse {once:.1f} s: ratio {each / once:.2f} "
          f"({args.threads} threads)")


if __name__ == "__main__":
    main()
