"""Head gates, Taylor masking confidence, attention-pattern statistics and real head removal (issue 14)."""

import copy
import math

import pytest
import torch

from conftest import FAMILIES, make_tiny
from harp_src.heads.gates import HeadGates, gate_gradients, taylor_head_scores, window_loss
from harp_src.heads.patterns import head_statistics, js_divergence, most_redundant, pattern_stats
from harp_src.heads.removal import slice_off_heads
from harp_src.model.adapter import get_adapter


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("family", FAMILIES)
def test_gates_at_one_are_the_model_itself(family, ids):
    model = make_tiny(family)
    before = logits(model, ids)
    with HeadGates(model):
        torch.testing.assert_close(logits(model, ids), before, rtol=0, atol=0)
    assert all(not get_adapter(model).attention(i).o_proj._forward_pre_hooks for i in range(4))


@pytest.mark.parametrize("family", FAMILIES)
def test_all_gates_of_a_layer_at_zero_zero_its_attention_output(family, ids):
    model = make_tiny(family)
    ad = get_adapter(model)
    seen = {}
    handle = ad.attention(2).register_forward_hook(lambda m, a, out: seen.update(out=out[0]))
    with HeadGates(model) as gates:
        gates.close_heads({2: list(range(ad.n_heads))})
        logits(model, ids)
    handle.remove()
    bias = ad.attention(2).o_proj.bias
    expected = torch.zeros_like(seen["out"]) + (0 if bias is None else bias)
    torch.testing.assert_close(seen["out"], expected)


def test_closing_one_head_equals_zeroing_its_o_proj_columns(ids):
    model = make_tiny("llama")
    ad = get_adapter(model)
    with HeadGates(model) as gates:
        gates.close_heads({1: [3]})
        gated = logits(model, ids)
    zeroed = copy.deepcopy(model)
    with torch.no_grad():
        get_adapter(zeroed).attention(1).o_proj.weight[:, 3 * ad.head_dim:4 * ad.head_dim] = 0
    torch.testing.assert_close(gated, logits(zeroed, ids))


def test_taylor_gradient_matches_finite_differences(ids):
    model = make_tiny("llama").double()
    window = ids[:1]
    grad = gate_gradients(model, window, progress=False)[0]
    eps = 1e-2  # the rotary tables are fp32 even in a float64 model: a smaller step drowns in their rounding
    for layer, head in [(0, 1), (2, 3), (3, 0)]:
        losses = []
        for sign in (1, -1):
            with HeadGates(model) as gates, torch.no_grad():
                gates.values[layer, head] = 1 + sign * eps
                losses.append(float(window_loss(model, window)))
        fd = (losses[0] - losses[1]) / (2 * eps)
        assert grad[layer, head].item() == pytest.approx(fd, rel=1e-4, abs=1e-7)
    assert all(not p.requires_grad or p.grad is None for p in model.parameters())


def test_taylor_scores_are_normalised_per_layer(ids):
    scores = taylor_head_scores(make_tiny("gemma3"), ids, progress=False)
    assert scores.shape == (4, 4)
    torch.testing.assert_close(scores.norm(dim=1), torch.ones(4, dtype=scores.dtype))
    raw = taylor_head_scores(make_tiny("gemma3"), ids, normalise=False, progress=False)
    assert (raw >= 0).all() and (raw > 0).any()


def test_entropy_of_uniform_rows_is_log_n_and_sink_and_self_masses():
    t = 6
    uniform = torch.tril(torch.ones(t, t)) / torch.arange(1, t + 1)[:, None]  # causal uniform rows
    sink = torch.zeros(t, t)
    sink[:, 0] = 1
    diagonal = torch.eye(t)
    stats = pattern_stats(torch.stack([uniform, sink, diagonal]))
    expected = torch.tensor([math.log(n) for n in range(2, t + 1)]).mean()
    torch.testing.assert_close(stats["entropy"][0], expected.double())
    torch.testing.assert_close(stats["entropy_norm"][0], torch.tensor(1.0, dtype=torch.float64))
    assert stats["sink"].tolist() == pytest.approx([uniform[1:, 0].mean().item(), 1.0, 0.0])
    assert stats["self"].tolist() == pytest.approx([(1 / torch.arange(2, t + 1)).mean().item(), 0.0, 1.0])
    assert stats["js"][1, 2].item() == pytest.approx(1.0)  # sink vs self: disjoint rows, 1 bit
    assert stats["js"][0, 0].item() == pytest.approx(0.0, abs=1e-12)


