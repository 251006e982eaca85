"""Fast log-likelihood scoring is exact: FastHFLM's answers equal lm-eval's stock HFLM's on real task requests.

Every scored task (the discriminative ones and LAMBADA), tiny configs of all five families over SmolLM2's
vocabulary and the real SmolLM2 and Gemma-3, each dense and HARP-pruned. Per request: |Δ log-likelihood| <= 1e-4
(fp32) and the same is_greedy; per task: the same metrics.
"""

import itertools
import math
import os
import random

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import COMMON, FAMILIES, NO_SDPA, make_tiny, tiny_configs
from harp_src import apply_harp, load_model
from harp_src.eval.scoring import FORWARD_COST, pack_batches, plan_blocks, score_requests
from harp_src.eval.tasks import CLOZE, DISCRIMINATIVE, GOLD_BPB, make_lm, run_tasks, task_requests
from harp_src.measure.evalbench import bench_task, check_task
from harp_src.model.loading import resolve_source

SCORED = DISCRIMINATIVE + CLOZE
LIMITS = {task: 2 for task in SCORED}  # mmlu: the first 2 subjects are kept below
TOL = 1e-4


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(resolve_source("smollm2-135m")[0])


@pytest.fixture(scope="module")
def requests(tok):
    """Every scored task's lm-eval requests (they depend on the tokenizer only), built once."""
    probe = tiny_family("llama", tok)
    out = {}
    for task in SCORED:
        reqs = task_requests(probe, tok, task, limit=2 if task != "mmlu" else 1)
        if task == "mmlu":  # 57 subjects × 1 item: two subjects are enough to check the shared 5-shot block
            keep = sorted({r.task_name for r in reqs})[:2]
            reqs = [r for r in reqs if r.task_name in keep]
        out[task] = reqs
    return out


def tiny_family(family: str, tok, window: int = 64):
    """A tiny random model of `family` over SmolLM2's vocabulary, so real prompts tokenise as they do for SmolLM2;
    Gemma's sliding window is 64 tokens, shorter than most few-shot prompts (both scoring paths run)."""
    config = tiny_configs()[family]
    config.vocab_size = len(tok)
    config.max_position_embeddings = 4096
    if getattr(config, "sliding_window", None):
        config.sliding_window = window
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager" if family in NO_SDPA else "sdpa").eval()


def assert_same_answers(stock, fast, context: str) -> None:
    assert len(stock) == len(fast)
    worst = max(abs(a[0] - b[0]) for a, b in zip(stock, fast, strict=True))
    assert worst <= TOL, f"{context}: log-likelihoods differ by {worst:.2e}"
    assert [a[1] for a in stock] == [b[1] for b in fast], f"{context}: is_greedy differs"


@pytest.mark.parametrize("pruned", [False, True], ids=["dense", "harp"])
def test_fast_equals_stock_on_every_scored_task(family, pruned, tok, requests):
    model = tiny_family(family, tok)
    if pruned:
        apply_harp(model, [1, 3], {1: 0.6, 3: 0.0})  # a bypassed and a dropped layer, below and at the top
    stock, fast = make_lm(model, tok, fast=False), make_lm(model, tok, fast=True)
    for task, reqs in requests.items():
        assert_same_answers(stock.loglikelihood(reqs, disable_tqdm=True), fast.loglikelihood(reqs, disable_tqdm=True),
                            f"{family} {'HARP' if pruned else 'dense'} {task}")


def test_run_tasks_metrics_and_items_are_identical(tok):
    model = tiny_family("qwen2", tok)
    tasks = ["arc_easy", "hellaswag", "winogrande", "lambada_openai"]
    items_stock, items_fast = [], []
    stock = run_tasks(model, tok, tasks, limit=4, num_fewshot=0, fast=False, items=items_stock, verbose=False)
    fast = run_tasks(model, tok, tasks, limit=4, num_fewshot=0, items=items_fast, verbose=False)
    assert set(stock.scorer) == {"stock"} and set(fast.scorer) == {"fast"}
    binary = stock.metric != "perplexity"
    assert stock[binary].value.tolist() == fast[binary].value.tolist()
    assert fast[~binary].value.tolist() == pytest.approx(stock[~binary].value.tolist(), rel=1e-5)
    for a, b in zip(items_stock, items_fast, strict=True):
        assert (a["task"], a["doc_id"], a["correct"]) == (b["task"], b["doc_id"], b["correct"])
    lambada = [i["raw"] for i in items_fast if i["task"] == "lambada_openai"]
    assert len(lambada) == 4 and all(v < 0 for v in lambada)  # per-item continuation log-likelihoods


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_real_models_fast_equals_stock(name, requests):
    """The first item of every scored task on the real packaged SmolLM2 (two items of three tasks on Gemma-3), dense;
    three tasks (one per kind of request: choices, a pair of contexts, a cloze) after top-quarter HARP. The tiny
    configs check both on two items of every task."""
    model, tok = load_model(name)
    few = ("arc_easy", "winogrande", "lambada_openai")
    if name.startswith("gemma"):  # another tokenizer: build its own requests (a few tasks keep this quick)
        reqs = {t: task_requests(model, tok, t, limit=2) for t in few}
    else:
        reqs = {t: [r for r in rs if (r.task_name, r.doc_id) == (rs[0].task_name, rs[0].doc_id)]
                for t, rs in requests.items()}
    for pruned in (False, True):
        if pruned:
            apply_harp(model, "top:4", 0.5)
            reqs = {t: rs for t, rs in reqs.items() if t in few}
        stock, fast = make_lm(model, tok, fast=False), make_lm(model, tok, fast=True)
        for task, rs in reqs.items():
            assert_same_answers(stock.loglikelihood(rs, disable_tqdm=True), fast.loglikelihood(rs, disable_tqdm=True),
                                f"{name} {'HARP' if pruned else 'dense'} {task}")


