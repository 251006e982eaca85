"""Tiny randomly initialised models of every supported family (built in code, no downloads)."""

import inspect
import os
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors  # the factory functions torch.set_default_device redirects
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
)

import harp_src
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


def make_tiny(family: str, attn: str = "sdpa", seed: int = SEED, device: str | torch.device = "cpu"):
    """A fresh tiny model on `device`; the same seed gives the same weights on every device (they are drawn on the
    CPU), so two copies can be compared."""
    torch.manual_seed(seed)
    attn = "eager" if family in NO_SDPA else attn
    config = tiny_configs()[family]
    config._attn_implementation = attn
    with torch.device("cpu"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn).eval()
    with torch.no_grad():  # random norm weights so Gemma's (1 + w) and α folding are really exercised
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(-0.5, 0.5) if "gemma" in family else p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
    return model.to(device)


@pytest.fixture(params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture
def ids():
    g = torch.Generator().manual_seed(SEED)
    return torch.randint(3, 128, (2, 12), generator=g, device="cpu")


# ---------------------------------------------------------------------------------------------- --device
# The exact invariants on tiny models (HARP, the mean bypass, kept heads) and the precision checks take the `device`
# fixture: `pytest --device cuda tests` runs them, and only them, on a GPU, where kernels, dtypes and default devices
# differ from the CPU's. They need no packaged model and no download. Without the option they run on the CPU with
# every other test.
def pytest_addoption(parser):
    parser.addoption("--device", default=None, help="run only the tests that take the `device` fixture (exact "
                     "invariants and precision checks on tiny models), on this torch device: cpu, cuda or cuda:N")


TORCH = str(Path(torch.__file__).resolve().parent) + os.sep
OURS = (str(Path(harp_src.__file__).resolve().parent) + os.sep, str(Path(__file__).resolve().parent) + os.sep)


def caller_in(roots: tuple[str, ...]) -> str | None:
    """"file:line" of the code under `roots` that made the factory call being dispatched (directly, or through
    torch, as nn.Linear(...) calls torch.empty; another mode's dispatch in between is looked through), else None."""
    frame = sys._getframe(2)  # the caller of __torch_function__
    while frame is not None and (frame.f_code.co_filename.startswith(TORCH)
                                 or frame.f_code.co_name == "__torch_function__"):
        frame = frame.f_back
    if frame is None or not frame.f_code.co_filename.startswith(roots):
        return None
    return f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno}"


class DevicelessTensors(TorchFunctionMode):
    """The factory calls made without `device=` by code under `roots`: sent to `send_to` (as
    torch.set_default_device would, for that code only), or refused where `send_to` is None, since on a GPU run
    such a tensor would sit on the CPU, beside the models."""

    def __init__(self, roots: tuple[str, ...], send_to: str | None = None):
        super().__init__()
        self.roots, self.send_to = roots, send_to

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _device_constructors() and kwargs.get("device") is None and (where := caller_in(self.roots)):
            if self.send_to is None:
                raise RuntimeError(f"{where}: {getattr(func, '__name__', func)}(...) without device= would make a "
                                   "CPU tensor on a GPU run: give it the model's (or the input's) device")
            kwargs = {**kwargs, "device": self.send_to}
        return func(*args, **kwargs)


def run_device(config) -> torch.device:
    return torch.device(config.getoption("--device") or "cpu")


def takes_device(item) -> bool:
    """Whether a test asks for `device` itself (a fixture that needs it does not make the test device-ready)."""
    function = getattr(item, "function", None)  # nbval's notebook cells have none
    return function is not None and "device" in inspect.signature(function).parameters


def pytest_collection_modifyitems(config, items):
    if config.getoption("--device") is None:
        return
    chosen = [item for item in items if takes_device(item)]
    config.hook.pytest_deselected(items=[item for item in items if not takes_device(item)])
    items[:] = chosen


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """On the CPU a test that takes `device` stands in for a GPU run: a tensor that it or harp_src makes without
    `device=` is refused, where on a GPU it would sit on the CPU beside a CUDA model. (A tensor meant for the CPU,
    beside numbers pandas held, says device="cpu".)"""
    if takes_device(item) and run_device(item.config).type == "cpu":
        with DevicelessTensors(OURS):
            yield
    else:
        yield


@pytest.fixture
def device(request) -> torch.device:
    """The torch device of `--device` (default cpu), with its index (cuda -> cuda:0), as tensors report theirs."""
    where = run_device(request.config)
    if where.type == "cpu":
        return torch.device("cpu")  # tensors report "cpu", never "cpu:0"
    return where if where.index is not None else torch.device("cuda", torch.cuda.current_device())


# ---------------------------------------------------------------------------------------------- nbval across workers
# tests/test_notebooks.py checks the numbers nbval's runs of the notebooks wrote. Under pytest-xdist a notebook may
# still be running on the other worker: the check waits for it, and a notebook that failed leaves a mark here so
# that nothing waits for it. The folder is made once by the controller; the workers inherit its path.
NBVAL_STATE = "HARP_TEST_NBVAL_STATE"


def check_device(value: str | None) -> None:
    """Refuse a `--device` that pytest cannot run the device tests on, in one line, before anything is collected."""
    try:
        where = torch.device(value or "cpu")
    except RuntimeError:
        where = None
    if where is None or where.type not in ("cpu", "cuda"):
        raise pytest.UsageError(f"--device {value!r}: give cpu, cuda or cuda:N")
    if where.type == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError(f"--device {where}: torch {torch.__version__} sees no CUDA device; run on a machine "
                                "with an NVIDIA GPU and a CUDA build of torch, or leave --device out")
    if where.type == "cuda" and (where.index or 0) >= torch.cuda.device_count():
        raise pytest.UsageError(f"--device {where}: torch sees {torch.cuda.device_count()} CUDA device(s), "
                                f"cuda:0 to cuda:{torch.cuda.device_count() - 1}")


def pytest_configure(config):
    check_device(config.getoption("--device"))
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
