"""α search: cached ≡ naive, the greedy procedure itself, search-free α, FLOP model, bad input."""

import math

import numpy as np
import pytest
import torch
from transformers import LlamaConfig

from conftest import make_tiny
from harp_src import apply_harp, load_model, perplexity, ppl_windows
from harp_src.measure.flops import layer_flops, model_flops, search_flops, speedup_bound
from harp_src.measure.search_bench import benchmark_search
from harp_src.method.prefix import Boundaries, chunked_nll, ppl_of_plan
from harp_src.method.search import bootstrap_counts, closed_form_alphas, refine_alphas, resample_search, search_alphas
from harp_src.model.adapter import get_adapter


def calib(n=4, t=24, seed=0):
    return torch.randint(3, 128, (n, t), generator=torch.Generator().manual_seed(seed))


def test_cached_search_equals_naive(family):
    model = make_tiny(family)
    h_cached, h_naive = [], []
    a = search_alphas(model, calib(), [1, 2, 3], history=h_cached)
    b = search_alphas(model, calib(), [1, 2, 3], cache_prefix=False, history=h_naive)
    assert a == b
    assert [r["calib_ppl"] for r in h_cached] == pytest.approx([r["calib_ppl"] for r in h_naive], rel=1e-6)


def test_greedy_is_top_down_and_leaves_model_dense():
    model = make_tiny("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    history = []
    alphas = search_alphas(model, calib(), [0, 2], grid=(0.0, 0.5, 1.0), history=history)
    assert [r["layer"] for r in history] == [2, 2, 2, 0, 0, 0]  # top layer first
    assert model.state_dict().keys() == before.keys()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    # each chosen α is the minimum of its row, and the top layer's scores were taken with layer 0 dense
    for layer in (2, 0):
        rows = [r for r in history if r["layer"] == layer]
        assert alphas[layer] == min(rows, key=lambda r: (r["calib_ppl"], r["alpha"]))["alpha"]
    pruned = make_tiny("llama")
    apply_harp(pruned, [2], {2: alphas[2]})
    expected = perplexity(pruned, calib(), progress=False)
    assert next(r for r in history if r["layer"] == 2 and r["chosen"])["calib_ppl"] == pytest.approx(expected)


def test_memo_reuses_shared_top_layers_and_changes_nothing(monkeypatch):
    """Sets that share their top layers share those layers' α's; the memo must skip exactly that work."""
    model = make_tiny("gemma3")
    fresh = {tuple(s): search_alphas(model, calib(), s, grid=(0.0, 0.3, 0.6, 1.0)) for s in ([3, 2, 1], [3, 2, 0])}
    calls = []
    original = Boundaries.window_nll_from
    monkeypatch.setattr(Boundaries, "window_nll_from",
                        lambda self, start: calls.append(start) or original(self, start))
    memo, history = {}, []
    deep = search_alphas(model, calib(), [3, 2, 1], grid=(0.0, 0.3, 0.6, 1.0), memo=memo)
    other = search_alphas(model, calib(), [3, 2, 0], grid=(0.0, 0.3, 0.6, 1.0), memo=memo, history=history)
    assert deep == fresh[(3, 2, 1)] and other == fresh[(3, 2, 0)]
    assert calls == [3] * 4 + [2] * 4 + [1] * 4 + [0] * 4  # layers 3 and 2 were searched once
    assert [r["layer"] for r in history] == [3] * 4 + [2] * 4 + [0] * 4  # history still reports every layer
    # a different grid is a different search
    search_alphas(model, calib(), [3], grid=(0.0, 1.0), memo=memo)
    assert calls[-2:] == [3, 3]


def test_ties_go_to_the_smaller_alpha():
    """With o_proj zeroed, every α gives exactly the same model: the smallest α must win."""
    model = make_tiny("llama")
    with torch.no_grad():
        model.model.layers[3].self_attn.o_proj.weight.zero_()
    history = []
    assert search_alphas(model, calib(), [3], grid=(1.0, 0.4, 0.7), history=history) == {3: 0.4}
    assert len({r["calib_ppl"] for r in history}) == 1


def test_refine_never_worsens_calibration_ppl():
    model = make_tiny("qwen2")
    greedy = search_alphas(model, calib(), [1, 2, 3])
    refined = refine_alphas(model, calib(), greedy)

    def ppl(alphas):
        m = make_tiny("qwen2")
        apply_harp(m, list(alphas), alphas)
        return perplexity(m, calib(), progress=False)

    assert ppl(refined) <= ppl(greedy) * (1 + 1e-6)


def test_closed_form_alpha_is_least_squares_scale():
    model = make_tiny("gemma3")
    alphas = closed_form_alphas(model, calib(), [1, 3])
    assert set(alphas) == {1, 3} and all(0.0 <= a <= 1.0 for a in alphas.values())


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(layers=[1], grid=()), "empty"),
        (dict(layers=[1], grid=(0.0, 1.5)), "outside"),
        (dict(layers=[7], grid=(0.0,)), "out of range"),
        (dict(layers=[], grid=(0.0,)), "no layers"),
    ],
)
def test_bad_search_input(kwargs, message):
    with pytest.raises(ValueError, match=message):
        search_alphas(make_tiny("llama"), calib(), **kwargs)


