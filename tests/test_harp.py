"""Exact invariants of HARP pruning on tiny random models of every family (and on real SmolLM2)."""

import pytest
import torch
from torch.testing import assert_close
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import repeat_kv

from conftest import NO_SDPA, make_tiny
from harp_src import HarpPlan, apply_harp, load_model, param_report
from harp_src.measure.kv import kv_cache_bytes
from harp_src.method.layers import parse_layers
from harp_src.model.adapter import fingerprint, get_adapter
from harp_src.model.modeling_harp import BypassAttention
from harp_src.model.paper import llama31_8b_config, official_llama31_8b_alphas

TOL = dict(rtol=1e-4, atol=1e-5)


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def identity_attention_reference(model, alphas: dict[int, float]):
    """Dense model whose chosen layers compute softmax-free attention with A = I, written independently:
    v heads repeated with transformers' own `repeat_kv`, an explicit identity matrix, then o_proj and α."""
    ad = get_adapter(model)
    handles = []
    for i, a in alphas.items():
        attn = ad.attention(i)

        def hook(mod, args, kwargs, output, a=a):
            x = kwargs["hidden_states"]
            b, t, _ = x.shape
            v = mod.v_proj(x).view(b, t, ad.n_kv_heads, ad.head_dim).transpose(1, 2)
            v = repeat_kv(v, ad.n_rep)  # [b, heads, t, hd]
            eye = torch.eye(t, dtype=v.dtype, device=v.device).expand(b, ad.n_heads, t, t)
            mixed = (eye @ v).transpose(1, 2).reshape(b, t, -1)
            out = mod.o_proj(mixed)
            return (out if ad.spec.sandwich else a * out), None

        handles.append(attn.register_forward_hook(hook, with_kwargs=True))
        if ad.spec.sandwich:
            handles.append(ad.attn_out_norm(i).register_forward_hook(lambda m, i_, o, a=a: a * o))
    return handles


@pytest.mark.parametrize("fold", [False, True])
def test_bypass_equals_identity_attention(family, ids, fold, device):
    alphas, ids = {1: 0.7, 3: 0.3}, ids.to(device)
    ref = make_tiny(family, device=device)
    identity_attention_reference(ref, alphas)
    pruned = make_tiny(family, device=device)
    apply_harp(pruned, list(alphas), alphas, fold=fold)
    with torch.no_grad():
        assert_close(pruned(ids).logits, ref(ids).logits, **TOL)


def test_alpha_one_on_one_token_is_dense(family, device):
    """Attention over a single token is the identity, so α = 1 bypass changes nothing."""
    dense, pruned = make_tiny(family, device=device), make_tiny(family, device=device)
    apply_harp(pruned, range(4), 1.0)
    one = torch.tensor([[5], [77]], device=device)
    with torch.no_grad():
        assert_close(pruned(one).logits, dense(one).logits, **TOL)


def test_alpha_zero_drops_the_attention_sublayer(family, ids, device):
    ref, pruned, ids = make_tiny(family, device=device), make_tiny(family, device=device), ids.to(device)
    for i in (0, 2):
        get_adapter(ref).attention(i).register_forward_hook(lambda m, a, o: (torch.zeros_like(o[0]), None))
    before = n_params(pruned)
    apply_harp(pruned, [0, 2], 0.0)
    with torch.no_grad():
        assert_close(pruned(ids).logits, ref(ids).logits, **TOL)
    ad = get_adapter(ref)
    gone = sum(n_params(ad.attention(i)) + n_params(ad.layers[i].input_layernorm) for i in (0, 2))
    if ad.spec.sandwich:
        gone += sum(n_params(ad.attn_out_norm(i)) for i in (0, 2))
    assert before - n_params(pruned) == gone


