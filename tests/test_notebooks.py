"""Notebooks' recorded headline numbers at their quick defaults, each metric with its own tolerance.

Golden values come from `python -m harp_src.runner --profile quick` (files in .runs/quick/figures/*_metrics.json).
`make test` runs nbval over notebooks/ first (pyproject's testpaths order, kept on its two pytest-xdist workers by
--no-loadscope-reorder), and those runs write their metrics into .runs/quick/figures/; a metrics file written during
this pytest session is checked as it is, so no notebook runs twice (a notebook still running on the other worker is
waited for). Run alone (or after a failed nbval run), the test executes the notebook itself into a temp folder.
"""

import importlib
import time
from pathlib import Path

import papermill as pm
import pytest

from conftest import SESSION_START, nbval_failed
from harp_src import runner
from harp_src.report.params import StudyParams, check_parameters, check_values, parameter_spec, parameters_source
from harp_src.report.results import output_dir, read_metrics

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
STUDY_MODULES = sorted(f"harp_src.studies.{p.stem}" for p in (NOTEBOOKS.parent / "harp_src" / "studies").glob("*.py")
                       if p.stem != "__init__")
pytestmark = pytest.mark.slow
NBVAL_WAIT = 45 * 60  # seconds to wait for nbval's run of a notebook on another worker (06, the longest, takes 5 min)