# ---------------------------------------------------------------------------------------------- the scorer itself
def naive(model, requests):
    """One full forward per request, log-softmax at every position: the definition."""
    out = []
    with torch.no_grad():
        for ctx, cont in requests:
            lp = F.log_softmax(model(torch.tensor([ctx + cont[:-1]])).logits[0], -1)[len(ctx) - 1 :]
            target = torch.tensor(cont)
            out.append((lp.gather(1, target[:, None]).sum().item(), bool((lp.argmax(-1) == target).all())))
    return out


KEEP = {0: [1], 1: [0, 3]}  # kept heads: their K/V slots (with the mean, also its sums) are copied per row


def synthetic_requests(seed: int, long: bool):
    """Multiple-choice groups (one context, several continuations), a few-shot block shared by half the documents,
    Winogrande-like pairs (contexts differing after a shared start), 1- to 3-token continuations."""
    rng = random.Random(seed)
    shots = [rng.randrange(3, 128) for _ in range(12)]
    out = []
    for doc in range(6):
        ctx = (shots if doc % 2 else []) + [rng.randrange(3, 128) for _ in range(rng.randrange(1, 20 if long else 5))]
        out += [(ctx, [rng.randrange(3, 128) for _ in range(rng.randrange(1, 4))]) for _ in range(rng.randrange(1, 4))]
    start = [rng.randrange(3, 128) for _ in range(6)]
    return out + [(start + [5], [9, 10]), (start + [6, 7], [9, 10])]


@pytest.mark.parametrize("pruned, keep", [(None, None), ("identity", None), ("mean", None), ("identity", KEEP),
                                          ("mean", KEEP)],
                         ids=["dense", "harp", "harp-mean", "harp-keep", "harp-mean-keep"])
@pytest.mark.parametrize("budget, min_shared", [(768, 3), (16, 3), (768, 1000)], ids=["shared", "tiny-batches",
                                                                                      "no-sharing"])
def test_score_requests_equals_the_definition(family, pruned, keep, budget, min_shared):
    model = make_tiny(family)  # Gemma's window is 8 tokens here: long prompts take the one-group path
    if pruned:  # the mean bypass's running sums see the right-padded batches: they must skip the padding
        apply_harp(model, [0, 1, 2], {0: 0.3, 1: 0.9, 2: 0.0}, bypass=pruned, keep_heads=keep)
    for long in (False, True):
        reqs = synthetic_requests(0, long)
        got = score_requests(model, reqs, max_batch_tokens=budget, min_shared=min_shared)
        assert_same_answers(naive(model, reqs), got, f"{family} long={long}")


def test_blocks_share_long_prefixes_and_batch_the_rest():
    shot = list(range(3, 43))  # a 40-token few-shot block
    reqs = [(shot + [50, 51], [7]), (shot + [50, 51], [8]), (shot + [60], [7]), ([90, 91], [7]), ([92], [5, 6])]
    blocks = plan_blocks(reqs, min_shared=32)
    assert [b.shared for b in blocks] == [40, 0]
    assert [[g.members for g in b.groups] for b in blocks] == [[[2], [0, 1]], [[4], [3]]]
    with pytest.raises(ValueError, match="non-empty"):
        score_requests(make_tiny("llama"), [([], [5])])


def test_one_odd_context_does_not_cut_the_shared_prefix_of_the_rest():
    """HumanEval's gold-bpb prompts: all share a header, all but one also share their shots. The odd one sorts first;
    it runs on its own and the rest share header and shots (saving 3 x 100 tokens, not 4 x 40)."""
    header, shots = list(range(3, 43)), list(range(50, 110))
    reqs = [(header + [4, 5], [7, 9])] + [(header + shots + [k], [8, k]) for k in range(3, 7)]
    blocks = plan_blocks(reqs, min_shared=32)
    assert [b.shared for b in blocks] == [0, 100]
    assert [[g.members for g in b.groups] for b in blocks] == [[[0]], [[1], [2], [3], [4]]]
    model = make_tiny("llama")
    assert_same_answers(naive(model, reqs), score_requests(model, reqs, min_shared=32), "odd first context")