def test_search_and_pruning_share_one_layer_check():
    """search_alphas validates layers as apply_harp does: an already pruned layer is refused by both."""
    model = make_tiny("llama")
    apply_harp(model, [3], 1.0)
    for call in (lambda: search_alphas(model, calib(), [2, 3]), lambda: apply_harp(model, [2, 3], 1.0)):
        with pytest.raises(ValueError, match=r"layers \[3\] are already pruned"):
            call()
    with pytest.raises(ValueError, match="duplicates; give each layer once"):
        search_alphas(make_tiny("llama"), calib(), [1, 1])


def test_ppl_of_plan_equals_pruning_for_real(family):
    """The cached-boundary perplexity of a plan equals the perplexity of a model pruned by that plan."""
    windows = calib()
    bounds = Boundaries(make_tiny(family), windows)
    alphas = {1: 0.3, 3: 0.0}
    pruned = make_tiny(family)
    apply_harp(pruned, list(alphas), alphas)
    assert ppl_of_plan(bounds, alphas) == pytest.approx(perplexity(pruned, windows, progress=False), rel=1e-5)
    assert ppl_of_plan(bounds, {}) == pytest.approx(perplexity(make_tiny(family), windows, progress=False), rel=1e-6)


def test_bad_calibration_windows():
    with pytest.raises(ValueError, match="non-empty"):
        search_alphas(make_tiny("llama"), torch.zeros(0, 8, dtype=torch.long), [1])
    with pytest.raises(ValueError, match="context"):
        search_alphas(make_tiny("llama"), torch.zeros(1, 300, dtype=torch.long), [1])


def test_flop_model_by_hand():
    cfg = LlamaConfig(hidden_size=8, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                      intermediate_size=16, vocab_size=10)  # head_dim 4
    t = 3
    # q 8·8, k 8·4, v 8·4, o 8·8, mlp 3·8·16 MACs per token; scores+weighted sum 2·2·4 per causal pair (6 pairs)
    dense = 2 * ((64 + 32 + 32 + 64 + 384) * t + 2 * 2 * 4 * 6)
    assert layer_flops(cfg, t) == dense
    assert layer_flops(cfg, t, 1.0, fold=True) == 2 * (32 + 32 + 384) * t
    assert layer_flops(cfg, t, 1.0, fold=False) == 2 * (32 + 64 + 384) * t
    assert layer_flops(cfg, t, 0.0) == 2 * 384 * t
    assert model_flops(cfg, t) == 2 * dense + 2 * 8 * 10 * t
    assert speedup_bound(cfg, t, {}) == 1.0
    bounds = [speedup_bound(cfg, 64, {i: 1.0 for i in range(n)}) for n in range(3)]
    assert bounds == sorted(bounds) and bounds[0] == 1.0


def test_search_flop_ratio_for_smollm2_and_llama():
    smol = LlamaConfig(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                       intermediate_size=1536, vocab_size=49152)
    llama = LlamaConfig(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                        intermediate_size=14336, vocab_size=128256)
    assert 3.0 < search_flops(smol, list(range(22, 30)), 11, 512)["predicted_ratio"] < 3.5
    assert 4.8 < search_flops(llama, list(range(24, 32)), 11, 512)["predicted_ratio"] < 5.5


@pytest.mark.slow
def test_smollm2_cached_search_equals_naive():
    model, tok = load_model("smollm2-135m")
    windows = ppl_windows(tok, "enwiki", "train", 2, 64, seed=0)
    grid = (0.0, 0.3, 0.6, 1.0)
    cached = search_alphas(model, windows, "top:2", grid)
    assert cached == search_alphas(model, windows, "top:2", grid, cache_prefix=False)
    assert all(math.isfinite(a) for a in cached.values())


