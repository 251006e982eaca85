"""Notebook 09's study (issue 29): its refusals before any model loads, the best baseline, and the scale table's
differences against dense and against the best baseline, on hand-made tables whose answers are known."""

import copy
import math

import pandas as pd
import pytest
import torch
from torch import nn

from conftest import make_tiny
from harp_src.compare.points import TIMING_GROUP, pack_groups, rebuild, timing_groups
from harp_src.measure.timing import kv_bytes_formula
from harp_src.model import loading
from harp_src.model.loading import PACKAGED, param_count, require_installed
from harp_src.model.weights import held_bytes, linear_with, sharing_copy
from harp_src.report.plots import curves_with_intervals, short_count
from harp_src.studies.frontier import FrontierParams, frontier_graph
from harp_src.studies.scale import (
    BEST_REFERENCE,
    SCALE_COLUMNS,
    ScaleParams,
    best_baseline,
    generation_scores,
    kl_best,
    scale_table,
    smaller_models,
)


def test_a_missing_setup_full_model_is_refused_naming_make_setup_full(monkeypatch):
    monkeypatch.setattr(loading.Packaged, "missing", lambda self: list(self.packages) if "qwen" in self.name else [])
    with pytest.raises(ModuleNotFoundError, match=r"qwen2\.5-coder-1\.5b.*run `make setup-full` first"):
        require_installed(["smollm2-135m", "qwen2.5-coder-1.5b"])
    with pytest.raises(ModuleNotFoundError, match="make setup-full"):  # in the study's check, before any model loads
        ScaleParams.defaults(MODELS=["qwen2.5-coder-1.5b"]).check()
    require_installed(["smollm2-135m", "some/hub-id", "/a/local/folder"])  # only packaged names are checked


@pytest.mark.parametrize(("name", "value", "match"), [
    ("TASK_METHODS", ["harp", "llm-pruner"], "TASK_METHODS names 'llm-pruner', which is not measured"),
    ("GEN_METHODS", ["nonsense"], "GEN_METHODS names 'nonsense'"),
    ("METHODS", ["flap:heads"], "method 'flap' has no scope 'heads'"),
    ("SPEED_LENS", [128, 64], "SPEED_LENS must be two increasing"),
    ("N_LAYERS", -1, "N_LAYERS"),
])
def test_bad_parameters_are_one_clear_error(name, value, match):
    with pytest.raises(ValueError, match=match):
        ScaleParams.defaults(**{name: value}).check()


def test_param_count_reads_the_config_only():
    assert param_count("smollm2-135m") == 134515008  # SmolLM2-135M with its tied embedding counted once
    assert PACKAGED["qwen2.5-coder-1.5b"].make == "make setup-full" and PACKAGED["smollm2-135m"].make == "make setup"


def test_best_baseline_is_the_lowest_mean_kl_and_never_a_harp_variant():
    fid = pd.DataFrame({"method": ["harp", "harp", "harp-mean", "flap", "flap", "shortgpt", "shortgpt"],
                        "scope": ["attention", "attention", "attention", "mlp", "mlp", "blocks", "blocks"],
                        "kl": [0.01, 0.01, 0.001, 0.2, 0.4, 0.25, 0.3]})
    assert best_baseline(fid) == "shortgpt"  # mean KL 0.275 against flap's 0.3; harp-mean's 0.001 is not a baseline
    fid.loc[4, "kl"] = 0.2
    assert best_baseline(fid) == "flap [mlp]"
    wanda = pd.DataFrame({"method": ["wanda"], "scope": ["linear"], "kl": [0.0001]})
    assert best_baseline(pd.concat([fid, wanda])) == "flap [mlp]"  # unstructured: removes no parameter