GOLDEN = {
    "01_over_smoothing": {
        "uniform_causal_entropy": (3.8782, dict(abs=1e-4)),  # mean ln t over a 128-token window
        "smollm2-135m/similarity_bottom_quarter": (0.4539, dict(abs=0.01)),
        "smollm2-135m/similarity_top_quarter": (0.5894, dict(abs=0.01)),
        "smollm2-135m/min_bypass_error_rescaled": (0.6572, dict(abs=0.02)),
        "smollm2-135m/min_bypass_error_layer": (1, dict(abs=0)),
        "smollm2-135m/alpha_star_top_quarter": (0.2412, dict(abs=0.02)),
        "smollm2-135m/alpha_star_bottom_quarter": (0.2407, dict(abs=0.02)),
    },
    "02_head_removal": {
        "smollm2-135m/dense_ppl": (26.53, dict(rel=0.01)),
        "smollm2-135m/ppl_top8_alpha1": (558.9, dict(rel=0.05)),
        "smollm2-135m/ppl_top8_alpha0": (950.9, dict(rel=0.05)),
        "smollm2-135m/ppl_bottom8_alpha1": (11395, dict(rel=0.05)),
        "smollm2-135m/ppl_bottom8_alpha0": (22685, dict(rel=0.05)),
        "smollm2-135m/ratio_paper_top8_alpha1": (8 / 240, dict(rel=1e-9)),  # 8·(Q+K) / 30 layers' Linears
    },
    "03_alpha_search": {
        "smollm2-135m/test_ppl/dense": (26.53, dict(rel=0.01)),
        "smollm2-135m/test_ppl/HARP, searched α": (30.67, dict(rel=0.03)),
        "smollm2-135m/test_ppl/HARP, closed-form α*": (29.94, dict(rel=0.03)),
        "smollm2-135m/test_ppl/HARP, α = 1": (50.12, dict(rel=0.03)),
        "smollm2-135m/test_ppl/attention dropped, α = 0": (36.29, dict(rel=0.03)),
        "smollm2-135m/searched_alphas_top_first": ([0.3, 0.4, 0.8, 0.0], dict(abs=0.11)),  # one grid step
    },
    "04_long_context_timing": {  # only what does not depend on the machine; speed-ups are benchmarks
        "smollm2-135m/cpu/longest_seq_len": (2048, dict(abs=0)),
        "smollm2-135m/cpu/kv_ratio": (22 / 30, dict(rel=1e-12)),  # top-8 of 30 layers keep no KV
        "smollm2-135m/cpu/flop_bound": (1.116291, dict(rel=1e-5)),
        "llama31_8b/flop_bound_64k": (1.185943, dict(rel=1e-5)),
        "llama31_8b/param_ratio_paper_convention": (0.0330529, dict(rel=1e-4)),  # the paper's 3.3 %
    },
    "08_evaluation": {  # 6 items per task (3 for α = 1 and α = 0), 4 long-context prompts: one item moves a score by
        # 0.17–0.33; fidelity is a mean over 2 × 127 predicted tokens per corpus
        "smollm2-135m/dense/arc_easy": (1 / 3, dict(abs=0.01)),
        "smollm2-135m/HARP, searched α/piqa": (0.5, dict(abs=0.01)),
        "smollm2-135m/dense/lambada_openai": (1 / 3, dict(abs=0.01)),
        "smollm2-135m/attention dropped, α = 0/arc_easy/diff": (-1 / 3, dict(abs=0.01)),
        "smollm2-135m/HARP, searched α/fidelity/enwiki/kl": (0.2761, dict(rel=0.02)),
        "smollm2-135m/HARP, searched α/fidelity/lee/top1_agreement": (0.7244, dict(abs=0.01)),
        "smollm2-135m/HARP, α = 1/fidelity/enwiki/delta_nll": (0.6361, dict(rel=0.02)),
        "smollm2-135m/dense/long_context/passkey": (0.5, dict(abs=0.01)),
        "smollm2-135m/HARP, searched α/long_context/multidoc": (0.25, dict(abs=0.01)),
        "smollm2-135m/searched_alphas_top_first": ([0.3, 0.4, 0.8, 0.0], dict(abs=0.11)),
    },
    "06_baselines": {  # levels N=2 and 8 (quarter depth), 2 x 128 calibration tokens, 2 x 127 predicted test tokens
        "smollm2-135m/budget/2": (1327104, dict(abs=0)),  # HARP's real drop: Q + K of the top 2 layers (no α = 0)
        "smollm2-135m/budget/8": (5530176, dict(abs=0)),
        "smollm2-135m/budget/paper": (3981312, dict(abs=0)),  # the paper's convention at quarter depth
        "smollm2-135m/harp/N=8/kl": (1.280, dict(rel=0.03)),
        "smollm2-135m/harp/paper/kl": (1.280, dict(rel=0.03)),  # the same model as N=8, measured once
        "smollm2-135m/flap [heads+mlp]/N=8/kl": (0.6428, dict(rel=0.05)),
        "smollm2-135m/flap [mlp]/N=8/kl": (0.1730, dict(rel=0.05)),
        "smollm2-135m/llm-pruner [heads+mlp]/N=8/kl": (0.3464, dict(rel=0.05)),
        "smollm2-135m/shortgpt/N=2/kl": (0.1276, dict(rel=0.03)),
        "smollm2-135m/harp-bi/N=8/kl": (0.3947, dict(rel=0.05)),
        "smollm2-135m/wanda/N=8/kl": (1.6e-3, dict(abs=5e-4)),
        # quality alone: at these sizes the prefill timings are noise, so the speed-gated verdict is not a golden
        "smollm2-135m/N=8/better_on_kl": ("flap [heads+mlp], flap [mlp], harp-bi, harp-mean, llm-pruner [heads+mlp], "
                                          "llm-pruner [mlp], shortgpt, wanda", dict()),
        "smollm2-135m/harp-mean/N=8/kl": (0.6760, dict(rel=0.05)),  # the causal-mean bypass, α searched for it
        "smollm2-135m/dense/dense/gsm8k_gold_bpb": (0.6550, dict(rel=0.01)),  # gold part: 2 reference solutions
        "smollm2-135m/harp/N=8/gsm8k_gold_bpb": (1.3905, dict(rel=0.03)),
        "smollm2-135m/harp-mean/N=2/kl": (0.0644, dict(rel=0.05)),
    },
    "09_scale": {  # SmolLM2 at quarter depth (its sizes: 06's), 4 task items, 2 gold-bpb items, 1 GSM8K generation
        "smollm2-135m/harp/kl": (1.280, dict(rel=0.03)),  # 06's HARP at N=8: the same windows and search
        "smollm2-135m/kl/harp − dense": (1.280, dict(rel=0.03)),
        "smollm2-135m/harp-mean/kl": (0.6760, dict(rel=0.05)),  # 06's harp-mean at N=8
        "smollm2-135m/best_baseline": ("flap [mlp]", dict()),
        "smollm2-135m/dense/gsm8k_gold_bpb": (0.6550, dict(rel=0.01)),  # the 2 reference solutions' bits per byte
        "smollm2-135m/harp/humaneval_gold_bpb": (0.9354, dict(rel=0.03)),
    },
    "10_recovery": {  # 2 LoRA steps of 128 tokens: sizes that only exercise it
        "smollm2-135m/harp/N=8/kl": (1.280, dict(rel=0.03)),  # before: 06's and 09's HARP
        "smollm2-135m/harp/N=8 + LoRA/kl": (1.2754, dict(rel=0.03)),
        "smollm2-135m/harp/kl/gain": (-0.00462, dict(abs=0.002)),  # after − before, on the same windows
    },
    "11_retrieval_heads": {  # top 2 layers, 2 x 64-token windows, 4 LAMBADA items, 2 passkeys of 256 tokens: sizes
        # that exercise it
        "smollm2-135m/harp/kl": (0.1481, dict(rel=0.03)),
        "smollm2-135m/harp-keep 25%/kl": (0.1041, dict(rel=0.05)),
        "smollm2-135m/harp-keep 25%/kl − harp": (-0.0440, dict(abs=0.01)),  # paired on the same windows
        "smollm2-135m/harp-keep 25%/k": (4, dict(abs=0)),  # a quarter of the top 2 layers' 18 query heads, rounded
        "smollm2-135m/dense/kv_bytes_per_token": (30 * 3 * 64 * 2 * 4, dict(abs=0)),  # 30 layers, 3 KV groups, fp32
        "smollm2-135m/harp/kv_bytes_per_token": (28 * 3 * 64 * 2 * 4, dict(abs=0)),  # the top 2 cache nothing
        "smollm2-135m/harp-keep 25%/kv_bytes_per_token": (43008 + 2 * 64 * 2 * 4, dict(abs=0)),  # + 2 kept groups
        "smollm2-135m/all layers/spearman/induction vs copy-paste": (0.2679, dict(abs=0.03)),  # 2 passkeys
        "smollm2-135m/all layers/spearman/induction vs LRP": (0.0064, dict(abs=0.03)),
        # the release configuration: HARP's real drop of the top 2 layers (1,327,104), then FLAP's share of the release
        # budget (the top 2 layers' V + O in the paper's convention, 884,736)
        "smollm2-135m/harp+flap/params_removed": (2211840, dict(abs=0)),
        "smollm2-135m/attn-drop-top of harp+flap's layers/params_removed": (1770624, dict(abs=0)),
        "smollm2-135m/harp+flap/kl − flap [mlp] at harp+flap's drop": (0.1148, dict(abs=0.02)),
    },
    "07_head_importance": {  # 2 x 64 tokens score the heads, 2 x 63 predicted test tokens: sizes that only exercise it
        "smollm2-135m/dense/dense/0.000/ppl": (89.49, dict(rel=0.01)),
        "smollm2-135m/taylor/one-shot/0.500/ppl": (2303, dict(rel=0.05)),
        "smollm2-135m/lrp/one-shot/0.500/ppl": (240.7, dict(rel=0.05)),
        "smollm2-135m/HARP/HARP, searched α/0.500/ppl": (551.1, dict(rel=0.05)),
        "smollm2-135m/sensitivity/all heads off/most_sensitive_layer": (1, dict(abs=0)),
        "smollm2-135m/savings/taylor one-shot, 50% heads/kv_ratio": (1.0, dict(abs=0)),  # K, V stay: no layer emptied
        "smollm2-135m/savings/HARP, searched α, top 50% of layers/kv_ratio": (0.5, dict(abs=0)),
        "smollm2-135m/half_heads/prefill_attention_flop_ratio": (1.6251830, dict(rel=1e-6)),  # not 2: K, V stay
        "smollm2-135m/max_abs_logit_diff_sliced_vs_gated": (0.0, dict(abs=2e-3)),  # sliced == gated
    },
    "05_ablations": {
        "smollm2-135m/dense/-/enwiki": (89.49, dict(rel=0.01)),
        "smollm2-135m/dense/-/lee": (51.92, dict(rel=0.01)),
        "smollm2-135m/top-N/searched/enwiki": (107.0, dict(rel=0.05)),
        "smollm2-135m/top-N/α = 1/enwiki": (122.0, dict(rel=0.05)),
        "smollm2-135m/bottom-N/α = 1/enwiki": (2223, dict(rel=0.05)),
        "smollm2-135m/lowest attention BI/searched/enwiki": (95.13, dict(rel=0.05)),
        "smollm2-135m/random/α = 1/lee": (82.62, dict(rel=0.05)),
    },
}