def test_js_divergence_bounds():
    p = torch.tensor([0.5, 0.5, 0.0])
    assert js_divergence(p, p).item() == pytest.approx(0.0, abs=1e-7)
    assert js_divergence(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])).item() == pytest.approx(1.0)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_head_statistics_run_eager_and_restore_sdpa(family, ids):
    model = make_tiny(family, attn="sdpa")
    before = logits(model, ids)
    heads, pairs = head_statistics(model, ids, progress=False)
    assert model.config._attn_implementation == "sdpa"
    torch.testing.assert_close(logits(model, ids), before)
    assert len(heads) == 4 * 4 and len(pairs) == 4 * 6
    assert heads[["entropy_norm", "sink", "self"]].ge(0).all().all()
    assert heads[["entropy_norm", "sink", "self"]].le(1 + 1e-9).all().all()
    assert pairs.js.between(0, 1).all() and pairs.cos.between(-1 - 1e-9, 1 + 1e-9).all()
    best = most_redundant(pairs)
    assert len(best) == 4 and set(best.columns) >= {"layer", "js", "cos"}


SETS = {  # balanced: every KV group of a layer loses the same number of query heads
    "llama": {0: [0, 2], 2: [1, 3], 3: [0, 1, 2, 3]},  # 4 heads / 2 KV (groups {0,1}, {2,3})
    "qwen2": {1: [1, 2]},
    "gemma2": {0: [0, 3], 3: [0, 1, 2, 3]},
    "mistral": {0: [3], 1: [0, 1, 2], 3: [0, 1, 2, 3]},  # MQA: any heads
    "gemma3": {1: [2], 2: [0, 3]},
}


@pytest.mark.parametrize("family", FAMILIES)
def test_sliced_heads_equal_gated_heads(family, ids):
    model = make_tiny(family)
    ad = get_adapter(model)
    heads = SETS[family]
    with HeadGates(model) as gates:
        gates.close_heads(heads)
        gated = logits(model, ids)
    before = sum(p.numel() for p in model.parameters())
    removed = slice_off_heads(model, heads)
    torch.testing.assert_close(logits(model, ids), gated, rtol=1e-5, atol=1e-5)
    n = sum(len(h) for i, h in heads.items() if len(h) < ad.n_heads)
    full = [i for i, h in heads.items() if len(h) == ad.n_heads]
    attn = make_tiny(family).model.layers[0].self_attn
    whole = sum(p.numel() for p in attn.parameters())
    norms = sum(p.numel() for m in get_adapter(make_tiny(family)).attention_norms(0) for p in m.parameters())
    per_head = ad.head_dim * (attn.q_proj.in_features + (attn.q_proj.bias is not None) + attn.o_proj.out_features)
    assert removed == before - sum(p.numel() for p in model.parameters())
    assert removed == n * per_head + len(full) * (whole + norms)
    out = model.generate(ids[:1], max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out.shape == (1, ids.shape[1] + 4)


def test_unbalanced_removal_is_refused_and_leaves_the_model_unchanged(ids):
    model = make_tiny("llama")
    before = logits(model, ids)
    with pytest.raises(ValueError, match="same number from each group"):
        slice_off_heads(model, {0: [0], 1: [0, 1]})  # layer 0: groups lose 1 and 0
    torch.testing.assert_close(logits(model, ids), before, rtol=0, atol=0)


@pytest.mark.parametrize("bad", [{0: [4]}, {0: [-1]}, {7: [0]}, {0: [True]}, {0: [1, 1]}])
def test_bad_head_indices_are_refused(bad, ids):
    model = make_tiny("llama")
    with pytest.raises(ValueError, match="out of range|twice"):
        HeadGates(model).close_heads(bad)
    with pytest.raises(ValueError, match="out of range|twice"):
        slice_off_heads(model, bad)