def tables():
    frontier = pd.DataFrame([
        dict(model="m", method="harp", scope="attention", level="N=2", metric="kl", value=0.5, ci_low=0.4,
             ci_high=0.6, n=16),
        dict(model="m", method="harp", scope="attention", level="N=2", metric="lambada_openai − dense", value=-0.2,
             ci_low=-0.25, ci_high=-0.15, n=300),
        dict(model="m", method="harp", scope="attention", level="N=1", metric="kl", value=9.0, ci_low=8.0,
             ci_high=10.0, n=16),  # another level: never read
    ])
    vs = pd.DataFrame([  # each point minus HARP
        dict(model="m", level="N=2", metric="kl", method="flap [mlp]", diff=-0.3, ci_low=-0.35, ci_high=-0.25, n=16),
        dict(model="m", level="N=2", metric="kl", method="shortgpt", diff=0.1, ci_low=0.0, ci_high=0.2, n=16),
        dict(model="m", level="N=2", metric="kl", method="harp-mean", diff=-0.45, ci_low=-0.5, ci_high=-0.4, n=16),
        dict(model="m", level="N=2", metric="kl", method="wanda", diff=-0.9, ci_low=-1.0, ci_high=-0.8, n=16),
        dict(model="m", level="N=2", metric="lambada_openai", method="flap [mlp]", diff=0.05, ci_low=-0.01,
             ci_high=0.11, n=300),
        dict(model="m", level="N=2", metric="lambada_openai", method="shortgpt", diff=0.12, ci_low=0.06,
             ci_high=0.18, n=300),
    ])
    return frontier, vs


def test_scale_table_sets_harp_against_dense_and_the_best_baseline_per_metric():
    frontier, vs = tables()
    S = scale_table(frontier, vs, {"m": "N=2"}, {"m": 1000})
    assert list(S.columns[: len(SCALE_COLUMNS)]) == SCALE_COLUMNS
    got = {(r.metric, r.reference): r for r in S.itertuples()}
    assert set(got) == {("kl", "dense"), ("kl", BEST_REFERENCE), ("lambada_openai", "dense"),
                        ("lambada_openai", BEST_REFERENCE)}
    kl_dense = got["kl", "dense"]
    assert (kl_dense.diff, kl_dense.ci_low, kl_dense.ci_high, kl_dense.n) == (0.5, 0.4, 0.6, 16)
    kl_best = got["kl", BEST_REFERENCE]  # flap: lowest KL among structured baselines (not harp-mean, not wanda)
    assert kl_best.baseline == "flap [mlp]" and math.isclose(kl_best.diff, 0.3)
    assert (kl_best.ci_low, kl_best.ci_high) == (0.25, 0.35)  # HARP − flap: the interval flips with the sign
    # one rule for every metric: the baseline closest to dense on KL (flap), not the per-metric maximum (shortgpt's
    # +0.12 on LAMBADA), which would favour the baselines
    lam_best = got["lambada_openai", BEST_REFERENCE]
    assert lam_best.baseline == "flap [mlp]" and math.isclose(lam_best.diff, -0.05)
    assert (lam_best.ci_low, lam_best.ci_high) == (-0.11, 0.01)
    assert (S.params == 1000).all() and (S.method == "harp").all()


def test_scale_figure_ticks_the_model_sizes_and_names_each_line_by_its_reference():
    S = pd.DataFrame({"params": [134_515_008, 268_098_176, 1_777_088_000] * 2, "diff": [0.1, 0.2, 0.3] * 2,
                      "ci_low": [0.0] * 6, "ci_high": [0.4] * 6, "reference": ["dense"] * 3 + [BEST_REFERENCE] * 3,
                      "method": ["harp"] * 6, "metric": ["kl"] * 6})
    fig = curves_with_intervals(S, "params", "diff", "ci_low", "ci_high", hue="reference", style="method",
                                col="metric", title="t", xlabel="x", ylabel="y", logx=True, zero=True)
    ax = fig.axes[0]
    fig.canvas.draw()
    assert list(ax.get_xticks()) == [134_515_008, 268_098_176, 1_777_088_000]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["135M", "268M", "1.8B"]
    assert not any(t.get_text() for t in ax.get_xticklabels(minor=True))  # no 3×10⁸, 4×10⁸ ... running together
    legend = ax.get_legend()
    assert [t.get_text() for t in legend.get_texts()] == ["dense", BEST_REFERENCE]  # one method: no "· harp"
    assert legend.get_title().get_text() == "reference"
    assert [short_count(v) for v in (512, 2048, 30_000, 5e6, 1.2e9, -3e6)] == ["512", "2k", "30k", "5M", "1.2B", "-3M"]


