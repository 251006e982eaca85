"""The causal-mean bypass (`bypass="mean"`): equal to an explicit uniform causal attention matrix, cached decoding
equal to uncached, padding averaged over real tokens only, checkpoints that know their kind, and its bad inputs."""

import json

import pytest
import torch
from test_checkpoints import tokenizer  # noqa: F401  (the fixture)
from torch.testing import assert_close
from transformers import AutoModelForCausalLM, DynamicCache
from transformers.models.llama.modeling_llama import repeat_kv

from conftest import make_tiny
from harp_src import HarpPlan, apply_harp, load_model
from harp_src.__main__ import main
from harp_src.checkpoints import save_checkpoint
from harp_src.measure.kv import kv_cache_bytes
from harp_src.method.harp import harp_applied
from harp_src.method.search import search_alphas
from harp_src.model.adapter import get_adapter
from harp_src.model.modeling_harp import STRUCTURE
from harp_src.model.modeling_harp_mean import RunningMean, causal_mean

TOL = dict(rtol=1e-4, atol=1e-5)
ALPHAS = {1: 0.7, 3: 0.3}


def uniform_causal_matrix(real: torch.Tensor) -> torch.Tensor:
    """[B, T, T]: row t averages the real positions s ≤ t (a dense matrix, written independently of the O(T) path);
    a row with no real position is zero."""
    t = real.shape[1]
    allowed = torch.tril(torch.ones(t, t, dtype=torch.bool, device=real.device)) & real[:, None, :].bool()
    a = allowed.double()
    return (a / a.sum(-1, keepdim=True).clamp_min(1)).float()


def mean_attention_reference(model, alphas: dict[int, float], real: torch.Tensor):
    """Dense model whose chosen layers compute o_proj(repeat_kv(A @ v)) with A the explicit uniform causal matrix
    over the real tokens of `real` [B, T] (1 real, 0 padding), α as HARP places it."""
    ad = get_adapter(model)
    for i, a in alphas.items():

        def hook(mod, args, kwargs, output, a=a):
            x = kwargs["hidden_states"]
            b, t, _ = x.shape
            v = repeat_kv(mod.v_proj(x).view(b, t, ad.n_kv_heads, ad.head_dim).transpose(1, 2), ad.n_rep)
            mixed = (uniform_causal_matrix(real)[:, None] @ v).transpose(1, 2).reshape(b, t, -1)
            out = mod.o_proj(mixed)
            return (out if ad.spec.sandwich else a * out), None

        ad.attention(i).register_forward_hook(hook, with_kwargs=True)
        if ad.spec.sandwich:
            ad.attn_out_norm(i).register_forward_hook(lambda m, i_, o, a=a: a * o)


def prompt(n=1, t=12, seed=0, device="cpu"):
    return torch.randint(3, 120, (n, t), generator=torch.Generator().manual_seed(seed), device="cpu").to(device)


@pytest.mark.parametrize("fold", [False, True])
def test_mean_bypass_equals_explicit_uniform_causal_attention(family, fold, device):
    x = prompt(2, device=device)
    ref, pruned = make_tiny(family, device=device), make_tiny(family, device=device)
    mean_attention_reference(ref, ALPHAS, torch.ones_like(x))
    plan = apply_harp(pruned, list(ALPHAS), ALPHAS, fold=fold, bypass="mean")
    assert plan.bypass == "mean" and pruned.harp_plan.bypass == "mean"
    with torch.no_grad():
        assert_close(pruned(x).logits, ref(x).logits, **TOL)


def test_mean_differs_from_identity_and_deletes_the_same_weights(family):
    x = prompt(2)
    ident, mean = make_tiny(family), make_tiny(family)
    apply_harp(ident, list(ALPHAS), ALPHAS)
    apply_harp(mean, list(ALPHAS), ALPHAS, bypass="mean")
    assert [p.shape for p in ident.parameters()] == [p.shape for p in mean.parameters()]
    with torch.no_grad():
        first, rest = ident(x).logits, mean(x).logits
    assert_close(rest[:, 0], first[:, 0], **TOL)  # at t = 0 the mean over one token is that token
    assert (rest[:, 1:] - first[:, 1:]).abs().max() > 1e-3


def step_logits(model, x: torch.Tensor, n_prompt: int) -> torch.Tensor:
    """Logits of positions n_prompt-1 .. T-1: a cached prefill of the prompt, then one token at a time."""
    with torch.no_grad():
        out = model(x[:, :n_prompt], use_cache=True)
        steps, cache = [out.logits[:, -1]], out.cache
        for t in range(n_prompt, x.shape[1]):
            out = model(x[:, t : t + 1], cache=cache, use_cache=True)
            steps.append(out.logits[:, -1])
            cache = out.cache
    return torch.stack(steps, 1), cache


