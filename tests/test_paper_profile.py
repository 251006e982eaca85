"""The GPU profiles (paper, quick-cuda, gpu-timing) and scripts/gpu_check.sh, checked where no GPU and no Hub is:
every profile passes the runner's checks and builds each named notebook's study parameters without loading a model,
and the GPU check refuses a machine without CUDA in one line before it runs or writes anything."""

import importlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import check_device
from harp_src import runner
from harp_src.report.params import StudyParams, parameter_spec, parameters_source

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted(p.stem for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
GPU_PROFILES = ["paper", "quick-cuda", "gpu-timing"]
# the paper's N per model (../shared/DESIGN.md, section 5) and the layers of each model (their public configs)
PAPER_N = {"meta-llama/Llama-3.1-8B": 8, "mistralai/Mistral-7B-v0.3": 8, "Qwen/Qwen2-7B": 4, "google/gemma-2-9b": 6}
LAYERS = {"meta-llama/Llama-3.1-8B": 32, "mistralai/Mistral-7B-v0.3": 32, "Qwen/Qwen2-7B": 28, "google/gemma-2-9b": 42}


STUDIES = {"01_over_smoothing": "over_smoothing", "02_head_removal": "head_removal", "03_alpha_search": "alpha_search",
           "04_long_context_timing": "long_context_timing", "05_ablations": "ablations", "06_baselines": "frontier",
           "07_head_importance": "head_importance", "08_evaluation": "evaluation", "09_scale": "scale",
           "10_recovery": "recovery", "11_retrieval_heads": "retrieval_heads"}


def study_params(notebook: str) -> type[StudyParams]:
    """The StudyParams subclass of a notebook's study (its NOTEBOOK names it); only that study is imported."""
    importlib.import_module(f"harp_src.studies.{STUDIES[notebook]}")
    todo, found = list(StudyParams.__subclasses__()), []
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        found += [cls] if cls.NOTEBOOK == notebook else []
    assert len(found) == 1, f"{notebook}: {found}"
    return found[0]


def named(profile: str) -> list[str]:
    """The notebooks a profile names; a `common` block applies to every notebook, so all are checked."""
    spec = runner.load_profile(profile)
    return NOTEBOOKS if "common" in spec and set(spec["common"]) - {"SEED"} else sorted(set(spec) - {"common"})


@pytest.mark.parametrize("profile, notebook", [(p, n) for p in GPU_PROFILES for n in named(p)])
def test_gpu_profiles_pass_the_profile_check_and_build_the_study_parameters(profile, notebook):
    values = runner.check_profile(notebook, runner.profile_parameters(profile, notebook))
    params = study_params(notebook).defaults(**values)  # checks names and types, loads nothing
    if hasattr(params, "check"):
        params.check()  # no model is loaded: require_installed passes Hub ids, packaged ones are installed
    assert params.device == "cuda"
    if profile != "quick-cuda":
        assert params.dtype == "bfloat16"


def test_the_paper_profile_runs_the_papers_models_with_the_papers_n():
    spec = runner.load_profile("paper")
    assert {"03_alpha_search", "04_long_context_timing", "06_baselines", "09_scale", "10_recovery"} <= set(spec)
    for notebook in set(spec) - {"common"}:
        params = study_params(notebook).defaults(**runner.profile_parameters("paper", notebook))
        assert params.models and set(params.models) <= set(PAPER_N), notebook
        if hasattr(params, "n_layers"):  # one N for every model: only models whose paper N it is
            assert all(params.n_layers == PAPER_N[m] for m in params.models), (notebook, params.n_layers)
        if hasattr(params, "levels"):  # 06: the paper's N among each model's levels, none past its depth
            from harp_src.studies.frontier import levels_for
            for m in params.models:
                assert PAPER_N[m] in levels_for(params.levels, m) and max(levels_for(params.levels, m)) < LAYERS[m]
    assert set(study_params("06_baselines").defaults(**runner.profile_parameters("paper", "06_baselines")).models) \
        == set(PAPER_N)
    timing = study_params("04_long_context_timing").defaults(
        **runner.profile_parameters("paper", "04_long_context_timing"))
    assert max(timing.seq_lens) == 65536


def test_the_gpu_timing_profile_times_04_up_to_64k_in_bf16():
    assert set(runner.load_profile("gpu-timing")) == {"04_long_context_timing"}
    values = runner.profile_parameters("gpu-timing", "04_long_context_timing")
    assert max(values["SEQ_LENS"]) == 65536 and values["DTYPE"] == "bfloat16" and values["DEVICE"] == "cuda"
    assert set(runner.load_profile("quick-cuda")) == {"common"}
    spec = {n: parameter_spec(parameters_source(n)) for n in NOTEBOOKS}
    assert all({"DEVICE", "DTYPE"} <= set(s) for s in spec.values())  # so `common` may set DEVICE in quick-cuda


# ---------------------------------------------------------------------------------------------- scripts/gpu_check.sh
def run_check(tmp_path: Path, bin_dir: Path, **env_: str) -> subprocess.CompletedProcess:
    """scripts/gpu_check.sh copied into an empty repository, run with PATH = `bin_dir`, the test's Python and
    `env_`."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy2(ROOT / "scripts" / "gpu_check.sh", repo / "scripts")
    for tool in ["dirname", "head", "tail"]:
        (bin_dir / tool).symlink_to(shutil.which(tool))
    env = {"PATH": str(bin_dir), "PYTHON": sys.executable, "HOME": os.environ.get("HOME", str(tmp_path))} | env_
    return subprocess.run([shutil.which("bash"), str(repo / "scripts" / "gpu_check.sh")], env=env,
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)


def only_the_script(tmp_path: Path) -> bool:
    return [p.relative_to(tmp_path / "repo").as_posix() for p in (tmp_path / "repo").rglob("*")] == \
        ["scripts", "scripts/gpu_check.sh"]


def test_gpu_check_is_an_executable_bash_script_that_stops_on_errors():
    script = ROOT / "scripts" / "gpu_check.sh"
    assert os.access(script, os.X_OK)
    assert "set -euo pipefail" in script.read_text()
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0


def test_gpu_check_without_nvidia_smi_fails_in_one_line_and_starts_nothing(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    done = run_check(tmp_path, bin_dir)
    assert done.returncode != 0 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        "gpu_check: no nvidia-smi: this check needs an NVIDIA GPU and its driver"]
    assert only_the_script(tmp_path)


@pytest.mark.parametrize("parts,message", [
    ("tests bogus", "unknown part 'bogus' (choose among: tests quick timing)"),
    (" ", "GPU_CHECK_PARTS is empty (choose among: tests quick timing)"),
])
def test_gpu_check_with_unknown_parts_fails_in_one_line_and_starts_nothing(tmp_path, parts, message):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    done = run_check(tmp_path, bin_dir, GPU_CHECK_PARTS=parts)
    assert done.returncode != 0 and done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_check: ") and lines[0].endswith(message), lines
    assert only_the_script(tmp_path)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_gpu_check_with_a_gpu_but_no_cuda_in_torch_fails_in_one_line_and_starts_nothing(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "nvidia-smi"  # a driver that lists a GPU torch cannot use
    fake.write_text("#!/bin/sh\necho 'NVIDIA Fake GPU'\n")
    fake.chmod(0o755)
    done = run_check(tmp_path, bin_dir)
    assert done.returncode != 0 and done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_check: torch sees no CUDA device (") and \
        lines[0].endswith("install a CUDA build of torch"), lines
    assert only_the_script(tmp_path)


# ---------------------------------------------------------------------------------------------- pytest --device
def collect(*args: str) -> subprocess.CompletedProcess:
    """`pytest --collect-only` in a fresh process (this run's xdist and plugin settings left out)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "HARP_TEST_"))}
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only", "-q", *args],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)


def test_device_option_collects_only_the_tests_that_take_a_device():
    """`pytest --device D` keeps exactly the tests that ask for `device`: in test_harp.py the six exact invariants,
    not the bad-input, plan or paper checks; and the files holding them are those scripts/gpu_check.sh runs."""
    done = collect("--device", "cpu", "tests")
    assert done.returncode == 0, done.stdout + done.stderr
    kept = [line.split("::") for line in done.stdout.splitlines() if "::" in line]
    assert {name.split("[")[0] for path, name in kept if path == "tests/test_harp.py"} == {
        "test_bypass_equals_identity_attention", "test_alpha_one_on_one_token_is_dense",
        "test_alpha_zero_drops_the_attention_sublayer", "test_folded_equals_unfolded", "test_eager_equals_sdpa",
        "test_cached_decoding_equals_uncached"}
    assert "deselected" in done.stdout.splitlines()[-1]
    script = (ROOT / "scripts" / "gpu_check.sh").read_text()
    listed = script.split('DEVICE_TESTS="', 1)[1].split('"', 1)[0].split()
    assert sorted(listed) == sorted({path for path, _ in kept})


@pytest.mark.parametrize("name,message", [
    ("meta", "--device 'meta': give cpu, cuda or cuda:N"),
    ("gpu0", "--device 'gpu0': give cpu, cuda or cuda:N"),
    pytest.param("cuda", "--device cuda: torch ", marks=pytest.mark.skipif(torch.cuda.is_available(),
                                                                           reason="this machine has CUDA")),
])
def test_a_device_pytest_cannot_use_is_refused_in_one_line(name, message):
    with pytest.raises(pytest.UsageError) as refused:
        check_device(name)
    assert str(refused.value).startswith(message) and "\n" not in str(refused.value)
    for fine in (None, "cpu"):
        check_device(fine)