def execute(name: str, out: Path, **params) -> None:
    pm.execute_notebook(str(NOTEBOOKS / f"{name}.ipynb"), str(out / f"{name}.ipynb"), cwd=str(NOTEBOOKS),
                        parameters={"OUT_DIR": str(out), **params}, progress_bar=False)


def fresh_run(name: str, tmp_path: Path, nbval_runs_it: bool) -> Path:
    """The folder holding this session's quick-default run of the notebook: nbval's, else one made now. Where nbval
    runs the notebook in this session (on another pytest-xdist worker, maybe still running), wait for it."""
    nbval_metrics = output_dir("quick") / f"{name}_metrics.json"
    deadline = time.time() + (NBVAL_WAIT if nbval_runs_it else 0)
    while True:
        if nbval_metrics.exists() and nbval_metrics.stat().st_mtime >= SESSION_START:
            return nbval_metrics.parent
        if nbval_failed(name) or time.time() >= deadline:
            break
        time.sleep(2)
    execute(name, tmp_path)
    return tmp_path


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_notebook_headline_numbers(name, tmp_path, request):
    nbval_runs_it = any(item.nodeid.startswith(f"notebooks/{name}.ipynb::") for item in request.session.items)
    out = fresh_run(name, tmp_path, nbval_runs_it)
    metrics = read_metrics(name, out)
    for key, (expected, tol) in GOLDEN[name].items():
        assert metrics[key] == pytest.approx(expected, **tol), key
    stems = {p.stem for p in out.glob(f"{name[:2]}_*.png") if p.stat().st_mtime >= SESSION_START}
    assert stems and all((out / f"{s}.csv").stat().st_mtime >= SESSION_START for s in stems)


