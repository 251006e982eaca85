"""LRP head relevance: the rules leave the forward alone, conserve relevance, and leave the model as it was."""

import pytest
import torch
from torch.testing import assert_close

from conftest import FAMILIES, make_tiny
from harp_src import apply_harp
from harp_src.heads.lrp import (
    LRP_ATTENTION,
    lrp_head_scores,
    lrp_relevance,
    lrp_rules,
    override_gradient,
    target_logits,
)
from harp_src.model.adapter import get_adapter

CONSERVATION = dict(rtol=1e-4, atol=1e-6)  # measured: ≤ 2e-6 relative in fp32


def bias_free(family: str):
    """A tiny model with every bias zeroed (qwen2's q/k/v biases would keep a share of the relevance)."""
    model = make_tiny(family)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.zero_()
    return model


def hook_count(model) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks)
               + len(m._backward_pre_hooks) for m in model.modules())


def test_override_gradient_keeps_value_and_takes_surrogate_gradient():
    x = torch.randn(5, dtype=torch.float64, requires_grad=True)
    y = override_gradient(torch.sin(x), 3 * x)
    assert torch.equal(y, torch.sin(x))
    y.sum().backward()
    assert_close(x.grad, torch.full_like(x, 3.0))


def test_target_is_summed_next_token_logit():
    logits = torch.randn(2, 4, 7)
    ids = torch.tensor([[1, 2, 3, 4], [6, 5, 0, 1]])
    expected = torch.stack([sum(logits[b, t, ids[b, t + 1]] for t in range(3)) for b in range(2)])
    assert_close(target_logits(logits, ids), expected)


@pytest.mark.parametrize("family", FAMILIES)
def test_forward_unchanged_under_rules(family, ids):
    model = make_tiny(family)
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        with lrp_rules(model):
            assert model.config._attn_implementation == LRP_ATTENTION
            ruled = model(input_ids=ids).logits
    assert_close(ruled, plain)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_forward_bit_identical_to_eager(family, ids):
    """Norm, activation and product overrides keep the value exactly; the attention is eager's, bit for bit."""
    model = make_tiny(family, "eager")
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        with lrp_rules(model):
            ruled = model(input_ids=ids).logits
    assert torch.equal(ruled, plain)


@pytest.mark.parametrize("family", FAMILIES)
def test_relevance_is_conserved(family, ids):
    """Bias-free: all of the target reaches the embeddings; each layer's heads share its attention output's."""
    rel = lrp_relevance(bias_free(family), ids)
    assert_close(rel.embeddings, rel.target, **CONSERVATION)
    assert_close(rel.heads.sum(-1), rel.attention, rtol=1e-5, atol=1e-6)  # fp32 rounding only
    assert rel.heads.abs().min() > 0


def test_logit_softcapping_follows_identity_rule(ids):
    """Gemma-2's cap · tanh(l / cap) with a cap small enough to saturate: still conservative."""
    model = bias_free("gemma2")
    model.config.final_logit_softcapping = 0.1
    rel = lrp_relevance(model, ids)
    assert_close(rel.embeddings, rel.target, **CONSERVATION)


def test_plain_function_activation_is_wrapped_and_restored(ids):
    model = bias_free("llama")
    for layer in model.model.layers:
        del layer.mlp.act_fn  # a child module; replaced by a plain function, which can carry no hooks
        layer.mlp.act_fn = torch.nn.functional.silu
    rel = lrp_relevance(model, ids)
    assert_close(rel.embeddings, rel.target, **CONSERVATION)
    assert all(layer.mlp.act_fn is torch.nn.functional.silu for layer in model.model.layers)


def test_plain_gradient_is_not_conservative(ids):
    """Without the rules gradient × input at the embeddings misses the target (so the test above has teeth)."""
    model = bias_free("llama")
    embeddings = model.get_input_embeddings()(ids).detach().requires_grad_()
    target = target_logits(model(inputs_embeds=embeddings).logits, ids)
    target.sum().backward()
    assert not torch.allclose((embeddings * embeddings.grad).sum(), target.sum(), rtol=1e-2)


@pytest.mark.parametrize("family", ["llama", "gemma2", "gemma3"])
def test_model_unchanged_afterwards(family, ids):
    model = make_tiny(family)
    model.model.layers[0].mlp.up_proj.weight.requires_grad_(False)
    flags = [p.requires_grad for p in model.parameters()]
    attn, hooks = model.config._attn_implementation, hook_count(model)
    with torch.no_grad():
        before = model(input_ids=ids).logits
    lrp_head_scores(model, ids, batch_size=2, progress=False)
    with pytest.raises(RuntimeError, match="inside"), lrp_rules(model):
        raise RuntimeError("inside")
    assert model.config._attn_implementation == attn
    assert hook_count(model) == hooks == 0
    assert [p.requires_grad for p in model.parameters()] == flags
    assert all(p.grad is None for p in model.parameters())
    assert not model.training
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, before)


def test_head_scores_zero_for_a_silenced_head(ids):
    model = make_tiny("gemma3")  # MQA: zeroing a v_proj head would silence every query head, so zero o_proj columns
    ad = get_adapter(model)
    layer, head = 1, 2
    with torch.no_grad():
        ad.attention(layer).o_proj.weight[:, head * ad.head_dim : (head + 1) * ad.head_dim] = 0
    scores = lrp_head_scores(model, ids, progress=False)
    assert scores.shape == (ad.n_layers, ad.n_heads)
    assert torch.isfinite(scores).all() and (scores >= 0).all()
    assert scores[layer, head] == 0
    others = torch.ones_like(scores, dtype=torch.bool)
    others[layer, head] = False
    assert (scores[others] > 0).all()


def test_head_scores_nan_for_pruned_layers(ids):
    model = make_tiny("llama")
    apply_harp(model, [3], 0.5)
    scores = lrp_head_scores(model, ids, progress=False)
    assert scores[3].isnan().all() and torch.isfinite(scores[:3]).all()


def test_head_scores_batching_agrees(ids):
    model = make_tiny("mistral")
    assert_close(lrp_head_scores(model, ids, batch_size=2, progress=False),
                 lrp_head_scores(model, ids, batch_size=1, progress=False), rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("bad", [torch.arange(12), torch.zeros(2, 1, dtype=torch.long), torch.zeros(0, 5)])
def test_bad_windows_refused(bad):
    with pytest.raises(ValueError):
        lrp_head_scores(make_tiny("llama"), bad, progress=False)