def _every_cut(n: int):
    """Every way to cut n >= 1 items in a row into consecutive runs, as lists of (first, end)."""
    for mask in range(2 ** (n - 1)):
        yield list(itertools.pairwise([0] + [k + 1 for k in range(n - 1) if mask >> k & 1] + [n]))


def _best_saving(contexts: list[list[int]], min_shared: int) -> int:
    """Brute force over every cut of the sorted distinct contexts into runs: the most prefix tokens saved."""
    ctx = sorted({tuple(c) for c in contexts})
    best = 0
    for runs in _every_cut(len(ctx)):
        total = 0
        for a, b in runs:
            run = ctx[a:b]
            shared = min(len(os.path.commonprefix(run)), min(len(c) for c in run) - 1)
            total += (len(run) - 1) * shared if shared >= min_shared else 0
        best = max(best, total)
    return best


@pytest.mark.parametrize("seed", range(20))
def test_blocks_save_the_most_shared_tokens(seed):
    """Random few-shot-like contexts (shared stems of random lengths, odd ones among them): the plan saves exactly as
    many prefix tokens as the best of all ways to cut the sorted contexts into runs."""
    rng = random.Random(seed)
    stems = [[rng.randrange(3, 6) for _ in range(rng.randrange(0, 12))] for _ in range(3)]
    reqs = [(rng.choice(stems) + [rng.randrange(3, 6) for _ in range(rng.randrange(1, 6))], [7]) for _ in range(8)]
    blocks = plan_blocks(reqs, min_shared=3)
    saved = sum((len(b.groups) - 1) * b.shared for b in blocks if b.shared)
    assert saved == _best_saving([c for c, _ in reqs], min_shared=3)
    assert sorted(i for b in blocks for g in b.groups for i in g.members) == list(range(len(reqs)))


def _batch_cost(widths: list[int], batches: list[tuple[int, int]]) -> int:
    return sum(FORWARD_COST + (end - first) * widths[end - 1] for first, end in batches)


def test_pack_batches_cuts_where_the_widths_jump():
    short_and_long = [1] * 40 + [20] * 40  # one batch would pad 40 one-token rows to 20
    assert pack_batches(short_and_long, 10_000) == [(0, 40), (40, 80)]
    assert pack_batches([3, 100], 50) == [(0, 1), (1, 2)]  # a row wider than the budget runs alone
    assert pack_batches([], 50) == []
    batches = pack_batches([5] * 10, 20)
    assert len(batches) == 3 and all((end - first) * 5 <= 20 for first, end in batches)
    assert all(end - first <= 2 for first, end in pack_batches([1] * 6, 100, most_rows=2))
    assert pack_batches([1] * 4, 100, fits=lambda a, b: b - a < 2) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert pack_batches([1] * 40 + [20] * 40, 10_000, forward_cost=1000) == [(0, 80)]  # a pass dearer than padding
    with pytest.raises(ValueError, match="sorted by width"):
        pack_batches([3, 1], 50)


@pytest.mark.parametrize("seed", range(10))
def test_pack_batches_costs_the_least(seed):
    """Against every way of cutting 8 sorted widths into batches within the budget."""
    rng = random.Random(seed)
    widths = sorted(rng.choice([1, 2, 3, 8, 20, 40]) for _ in range(8))
    budget = rng.choice([40, 100, 1000])
    best = math.inf
    for batches in _every_cut(8):
        if all(end - first == 1 or (end - first) * widths[end - 1] <= budget for first, end in batches):
            best = min(best, _batch_cost(widths, batches))
    assert _batch_cost(widths, pack_batches(widths, budget)) == best


@pytest.mark.parametrize("task", GOLD_BPB)
def test_evalbench_gold_bpb_prompts_score_alike(tok, task):
    """The gold-answer prompts (few-shot blocks of 200-800 tokens, most of them shared) through both scorers. An
    answer is up to ~150 tokens, its log-likelihood a sum near -1000 here: fp32 rounding allows 1e-6 of that."""
    row = bench_task(tiny_family("qwen2", tok), tok, task, limit=6, num_fewshot=0, repeats=1, warmup=0, threads=1)
    assert row["items"] == row["requests"] == 6
    assert row["max_abs_diff"] <= 1e-3 and row["same_greedy"]


def test_evalbench_reports_both_scorers(tok):
    model = tiny_family("llama", tok)
    row = bench_task(model, tok, "arc_easy", limit=3, num_fewshot=0, repeats=2, warmup=0, threads=1)
    assert row["items"] == 3 and row["requests"] == 12 and row["threads"] == 1
    assert row["max_abs_diff"] <= TOL and row["same_greedy"]
    assert row["speedup"] == pytest.approx(row["stock_s"] / row["fast_s"])
    with pytest.raises(ValueError, match="available tasks are .*gsm8k"):
        check_task("gsm8k_typo")
    assert COMMON["vocab_size"] == 128 and set(FAMILIES) == set(tiny_configs())