def test_smaller_models_are_empty_until_06_has_its_frontier_tables(tmp_path):
    frontier, vs = smaller_models(tmp_path, ["qwen"])[:2]
    assert frontier.empty and vs.empty
    f, v = tables()
    f = pd.concat([f, f.iloc[:1].assign(method="harp-bi")])
    f.to_csv(tmp_path / "06_frontier.csv", index=False)
    v.to_csv(tmp_path / "06_vs_harp.csv", index=False)
    frontier, vs, quarter = smaller_models(tmp_path, ["qwen"])
    assert quarter == {"m": "N=2"} and len(frontier) == 4 and len(vs) == 6
    assert smaller_models(tmp_path, ["m"])[2] == {}  # a model measured here is not read from 06


def test_a_steps_key_holds_only_what_it_depends_on():
    """06's gold-bpb parameters key only its gold steps: changing them keeps every other stored step of a long run
    (the same ids), and a step's id changes with what it does depend on."""
    p, q = FrontierParams.defaults(), FrontierParams.defaults(GOLD_LIMIT=7, GOLD_TASKS=["mbpp_gold_bpb"])
    graphs = [frontier_graph(x)[0] for x in (p, q, FrontierParams.defaults(N_EVAL=3))]
    gold = [{i for i, step in g.steps.items() if "gold" in step.label} for g in graphs]
    assert set(graphs[0].steps) - gold[0] == set(graphs[1].steps) - gold[1]
    assert gold[0] and gold[1] and not gold[0] & gold[1]
    points = [{i for i, step in g.steps.items() if "point" in step.label} for g in graphs]
    assert points[0] and not points[0] & points[2]  # more evaluation windows: every point is measured again
    with pytest.raises(ValueError, match="GOLD_METHODS names 'nope'"):
        FrontierParams.defaults(GOLD_METHODS=["nope"]).check()


def test_generation_scores_pair_with_dense_and_say_when_dense_scores_nothing():
    rows = [dict(model=m, method=meth, scope=sc, level=lv, task="gsm8k", doc_id=d, correct=c)
            for m, solved in (("a", {"dense": [1, 1, 0, 1] * 5, "harp": [0, 1, 0, 0] * 5}),
                              ("b", {"dense": [0] * 20, "harp": [0] * 20}))
            for meth, cs in solved.items()
            for (sc, lv) in [("", "") if meth == "dense" else ("attention", "N=2")]
            for d, c in enumerate(cs)]
    G = generation_scores({"generation": pd.DataFrame(rows)}).set_index(["model", "method"])
    assert G.loc[("a", "dense"), "value"] == 0.75 and G.loc[("a", "harp"), "value"] == 0.25
    assert G.loc[("a", "harp"), "diff"] == pytest.approx(-0.5)  # paired on the same 20 items
    assert G.loc[("a", "harp"), "diff_high"] < 0
    assert G.loc[("a", "harp"), "reportable"] and not G.loc[("b", "harp"), "reportable"]


def test_no_structured_baseline_means_no_best():
    fid = pd.DataFrame({"method": ["harp", "wanda"], "scope": ["attention", "linear"], "kl": [1.0, 0.1]})
    assert best_baseline(fid) == ""
    _, vs = tables()
    assert kl_best(vs[vs.method == "harp-mean"], "m", "N=2") == ""