def test_wrong_parameter_type_fails_in_the_first_cell(tmp_path):
    with pytest.raises(pm.PapermillExecutionError, match="bad notebook parameter: N_WINDOWS='two'"):
        execute("01_over_smoothing", tmp_path, N_WINDOWS="two")


PARAMETERS_CELL = """A = 1  # an int
B = ["x"]  # strings
C = 0  # an int, or a dict, or None: the check call says so (C=int | dict | None)
E = []  # an empty list says nothing about its elements (E=list[str])
F = 0.5  # a float (an int is accepted too)
PROFILE = "quick"  # a profile name
"""


def test_check_parameters():
    """The expected types come from the parameters cell's defaults, or from the check call where they do not say."""
    spec = parameter_spec(PARAMETERS_CELL, C=int | dict | None, E=list[str])
    check_values(dict(A=1, B=["x"], C=0, E=[], F=0.5, PROFILE="quick"), spec)
    check_values(dict(C={"arc_easy": 3}, E=["rows.csv"], F=1), spec)
    check_values(dict(C=None, B=("x", "y")), spec)
    with pytest.raises(TypeError, match="A=True must be int"):
        check_values(dict(A=True), spec)
    with pytest.raises(TypeError, match="B=\\['x', 2\\] must be a list of str"):
        check_values(dict(B=["x", 2]), spec)
    with pytest.raises(TypeError, match="C='5' must be int or dict or None"):
        check_values(dict(C="5"), spec)
    with pytest.raises(TypeError, match="E=\\[1\\] must be a list of str; F='0.5' must be float or int"):
        check_values(dict(E=[1], F="0.5"), spec)
    with pytest.raises(ValueError, match="PROFILE='medium'"):
        check_values(dict(PROFILE="medium"), spec)
    with pytest.raises(ValueError, match=r"types given for \['G'\]"):
        parameter_spec(PARAMETERS_CELL, G=int)
    with pytest.raises(TypeError, match="not a type"):
        parameter_spec(PARAMETERS_CELL, A="int")


