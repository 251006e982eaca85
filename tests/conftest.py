"""Tiny randomly initialised models of every supported family (built in code, no downloads)."""

import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
)

from harp_src.steps.graph import RUN_ENV

# `make test` runs pytest-xdist workers side by side: each takes its share of the cores as torch threads, and the
# notebook kernels and subprocesses it starts inherit the share, so the workers do not fight over the same cores
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if WORKERS > 1:
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // WORKERS))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

SEED = 0
SESSION_START = time.time()  # conftest loads before any test or notebook runs (see test_notebooks.py)
COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
              max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def tiny_configs() -> dict:
    return {
        "llama": LlamaConfig(**COMMON, num_attention_heads=4, num_key_value_heads=2),
        "mistral": MistralConfig(**COMMON, num_attention_heads=4, num_key_value_heads=1, sliding_window=None),
        "qwen2": Qwen2Config(**COMMON, num_attention_heads=4, num_key_value_heads=2),
        "gemma2": Gemma2Config(**COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                               sliding_window=8, query_pre_attn_scalar=16),
        "gemma3": Gemma3TextConfig(**COMMON, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                                   sliding_window=8, query_pre_attn_scalar=16,
                                   layer_types=["sliding_attention", "full_attention"] * 2),
    }


FAMILIES = list(tiny_configs())
NO_SDPA = {"gemma2"}  # transformers has no sdpa path for Gemma-2 (soft-capping): it runs eager


def make_tiny(family: str, attn: str = "sdpa", seed: int = SEED):
    """A fresh tiny model; the same seed gives the same weights, so two copies can be compared."""
    torch.manual_seed(seed)
    attn = "eager" if family in NO_SDPA else attn
    config = tiny_configs()[family]
    config._attn_implementation = attn
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn).eval()
    with torch.no_grad():  # random norm weights so Gemma's (1 + w) and α folding are really exercised
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(-0.5, 0.5) if "gemma" in family else p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
    return model


@pytest.fixture(params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture
def ids():
    g = torch.Generator().manual_seed(SEED)
    return torch.randint(3, 128, (2, 12), generator=g)


# ---------------------------------------------------------------------------------------------- nbval across workers
# tests/test_notebooks.py checks the numbers nbval's runs of the notebooks wrote. Under pytest-xdist a notebook may
# still be running on the other worker: the check waits for it, and a notebook that failed leaves a mark here so
# that nothing waits for it. The folder is made once by the controller; the workers inherit its path.
NBVAL_STATE = "HARP_TEST_NBVAL_STATE"


def pytest_configure(config):
    if "PYTEST_XDIST_WORKER" not in os.environ:
        os.environ[NBVAL_STATE] = tempfile.mkdtemp(prefix="harp-nbval-")
        # nbval's notebooks are one run, as the runner's are: a step one stored (09's and 10's α searches are 06's)
        # is read by the others instead of computed again. A fresh id: nothing stored before this session is reused.
        os.environ[RUN_ENV] = f"make-test-{uuid.uuid4().hex[:12]}"


@pytest.fixture(autouse=True)
def _outside_the_notebooks_run(monkeypatch):
    """Tests (not nbval's notebooks) compute their steps as before: no run whose stored steps they would reuse."""
    monkeypatch.delenv(RUN_ENV, raising=False)


def pytest_unconfigure(config):
    if "PYTEST_XDIST_WORKER" not in os.environ and os.environ.get(NBVAL_STATE):
        shutil.rmtree(os.environ.pop(NBVAL_STATE), ignore_errors=True)


def pytest_runtest_logreport(report):
    if report.failed and ".ipynb::" in report.nodeid and os.environ.get(NBVAL_STATE):
        notebook = Path(report.nodeid.split("::")[0]).stem
        (Path(os.environ[NBVAL_STATE]) / f"{notebook}.failed").touch()


def nbval_failed(notebook: str) -> bool:
    """Whether a cell of `notebook` failed under nbval in this session (on any worker)."""
    state = os.environ.get(NBVAL_STATE)
    return bool(state) and (Path(state) / f"{notebook}.failed").exists()
