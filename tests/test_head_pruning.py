"""Choosing heads to remove: global vs uniform, GQA slots, the iterative schedule, and the iterative loop (issue 14)."""

import copy
import math

import pytest
import torch

from conftest import make_tiny
from harp_src.eval.fidelity import reference_states
from harp_src.heads.choice import check_fraction, choose_heads, count_heads, iterative_schedule, without
from harp_src.heads.finetune import FinetuneSpec
from harp_src.heads.removal import slice_off_heads
from harp_src.measure.flops import half_heads_bound, heads_attention_flops
from harp_src.model.adapter import get_adapter
from harp_src.pruning.slicing import balanced_groups
from harp_src.studies.head_importance import HeadImportanceParams, ModelRun, head_importance_study, iterative_rows


@pytest.mark.parametrize("bad", [0, 1, 1.5, -0.1, True, "0.5", None])
def test_fraction_outside_the_open_interval_is_refused(bad):
    with pytest.raises(ValueError, match="strictly between 0 and 1"):
        check_fraction(bad)


def test_global_ranking_takes_the_lowest_slots_and_keeps_gqa_balanced():
    ad = get_adapter(make_tiny("llama"))  # 4 layers, 4 heads in 2 KV groups: a slot is 2 heads
    scores = torch.arange(16, dtype=torch.float64).view(4, 4)
    scores[3] = torch.tensor([-5.0, 9.0, -4.0, 9.0])  # layer 3 has the two weakest heads, one per group
    heads = choose_heads(scores, ad, 4)
    assert heads == {0: [0, 2], 3: [0, 2]}
    for i, hs in heads.items():
        balanced_groups(ad, i, hs)
    assert count_heads(choose_heads(scores, ad, 5)) == 6  # 2.5 slots round half-up


def test_uniform_takes_the_same_number_of_slots_from_every_layer():
    ad = get_adapter(make_tiny("mistral"))  # MQA: a slot is one head
    scores = torch.rand(4, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    scores[0] = -1.0  # global ranking would empty layer 0 first
    uniform = choose_heads(scores, ad, 8, mode="uniform")
    assert [len(uniform[i]) for i in range(4)] == [2, 2, 2, 2]
    assert choose_heads(scores, ad, 4, mode="global") == {0: [0, 1, 2, 3]}
    odd = choose_heads(scores, ad, 6, mode="uniform")
    assert sorted(len(h) for h in odd.values()) == [1, 1, 2, 2]
    for i, hs in uniform.items():  # within a layer, its weakest heads
        assert set(hs) == set(torch.argsort(scores[i])[:2].tolist())


def test_removed_heads_stay_removed():
    ad = get_adapter(make_tiny("llama"))
    scores = torch.rand(4, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    first = choose_heads(scores, ad, 4)
    second = choose_heads(without(scores, first), ad, 8)
    for i, hs in first.items():
        assert set(hs) <= set(second[i])
    with pytest.raises(ValueError, match="layers × heads"):
        choose_heads(scores[:2], ad, 2)
    with pytest.raises(ValueError, match="global"):
        choose_heads(scores, ad, 2, mode="random")


def test_iterative_schedule_removes_ten_percent_of_what_is_left_in_whole_slots():
    ad = get_adapter(make_tiny("mistral"))  # 16 heads, slot 1
    counts = iterative_schedule(ad, 0.5, 0.1)
    expected, removed = [], 0
    while removed < 8:
        removed = min(8, removed + max(1, math.floor(0.1 * (16 - removed) + 0.5)))
        expected.append(removed)
    assert counts == expected == [2, 3, 4, 5, 6, 7, 8]
    assert iterative_schedule(get_adapter(make_tiny("llama")), 0.5, 0.1) == [2, 4, 6, 8]


def test_iterative_loop_removes_the_scheduled_counts_and_fine_tunes(ids):
    dense = make_tiny("llama")
    ad = get_adapter(dense)
    g = torch.Generator().manual_seed(3)
    calib, ft, test = (torch.randint(3, 128, (n, 16), generator=g) for n in (2, 2, 2))
    states = reference_states(dense, test)
    before = [p.detach().clone() for p in dense.parameters()]
    run = ModelRun("tiny", dense, calib, ft, test, states)
    parts, log, removed = iterative_rows(run, "taylor", 0.5, 0.1, 0, FinetuneSpec(steps=3, lr=1e-2))
    schedule = iterative_schedule(ad, 0.5, 0.1)
    assert [r["heads_removed"] for r in log] == schedule == [2, 4, 6, 8]
    assert count_heads(removed) == 8 and len(parts) == 4
    assert all(r["ft_loss_last"] < r["ft_loss_first"] for r in log)
    for p, q in zip(dense.parameters(), before, strict=True):  # the loop worked on a copy
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    with pytest.raises(ValueError, match="steps"):
        iterative_rows(run, "taylor", 0.5, 0.1, 0, FinetuneSpec(steps=0))


@pytest.mark.parametrize("n", [2, 4, 6, 10, 16])
def test_every_choice_is_a_valid_gqa_removal(n, ids):
    model = make_tiny("llama")
    ad = get_adapter(model)
    scores = torch.rand(4, 4, generator=torch.Generator().manual_seed(n), dtype=torch.float64)
    for mode in ("global", "uniform"):
        heads = choose_heads(scores, ad, n, mode=mode)
        assert count_heads(heads) == n
        pruned = copy.deepcopy(model)
        slice_off_heads(pruned, heads)  # refuses anything unbalanced
        with torch.no_grad():
            assert torch.isfinite(pruned(input_ids=ids).logits).all()


def test_half_heads_bound_is_below_two_when_k_and_v_stay():
    config = make_tiny("llama").config  # d 64, 4 heads of 16, 2 KV heads
    t, d, hd = 32, 64, 16
    pairs = t * (t + 1) / 2

    def attn(h, kv):
        return 2 * ((d * h * hd + 2 * d * kv * hd + h * hd * d) * t + 2 * h * hd * pairs)
    bound = half_heads_bound(config, t)
    assert bound["prefill_attention_flop_ratio"] == pytest.approx(attn(4, 2) / attn(2, 2), rel=1e-12)
    assert 1 < bound["prefill_attention_flop_ratio"] < 2
    expected = 2 * attn(4, 2) + attn(2, 2)  # layer 3 emptied: no attention at all
    assert heads_attention_flops(config, {0: 4, 1: 4, 2: 2, 3: 0}, t) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("kwargs, match", [(dict(FRACTIONS=[1.5]), "strictly between"),
                                           (dict(TARGET=0.0), "strictly between"),
                                           (dict(ITERATIVE_METRICS=["nope"]), "unknown metric"),
                                           (dict(FT_STEPS=0), "steps"),
                                           (dict(N_SENS=9), "N_SENS")])
def test_study_refuses_bad_parameters_before_loading_anything(kwargs, match):
    params = HeadImportanceParams.defaults(**{"MODELS": ["no-such-model"], "N_TEST": 2, "ITERATIVE_METRICS": ["taylor"],
                                              **kwargs})
    with pytest.raises(ValueError, match=match):
        head_importance_study(params)