def test_parameter_count_drops_by_deleted_tensors(family):
    model = make_tiny(family)
    ad = get_adapter(model)
    before = n_params(model)
    layers = [1, 3]
    deleted = 0
    for i in layers:
        attn = ad.attention(i)
        deleted += sum(n_params(m) for name, m in attn.named_children() if name not in ("v_proj", "o_proj"))
        deleted += attn.o_proj.weight.numel() * (ad.n_rep - 1) // ad.n_rep  # folded o_proj: kv·hd columns
    apply_harp(model, layers, 0.5, fold=True)
    assert before - n_params(model) == deleted
    for i in layers:
        assert not hasattr(ad.attention(i), "q_proj") and not hasattr(ad.attention(i), "k_proj")


def test_folded_equals_unfolded(family, ids, device):
    alphas, ids = {0: 0.4, 2: 1.0, 3: 0.0}, ids.to(device)
    a, b = make_tiny(family, device=device), make_tiny(family, device=device)
    apply_harp(a, list(alphas), alphas, fold=False)
    apply_harp(b, list(alphas), alphas, fold=True)
    assert n_params(b) < n_params(a) or get_adapter(a).n_rep == 1
    with torch.no_grad():
        assert_close(b(ids).logits, a(ids).logits, **TOL)


def test_eager_equals_sdpa(family, ids, device):
    if family in NO_SDPA:
        pytest.skip(f"transformers has no sdpa path for {family}")
    a, b, ids = make_tiny(family, "eager", device=device), make_tiny(family, "sdpa", device=device), ids.to(device)
    for m in (a, b):
        apply_harp(m, [1, 2], {1: 0.6, 2: 0.9})
    with torch.no_grad():
        assert_close(a(ids).logits, b(ids).logits, **TOL)


@pytest.mark.parametrize("layers", ["top:2", "bottom:2", "1-2", "0,3", "0-3"])
def test_cached_decoding_equals_uncached(family, layers, device):
    dense = make_tiny(family, device=device)
    model = make_tiny(family, device=device)
    plan = apply_harp(model, layers, 0.8)
    prompt = torch.tensor([[5, 9, 33, 7, 81, 12, 4, 60, 18, 99, 41, 3]], device=device)
    kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    cached = model.generate(prompt, **kw)
    uncached = model.generate(prompt, use_cache=False, **kw)
    assert cached.tolist() == uncached.tolist()
    # the cache holds K/V for exactly L - N layers (Gemma's sliding layers hold min(T, window - 1) tokens,
    # so compare per layer against the dense cache)
    with torch.no_grad():
        c_dense = dense(prompt, use_cache=True).cache
        c_harp = model(prompt, use_cache=True).cache
    for i, (ld, lh) in enumerate(zip(c_dense.layers, c_harp.layers, strict=True)):
        expected = 0 if i in plan.alphas else kv_cache_bytes(type("C", (), {"layers": [ld]}))
        assert kv_cache_bytes(type("C", (), {"layers": [lh]})) == expected


def test_sampling_generate_runs(family):
    model = make_tiny(family)
    apply_harp(model, "top:2", 0.5)
    torch.manual_seed(0)
    out = model.generate(torch.tensor([[5, 9, 33]]), max_new_tokens=5, do_sample=True, top_k=20, pad_token_id=0)
    assert out.shape == (1, 8)


def test_output_attentions_does_not_bring_attention_back(ids):
    model = make_tiny("llama", "eager")
    apply_harp(model, [2, 3], 1.0)
    out = model(ids, output_attentions=True)
    assert len(out.attentions) == 2  # only the two dense layers produced attention maps
    attn = get_adapter(model).attention(3)
    assert isinstance(attn, BypassAttention) and attn(torch.zeros(1, 2, 64))[1] is None


def test_plan_round_trip(family, ids, tmp_path):
    a, b = make_tiny(family), make_tiny(family)
    plan = apply_harp(a, [0, 3], {0: 0.2, 3: 0.0}, meta={"how": "test"})
    plan.to_json(tmp_path / "plan.json")
    again = HarpPlan.from_json(tmp_path / "plan.json")
    assert again == plan
    again.apply(b)
    with torch.no_grad():
        assert_close(b(ids).logits, a(ids).logits, rtol=0, atol=0)


