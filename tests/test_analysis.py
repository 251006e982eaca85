"""Over-smoothing metrics: hand-computable values and agreement with independent computations."""

import math

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import repeat_kv

from conftest import make_tiny
from harp_src import apply_harp
from harp_src.eval.smoothing import attention_entropy, layer_metrics, mean_pairwise_cosine, one_minus_cos
from harp_src.method.layer_choice import lowest_layers, taylor_sensitivity
from harp_src.model.adapter import get_adapter


def test_similarity_by_hand():
    same = torch.ones(1, 5, 8)
    assert mean_pairwise_cosine(same).item() == pytest.approx(1.0)
    eye = torch.eye(4).unsqueeze(0)  # orthogonal tokens
    assert mean_pairwise_cosine(eye).item() == pytest.approx(0.0, abs=1e-7)
    h = torch.randn(2, 7, 16, generator=torch.Generator().manual_seed(0))
    u = F.normalize(h, dim=-1)
    brute = [(u[b] @ u[b].T).triu(1).sum() * 2 / (7 * 6) for b in range(2)]
    torch.testing.assert_close(mean_pairwise_cosine(h), torch.stack(brute))


def test_block_importance_and_entropy_by_hand():
    x = torch.randn(1, 4, 8)
    assert one_minus_cos(x, 3 * x).item() == pytest.approx(0.0, abs=1e-6)
    assert one_minus_cos(x, -x).item() == pytest.approx(2.0)
    uniform = torch.full((1, 2, 3, 6), 1 / 6)
    torch.testing.assert_close(attention_entropy(uniform), torch.full((1, 2), math.log(6)))


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_layer_metrics_agree_with_independent_computation(family):
    model = make_tiny(family)
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    df = layer_metrics(model, ids, name="tiny", batch_size=2)
    get = lambda metric, layer: df.query("metric == @metric and layer == @layer").value.item()  # noqa: E731
    # similarity and block importance from transformers' own hidden states (inputs of layers 0..L-1)
    with torch.no_grad():
        hs = model(ids, output_hidden_states=True).hidden_states
    for i in range(3):
        assert get("similarity", i) == pytest.approx(mean_pairwise_cosine(hs[i]).mean().item(), rel=1e-5)
        assert get("bi_block", i) == pytest.approx(one_minus_cos(hs[i], hs[i + 1]).mean().item(), rel=1e-4)
    # bypass error of layer 1, recomputed with transformers' repeat_kv and an explicit identity matrix
    ad = get_adapter(model)
    seen = {}
    ad.attention(1).register_forward_hook(lambda m, a, kw, o: seen.update(x=kw["hidden_states"], a=o[0]),
                                          with_kwargs=True)
    with torch.no_grad():
        model(ids)
        attn = ad.attention(1)
        v = repeat_kv(attn.v_proj(seen["x"]).view(2, 9, ad.n_kv_heads, ad.head_dim).transpose(1, 2), ad.n_rep)
        b = attn.o_proj((torch.eye(9) @ v).transpose(1, 2).reshape(2, 9, -1))
        a = ad.residual_branch(1, seen["a"]).double()
        b = ad.residual_branch(1, b).double()
    alpha = ((a * b).sum() / (b * b).sum()).item()
    assert get("alpha_star", 1) == pytest.approx(alpha, rel=1e-4)
    assert get("bypass_error", 1) == pytest.approx(((a - b).norm() / a.norm()).item(), rel=1e-4)
    assert get("bypass_error_rescaled", 1) == pytest.approx(((a - alpha * b).norm() / a.norm()).item(), rel=1e-3)
    heads = df[df.metric.str.startswith("entropy_h") & (df.layer == 0)]
    assert len(heads) == ad.n_heads and heads.value.between(0, math.log(9)).all()


def test_pruned_layers_report_no_attention_metrics():
    model = make_tiny("llama")
    apply_harp(model, [3], 1.0)
    df = layer_metrics(model, torch.randint(3, 128, (1, 6)))
    assert set(df[df.layer == 3].metric) == {"similarity", "bi_block"}
    assert model.config._attn_implementation == "sdpa"  # eager was only borrowed for the entropy


def test_taylor_sensitivity_is_the_gate_derivative():
    """Σ grad · a equals d loss / d g for a scalar gate g multiplying the branch, at g = 1 (computed separately)."""
    model = make_tiny("llama").double()
    ids = torch.randint(3, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    scores = taylor_sensitivity(model, ids)
    for layer in range(4):
        gate = torch.ones((), dtype=torch.float64, requires_grad=True)
        handle = get_adapter(model).attention(layer).register_forward_hook(lambda m, a, o, g=gate: (g * o[0], o[1]))
        logits = model(ids).logits
        handle.remove()
        F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="sum").backward()
        assert scores[layer] == pytest.approx(abs(gate.grad.item()), rel=1e-5)
    import pandas as pd

    table = pd.DataFrame({"layer": range(4), "taylor": [scores[i] for i in range(4)]})
    assert lowest_layers(table, "taylor", 2) == sorted(sorted(range(4), key=lambda i: scores[i])[:2])