@pytest.mark.parametrize("layers", ["top:2", "0,3", "0-2"])
def test_cached_decoding_equals_uncached(family, layers, device):
    model = make_tiny(family, device=device)
    plan = apply_harp(model, layers, 0.8, bypass="mean")
    x = prompt(2, 20, device=device)  # past Gemma's sliding window of 8, so the windowed masks are exercised
    with torch.no_grad():
        full = model(x, use_cache=False).logits
    cached, cache = step_logits(model, x, 7)
    assert_close(cached, full[:, 6:], **TOL)
    for i in plan.alphas:
        slot = cache.layers[i]
        width = get_adapter(model).attention(i).v_proj.out_features
        assert isinstance(slot, RunningMean) and slot.sum.shape == (2, width)
        assert_close(slot.count, torch.full((2, 1), 20.0, device=device))
    assert kv_cache_bytes(type("C", (), {"layers": [cache.layers[i] for i in plan.alphas]})) == 0
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert model.generate(x[:1, :9], **kw).tolist() == model.generate(x[:1, :9], use_cache=False, **kw).tolist()


def test_beam_search_reorders_the_running_mean(device):
    model = make_tiny("llama", device=device)
    apply_harp(model, "1-3", 1.0, bypass="mean")
    kw = dict(max_new_tokens=10, do_sample=False, num_beams=4, pad_token_id=0)
    x = prompt(1, 9, device=device)  # checked: without reordering the running sums, these beams come out differently
    assert model.generate(x, **kw).tolist() == model.generate(x, use_cache=False, **kw).tolist()


def left_padded(seqs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    t = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), t, dtype=torch.long, device=seqs[0].device)
    mask = torch.zeros_like(ids)
    for b, s in enumerate(seqs):
        ids[b, t - len(s) :], mask[b, t - len(s) :] = s, 1
    return ids, mask


def test_left_padding_averages_real_tokens_only(family, device):
    model = make_tiny(family, device=device)
    apply_harp(model, list(ALPHAS), ALPHAS, bypass="mean")
    short, long = prompt(1, 6, seed=1, device=device)[0], prompt(1, 11, seed=2, device=device)[0]
    ids, mask = left_padded([short, long])
    with torch.no_grad():
        batch = model(ids, attention_mask=mask).logits
        alone = model(short[None]).logits
    assert_close(batch[0, -6:], alone[0], **TOL)
    ref = make_tiny(family, device=device)
    mean_attention_reference(ref, ALPHAS, mask)
    with torch.no_grad():
        assert_close(batch[mask.bool()], ref(ids, attention_mask=mask).logits[mask.bool()], **TOL)
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    together = model.generate(ids, attention_mask=mask, **kw)[0, -6:]
    assert together.tolist() == model.generate(short[None], **kw)[0, -6:].tolist()


def test_causal_mean_state_continues_a_sum():
    v = torch.randn(2, 9, 5)
    real = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1], [1] * 9]).bool()
    whole = causal_mean(v, real)
    state = RunningMean()
    parts = torch.cat([causal_mean(v[:, :4], real[:, :4], state), causal_mean(v[:, 4:], real[:, 4:], state)], 1)
    assert_close(parts, whole)
    assert_close(whole, (uniform_causal_matrix(real) @ v))
    with pytest.raises(NotImplementedError, match="cannot be cropped"):
        state.crop(1)


def test_search_is_the_same_cached_and_naive():
    model = make_tiny("qwen2")
    calib = prompt(4, 16, seed=3)
    cached = search_alphas(model, calib, "top:2", cache_prefix=True, bypass="mean")
    naive = search_alphas(model, calib, "top:2", cache_prefix=False, bypass="mean")
    assert cached == naive
    assert not any(get_adapter(model).is_bypassed(i) for i in range(4))  # the search leaves the model dense


def test_checkpoint_round_trip_keeps_the_mean(tokenizer, tmp_path):  # noqa: F811
    model = make_tiny("gemma3")
    apply_harp(model, list(ALPHAS), ALPHAS, bypass="mean")
    save_checkpoint(model, tmp_path / "ckpt", tokenizer)
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert config["harp_plan"]["harp"]["bypass"] == "mean"
    assert {e.get("mixing") for e in config[STRUCTURE] if e["kind"] == "bypass"} == {"mean"}
    x = prompt(2)
    again, _ = load_model(str(tmp_path / "ckpt"))
    remote = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", trust_remote_code=True)
    assert again.harp_plan.bypass == "mean"
    with torch.no_grad():
        expected = model(x).logits
        assert_close(again(x).logits, expected, rtol=0, atol=0)
        assert_close(remote(x).logits, expected, rtol=0, atol=0)
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert remote.generate(x[:1], **kw).tolist() == model.generate(x[:1], **kw).tolist()


def test_a_plan_without_bypass_is_the_identity():
    plan = apply_harp(make_tiny("llama"), [2], 0.5)
    old = {k: v for k, v in plan.to_dict().items() if k != "bypass"}
    assert HarpPlan.from_dict(old).bypass == "identity"
    assert HarpPlan.from_dict(plan.to_dict() | {"bypass": "mean"}).bypass == "mean"