def test_llama31_8b_paper_ratio():
    """Official top-8 α list (top layer first) on the public Llama-3.1-8B config gives the paper's 3.3 %."""
    cfg = LlamaConfig(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False)
    top_first = [0.8, 0.2, 0.1, 0.1, 0.0, 0.1, 0.0, 0.0]
    plan = HarpPlan({"family": "llama", "num_layers": 32, "hidden_size": 4096, "num_heads": 32,
                     "num_kv_heads": 8}, {31 - k: a for k, a in enumerate(top_first)})
    assert plan.alphas == official_llama31_8b_alphas() and llama31_8b_config().to_dict() == cfg.to_dict()
    report = param_report(cfg, plan)
    assert round(100 * report["ratio_paper"], 3) == 3.305
    # 8 × (Q + K) + 3 × (V + O) with Q = O = 4096², K = V = 4096·1024
    assert report["removed_paper"] == 8 * (4096 * 4096 + 4096 * 1024) + 3 * (4096 * 1024 + 4096 * 4096)
    assert report["kv_cache_cut"] == 8 / 32
    assert report["params_before"] == 8_030_261_248  # Llama-3.1-8B's published size


def test_param_report_leaves_the_model_alone(ids):
    """param_report prunes a weightless copy; the caller's model and config must not change."""
    model = make_tiny("llama")
    plan = HarpPlan(fingerprint(model.config), {3: 1.0})
    before = n_params(model)
    report = param_report(model, plan)
    assert n_params(model) == before and getattr(model.config, "kv_sharing_modes", None) is None
    assert report["params_removed"] > 0
    model.generate(ids[:1], max_new_tokens=3, do_sample=False)  # the cache still has a slot for layer 3


def test_parse_layers():
    assert parse_layers("top:3", 10) == [7, 8, 9]
    assert parse_layers("bottom:2", 10) == [0, 1]
    assert parse_layers("2-4,7", 10) == [2, 3, 4, 7]


@pytest.mark.parametrize(
    "layers, alphas, message",
    [
        ([4], 1.0, "out of range"),
        ([-1], 1.0, "out of range"),
        ([1, 1], 1.0, "duplicates"),
        ([1], 1.5, r"\[0, 1\]"),
        ([1], -0.1, r"\[0, 1\]"),
        ([1], float("nan"), r"\[0, 1\]"),
        ([1, 2], {1: 0.5}, "missing"),
    ],
)
def test_bad_input_leaves_model_unchanged(layers, alphas, message, ids):
    model = make_tiny("llama")
    before = n_params(model)
    with torch.no_grad():
        logits = model(ids).logits
    with pytest.raises(ValueError, match=message):
        apply_harp(model, layers, alphas)
    assert n_params(model) == before
    with torch.no_grad():
        assert_close(model(ids).logits, logits, rtol=0, atol=0)


def test_pruning_twice_and_foreign_plan_are_refused():
    model = make_tiny("llama")
    apply_harp(model, [3], 1.0)
    with pytest.raises(ValueError, match="already pruned"):
        apply_harp(model, [2, 3], 1.0)
    assert not isinstance(get_adapter(model).attention(2), BypassAttention)
    plan = apply_harp(make_tiny("qwen2"), [3], 1.0)
    with pytest.raises(ValueError, match="another model"):
        plan.apply(make_tiny("llama"))


@pytest.mark.slow
def test_smollm2_bypass_and_decoding():
    """Real SmolLM2-135M: bypass ≡ identity-attention reference; cached ≡ uncached greedy decoding, top-8."""
    ref, tok = load_model("smollm2-135m")
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    alphas = {25: 0.5, 29: 1.0}
    identity_attention_reference(ref, alphas)
    pruned, _ = load_model("smollm2-135m")
    apply_harp(pruned, list(alphas), alphas, fold=True)
    with torch.no_grad():
        assert_close(pruned(ids).logits, ref(ids).logits, rtol=1e-4, atol=1e-4)
    top8, _ = load_model("smollm2-135m")
    apply_harp(top8, "top:8", 0.8)
    kw = dict(max_new_tokens=10, do_sample=False)
    assert top8.generate(ids, **kw).tolist() == top8.generate(ids, use_cache=False, **kw).tolist()