def test_interleaved_benchmark_times_both_and_agrees_with_the_search(family):
    model = make_tiny(family)
    history = []
    expected = search_alphas(model, calib(), [1, 2, 3], grid=(0.0, 0.5, 1.0), history=history)
    bench = benchmark_search(model, calib(), [1, 2, 3], grid=(0.0, 0.5, 1.0), threads=1, warmup=1)
    assert bench["same_alphas"] is True and bench["alphas"] == expected
    assert bench["cached_s"] > 0 and bench["naive_s"] > 0 and bench["threads"] == 1
    assert bench["measured_ratio"] == pytest.approx(bench["naive_s"] / bench["cached_s"])
    assert bench["candidates"] == 9 and bench["max_rel_ppl_diff"] < 1e-6
    assert [r["calib_ppl"] for r in bench["history"]] == pytest.approx([r["calib_ppl"] for r in history], rel=1e-9)
    assert bench["flop_ratio"] == pytest.approx(search_flops(model.config, [3, 2, 1], 3, 24)["predicted_ratio"])


@pytest.mark.parametrize("chunk", [1, 5, 64, 1000])
def test_chunked_nll_equals_one_lm_head_call(family, chunk):
    model = make_tiny(family)
    ids = calib(3, 24)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        full = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten(),
                                                 reduction="sum").item()
        normed = model.get_decoder()(input_ids=ids).last_hidden_state
    assert chunked_nll(get_adapter(model), normed, ids, chunk) == pytest.approx(full, rel=1e-6)


def test_recorded_window_nlls_add_up_to_the_searched_perplexities(family):
    model, windows, grid = make_tiny(family), calib(n=5), (0.0, 0.5, 1.0)
    record, history = {}, []
    alphas = search_alphas(model, windows, [1, 3], grid=grid, history=history, window_nll=record)
    assert sorted(record) == [1, 3] and all(record[i].shape == (3, 5) for i in record)
    for r in history:
        total = record[r["layer"]][grid.index(r["alpha"])].sum()
        assert math.exp(total / (5 * 23)) == pytest.approx(r["calib_ppl"], rel=1e-12)
    # every window drawn once is the search itself
    ones = resample_search(record, np.ones((1, 5)), grid)
    assert dict(zip(ones.layer, ones.alpha, strict=True)) == alphas


def test_a_resample_of_one_window_is_the_search_on_that_window():
    """The top layer's candidates do not depend on any earlier choice: resampling window k alone must give the
    α a fresh search on window k gives it."""
    model, windows, grid = make_tiny("llama"), calib(n=4), (0.0, 0.25, 0.5, 0.75, 1.0)
    record = {}
    search_alphas(model, windows, [2, 3], grid=grid, window_nll=record)
    picks = resample_search(record, np.eye(4), grid)
    top = picks[picks.layer == 3].sort_values("replicate").alpha.tolist()
    assert top == [search_alphas(model, windows[k : k + 1], [3], grid=grid)[3] for k in range(4)]


def test_bootstrap_counts_draw_the_asked_number_of_windows():
    counts = bootstrap_counts(10, 3, 500, seed=1)
    assert counts.shape == (500, 10) and (counts.sum(1) == 3).all() and (counts >= 0).all()
    assert np.array_equal(counts, bootstrap_counts(10, 3, 500, seed=1))
    assert counts.sum(0).min() > 0  # every window gets drawn somewhere
    with pytest.raises(ValueError, match=">= 1"):
        bootstrap_counts(10, 0, 5)


def test_bad_resampling_input():
    record = {3: np.zeros((2, 4))}
    with pytest.raises(ValueError, match="expected \\(3 grid values, 4 windows"):
        resample_search(record, np.ones((1, 4)), (0.0, 0.5, 1.0))
    with pytest.raises(ValueError, match="non-negative"):
        resample_search(record, -np.ones((1, 4)), (0.0, 1.0))
    with pytest.raises(ValueError, match="empty"):
        resample_search({}, np.ones((1, 4)), (0.0, 1.0))
    with pytest.raises(ValueError, match="cache_prefix=True"):
        search_alphas(make_tiny("llama"), calib(), [3], cache_prefix=False, window_nll={})