def study_params(name: str) -> type[StudyParams]:
    """The parameter class of a notebook's study (the StudyParams subclass whose NOTEBOOK is `name`)."""
    for module in STUDY_MODULES:
        importlib.import_module(module)
    found = [c for c in all_subclasses(StudyParams) if c.NOTEBOOK == name]
    assert len(found) == 1, f"{name}: {found}"
    return found[0]


def all_subclasses(cls: type) -> list[type]:
    return [c for sub in cls.__subclasses__() for c in (sub, *all_subclasses(sub))]


def declared_types(name: str) -> dict:
    """The types a notebook's parameter class declares where the defaults do not say them (e.g. LIMIT=int | dict)."""
    return dict(study_params(name).TYPES)


@pytest.mark.parametrize("name", sorted(p.stem for p in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb")))
def test_notebook_defaults_and_profiles_pass_the_notebooks_own_check(name):
    """Each notebook's defaults pass its one-line check, and every profile sets only parameters it has, with the
    right types (a typo in full.yaml would otherwise surface only hours into `make reproduce`)."""
    source = parameters_source(name)
    types_ = declared_types(name)
    spec = parameter_spec(source, **types_)
    namespace: dict = {}
    exec(source, {}, namespace)
    assert set(namespace) == set(spec) and {"PROFILE", "OUT_DIR", "SEED"} <= set(spec)
    check_parameters(name, namespace, **types_)
    params = study_params(name)
    assert params.defaults().seed == namespace["SEED"]  # the study's object builds from the defaults
    for profile in runner_profiles():
        values = runner.profile_parameters(profile, name)
        assert set(values) <= set(spec), f"{profile}.yaml sets {set(values) - set(spec)}, which {name} lacks"
        check_values(values, spec)
        params.defaults(**values)  # and from every profile
    with pytest.raises(ValueError, match=f"{params.__name__} has no parameter 'N_TYPO'"):
        params.defaults(N_TYPO=1)
    with pytest.raises(ValueError, match="needs the parameter 'SEED'"):
        params.from_values({k: v for k, v in namespace.items() if k != "SEED"})
    assert set(pm.inspect_notebook(str(NOTEBOOKS / f"{name}.ipynb"))) == set(spec)  # papermill can read every one
    with pytest.raises(FileNotFoundError, match="notebooks/"):
        parameters_source("99_missing")


def runner_profiles() -> list[str]:
    return sorted(p.stem for p in (NOTEBOOKS / "profiles").glob("*.yaml"))


def test_runner_keeps_going_and_reports(monkeypatch, capsys):
    calls = []

    def fake(path, profile, out_dir):
        calls.append(path.name)
        return ("FAILED", 1.0, "boom") if path.name.startswith("01") else ("ok", 2.0, "")

    monkeypatch.setattr(runner, "run_notebook", fake)
    assert runner.main(["--profile", "quick"]) == 1
    assert len(calls) == len(list(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))) >= 2
    out = capsys.readouterr().out
    assert "FAILED" in out and "boom" in out and " ok " in out
    assert runner.main(["--profile", "nope"]) == 2  # more refusals: test_bad_inputs.py
    assert "no profile 'nope'" in capsys.readouterr().err


def test_runner_refuses_a_profile_name_the_notebook_lacks():
    with pytest.raises(ValueError, match="'N_WINDOW', which notebook 01_over_smoothing has no parameter of"):
        runner.check_profile("01_over_smoothing", {"N_WINDOW": 2, "SEED": 0})
    assert runner.check_profile("01_over_smoothing", {"N_WINDOWS": 2}) == {"N_WINDOWS": 2}