def test_bad_bypass_inputs_leave_the_model_unchanged(tokenizer, tmp_path):  # noqa: F811
    model = make_tiny("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"unknown bypass 'avg': choose one of \['identity', 'mean'\]"):
        apply_harp(model, [2], 0.5, bypass="avg")
    with pytest.raises(ValueError, match="unknown bypass"):
        HarpPlan.from_dict(apply_harp(make_tiny("llama"), [2], 0.5).to_dict() | {"bypass": "Mean"})
    assert model.state_dict().keys() == before.keys() and all(torch.equal(before[k], v)
                                                               for k, v in model.state_dict().items())
    apply_harp(model, [3], 0.5)  # identity, folded
    with pytest.raises(ValueError, match="bypass='identity'"):
        apply_harp(model, [2], 0.5, bypass="mean")
    assert get_adapter(model).attention(2).__class__.__name__ != "BypassAttention"
    with pytest.raises(ValueError, match="bypass='identity'"), harp_applied(model, [1], 0.5, bypass="mean"):
        pass
    # a checkpoint folded for the identity whose plan was edited to say "mean" is refused before loading
    save_checkpoint(model, tmp_path / "ckpt", tokenizer)
    path = tmp_path / "ckpt" / "config.json"
    config = json.loads(path.read_text())
    config["harp_plan"]["harp"]["bypass"] = "mean"
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="mixing is 'mean' by the plan but None in the structure"):
        load_model(str(tmp_path / "ckpt"))


@pytest.mark.slow
def test_smollm2_mean_bypass_decoding():
    """Real SmolLM2-135M, top 8 mean-bypassed: cached ≡ uncached, explicit-matrix reference on two layers."""
    ref, tok = load_model("smollm2-135m")
    x = tok("The capital of France is a city that", return_tensors="pt").input_ids
    alphas = {25: 0.5, 29: 1.0}
    mean_attention_reference(ref, alphas, torch.ones_like(x))
    pruned, _ = load_model("smollm2-135m")
    apply_harp(pruned, list(alphas), alphas, bypass="mean")
    with torch.no_grad():
        assert_close(pruned(x).logits, ref(x).logits, rtol=1e-4, atol=1e-4)
    top8, _ = load_model("smollm2-135m")
    apply_harp(top8, "top:8", 0.8, bypass="mean")
    with torch.no_grad():
        full = top8(x).logits
    cached, _ = step_logits(top8, x, 4)
    assert_close(cached, full[:, 3:], rtol=1e-4, atol=1e-4)


def test_cli_searches_prunes_and_scores_the_mean_bypass(tokenizer, tmp_path, capsys):  # noqa: F811
    model = make_tiny("llama")
    model.resize_token_embeddings(len(tokenizer))  # real text windows need the tokenizer's vocabulary
    model.save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    small = ["--n-windows", "2", "--seq-len", "16"]
    plan = tmp_path / "plan.json"
    assert main(["search", "--model", str(tmp_path / "tiny"), "--layers", "2,3", "--bypass", "mean",
                 "--grid", "0.5,1", "--out", str(plan), *small]) == 0
    searched = HarpPlan.from_json(plan)
    assert searched.bypass == "mean" and set(searched.alphas.values()) <= {0.5, 1.0}
    assert main(["prune", "--model", str(tmp_path / "tiny"), "--layers", "2,3", "--alphas", "0.5", "--bypass", "mean",
                 "--save", str(tmp_path / "ckpt"), *small]) == 0
    capsys.readouterr()
    assert main(["ppl", "--model", str(tmp_path / "tiny"), "--plan", str(plan), *small]) == 0
    assert json.loads(capsys.readouterr().out)["plan"]["bypass"] == "mean"
    again, _ = load_model(str(tmp_path / "ckpt"))
    assert again.harp_plan.bypass == "mean" and again.harp_plan.alphas == {2: 0.5, 3: 0.5}


def test_caches_it_cannot_keep_a_running_sum_in_are_refused():
    model = make_tiny("llama")
    apply_harp(model, "top:2", 0.8, bypass="mean")
    x, kw = prompt(1, 9), dict(max_new_tokens=3, do_sample=False, pad_token_id=0)
    with pytest.raises(ValueError, match="a static cache, or one built without the config, is not supported"):
        model.generate(x, cache_implementation="static", **kw)
    with pytest.raises(ValueError, match="can be cropped"):  # transformers' own check: assisted decoding crops
        model.generate(x, prompt_lookup_num_tokens=2, **kw)
    with pytest.raises(ValueError, match="built without the config"):
        model(x, cache=DynamicCache(), use_cache=True)
    state = RunningMean()
    state.crop(0)  # nothing to forget: allowed
    assert not state.is_croppable and not state.is_compileable