def test_timing_groups_put_weight_sharing_copies_together_and_a_full_copy_alone():
    dense = make_tiny("llama")
    harp_row = {"record": None, "alphas": {2: 0.5, 3: 0.0}, "method": "harp"}
    builders = {"harp": lambda: rebuild(dense, harp_row), "full": lambda: copy.deepcopy(dense),
                "harp-mean": lambda: rebuild(dense, harp_row | {"method": "harp-mean"})}
    assert timing_groups(dense, builders, 64) == [["harp", "full", "harp-mean"]]  # a tiny model: all at once
    cache, weights = kv_bytes_formula(dense.config, 64), held_bytes(dense)
    shared = held_bytes(rebuild(dense, harp_row), dense)  # its norms and buffers only
    assert 0 < shared < weights / 20
    # room for the full copy, or for both HARP copies, but not for the full copy beside a HARP copy: first fit
    budget = 2 * (weights + cache) + cache + shared - 1
    assert timing_groups(dense, builders, 64, budget) == [["harp", "harp-mean"], ["full"]]
    assert timing_groups(dense, builders, 64, budget=1) == [["harp"], ["full"], ["harp-mean"]]  # each alone


def test_held_bytes_counts_each_storage_once_and_leaves_out_what_a_copy_shares():
    dense = make_tiny("gemma3")  # tied embeddings: one storage for two parameters
    own = sum(p.numel() * p.element_size() for p in dense.parameters()) + sum(
        b.numel() * b.element_size() for b in dense.buffers())
    assert held_bytes(dense) == own
    assert held_bytes(copy.deepcopy(dense), dense) == own
    shared = sharing_copy(dense)
    copied = [p for m in shared.modules() if not isinstance(m, (nn.Linear, nn.Embedding))
              for p in m.parameters(recurse=False)] + list(shared.buffers())  # norms and buffers
    unshared = sum(t.numel() * t.element_size() for t in copied)
    assert held_bytes(shared, dense) == unshared


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_with_holds_copies_of_what_it_is_given(dtype):
    """Pruning's new Linears: exactly the given weight and bias, in their own storage (the source can change after),
    trainable as nn.Linear's are; the same output as the source layer on the kept rows (to rounding: the matmul's
    blocking depends on the number of rows)."""
    torch.manual_seed(0)
    source = nn.Linear(6, 5, dtype=dtype)
    rows = torch.tensor([0, 2, 3])
    new = linear_with(source.weight[rows], source.bias[rows])
    assert (new.in_features, new.out_features, new.weight.dtype) == (6, 3, dtype)
    assert new.weight.requires_grad and new.bias.requires_grad
    assert torch.equal(new.weight, source.weight[rows]) and torch.equal(new.bias, source.bias[rows])
    x = torch.randn(4, 6, dtype=dtype)
    torch.testing.assert_close(new(x), source(x)[:, rows])
    with torch.no_grad():
        source.weight.zero_()
        source.bias.zero_()
    assert new.weight.abs().sum() > 0 and new.bias.abs().sum() > 0
    assert linear_with(torch.ones(2, 3)).bias is None


def test_pack_groups_first_fit_in_order():
    assert pack_groups(dict.fromkeys("abcdefgh", 0), 0, TIMING_GROUP) == [list("abcdef"), list("gh")]
    assert pack_groups({"a": 1, "b": 5, "c": 9, "d": 3}, 6, 3) == [["a", "b"], ["c"], ["d"]]
    assert pack_groups({"a": 1, "b": 5, "c": 9, "d": 3, "e": 2}, 6, 3) == [["a", "b"], ["c"], ["d", "e"]]
    assert pack_groups({"a": 2, "b": 5, "c": 2}, 6, 3) == [["a", "c"], ["b"]]
    with pytest.raises(ValueError, match="at least one model"):
        pack_groups({"a": 1}, 6, 0)
