"""HARP keeping a layer's retrieval heads (issue 50): exact invariants on tiny models of every family and on real
SmolLM2, parameter and KV-byte counts, plans, checkpoints, generation and bad input."""

import copy
import json
import os
import subprocess
import sys

import pytest
import torch
from test_mean_bypass import left_padded, uniform_causal_matrix
from torch.testing import assert_close
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.cache_utils import DummyLayer, DynamicLayer, DynamicSlidingWindowLayer
from transformers.models.llama.modeling_llama import repeat_kv

from conftest import make_tiny
from harp_src import HarpPlan, apply_harp, load_model, param_report
from harp_src.__main__ import main
from harp_src.checkpoints import save_checkpoint
from harp_src.measure.kv import kv_bytes_at, kv_bytes_per_layer, prompt_kv_bytes
from harp_src.method.harp import harp_applied
from harp_src.method.search import search_alphas
from harp_src.model.adapter import get_adapter
from harp_src.model.loading import resolve_source
from harp_src.model.modeling_harp_keep import head_layout
from harp_src.model.modeling_harp_mean import WithRunningMean, carried_mean_state, causal_mean

TOL = dict(rtol=1e-4, atol=1e-5)
ALPHAS = {1: 0.6, 3: 0.3}


def ids(n=2, t=12, seed=0, device="cpu"):
    return torch.randint(3, 120, (n, t), generator=torch.Generator().manual_seed(seed), device="cpu").to(device)


@torch.no_grad()
def logits(model, x, **kwargs):
    return model(x, **kwargs).logits


def restricted(attn, keep: list[int], head_dim: int):
    """`attn`'s o_proj with the columns of every head not in `keep` zeroed (a copy; its bias only if keep)."""
    o = copy.deepcopy(attn.o_proj)
    with torch.no_grad():
        for h in range(o.in_features // head_dim):
            if h not in keep:
                o.weight[:, h * head_dim:(h + 1) * head_dim] = 0
    return o


def kept_heads_reference(model, alphas: dict, keep: dict, real: torch.Tensor | None = None):
    """The dense model with each layer's attention written independently of the library: the dense attention module
    with the o columns of bypassed heads zeroed, plus α · o_proj(repeat_kv(v)) over the bypassed heads' columns only
    (α before Gemma's output norm); with `real` [B, T] (1 real, 0 padding) the mean bypass: v first mixed by the
    explicit uniform causal matrix over the real tokens."""
    ad = get_adapter(model)
    for i, a in alphas.items():
        attn = ad.attention(i)
        kept = copy.deepcopy(attn)
        kept.o_proj = restricted(attn, keep[i], ad.head_dim)
        bypass = restricted(attn, [h for h in range(ad.n_heads) if h not in keep[i]], ad.head_dim)
        if bypass.bias is not None:
            bypass.bias = None

        def hook(mod, args, kwargs, output, kept=kept, bypass=bypass, a=a):
            x = kwargs["hidden_states"]
            out = kept(**kwargs)[0]
            b, t, _ = x.shape
            v = repeat_kv(mod.v_proj(x).view(b, t, ad.n_kv_heads, ad.head_dim).transpose(1, 2), ad.n_rep)
            if real is not None:
                v = uniform_causal_matrix(real)[:, None] @ v
            return out + a * bypass(v.transpose(1, 2).reshape(b, t, -1)), None

        attn.register_forward_hook(hook, with_kwargs=True)
    return model


# ---------------------------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("fold", [True, False])
def test_keeping_every_head_gives_the_dense_model(family, fold, device):
    dense, model, x = make_tiny(family, device=device), make_tiny(family, device=device), ids(device=device)
    apply_harp(model, list(ALPHAS), ALPHAS, fold=fold, keep_heads={i: [0, 1, 2, 3] for i in ALPHAS})
    assert_close(logits(model, x), logits(dense, x), **TOL)


def test_keeping_no_head_is_harp(family, device):
    harp, model, x = make_tiny(family, device=device), make_tiny(family, device=device), ids(device=device)
    apply_harp(harp, list(ALPHAS), ALPHAS)
    plan = apply_harp(model, list(ALPHAS), ALPHAS, keep_heads={1: [], 3: []})
    assert plan.keep_heads == {} and plan == harp.harp_plan
    assert_close(logits(model, x), logits(harp, x), rtol=0, atol=0)


@pytest.mark.parametrize("keep,alphas", [
    ({1: [0], 3: [3]}, {1: 0.0, 3: 0.0}),  # α = 0: only the kept head's dense attention is left
    ({1: [0, 1, 2], 3: [1]}, ALPHAS),  # uneven: one KV group keeps 2 heads, the other 1 (a padded slot)
    ({1: [1, 3], 3: [0, 2]}, {1: 1.0, 3: 0.5}),  # one head in each group
])
@pytest.mark.parametrize("fold", [True, False])
def test_kept_heads_attend_as_dense_and_the_others_pass_their_value(family, keep, alphas, fold, device):
    ref = kept_heads_reference(make_tiny(family, device=device), alphas, keep)
    model, x = make_tiny(family, device=device), ids(device=device)
    apply_harp(model, list(alphas), alphas, fold=fold, keep_heads=keep)
    for attn in ("eager", "sdpa"):
        for m in (ref, model):
            m.set_attn_implementation(attn if family != "gemma2" else "eager")
        assert_close(logits(model, x), logits(ref, x, use_cache=False), **TOL)


MEAN_KEEP = {1: [0, 1, 2], 2: [3], 3: [1]}  # Gemma's layer 2 has a sliding window (of 8), layers 1 and 3 do not
MEAN_ALPHAS = {1: 0.6, 2: 0.5, 3: 0.3}


@pytest.mark.parametrize("fold", [True, False])
def test_under_the_mean_bypass_the_other_heads_pass_the_causal_mean_of_their_values(family, fold, device):
    """Left-padded, past Gemma's window: kept heads attend as dense, the others read the mean value of the real
    positions up to them, and a padded sequence gets the logits it gets alone."""
    short, long = ids(1, 6, seed=1, device=device)[0], ids(1, 11, seed=2, device=device)[0]
    x, mask = left_padded([short, long])
    ref = kept_heads_reference(make_tiny(family, device=device), MEAN_ALPHAS, MEAN_KEEP, real=mask)
    model = make_tiny(family, device=device)
    apply_harp(model, list(MEAN_ALPHAS), MEAN_ALPHAS, fold=fold, bypass="mean", keep_heads=MEAN_KEEP)
    real = mask.bool()
    for attn in ("eager", "sdpa"):
        for m in (ref, model):
            m.set_attn_implementation(attn if family != "gemma2" else "eager")
        got = logits(model, x, attention_mask=mask)
        assert_close(got[real], logits(ref, x, attention_mask=mask, use_cache=False)[real], **TOL)
        assert_close(got[0, -6:], logits(model, short[None])[0], **TOL)


@pytest.mark.parametrize("bypass", ["identity", "mean"])
def test_cached_decoding_equals_the_full_forward(family, bypass, device):
    model = make_tiny(family, device=device)
    apply_harp(model, list(MEAN_ALPHAS), MEAN_ALPHAS, bypass=bypass, keep_heads=MEAN_KEEP)
    x = ids(2, 12, device=device)
    full = logits(model, x)
    with torch.no_grad():
        out = model(x[:, :6], use_cache=True)
        steps = [out.logits[:, -1]]
        for t in range(6, 12):
            out = model(x[:, t:t + 1], cache=out.past_key_values, use_cache=True)
            steps.append(out.logits[:, -1])
    assert_close(torch.stack(steps[:-1], 1), full[:, 5:11], **TOL)
    slots = [out.past_key_values.layers[i] for i in MEAN_KEEP]
    assert all(isinstance(s, WithRunningMean) == (bypass == "mean") for s in slots)
    if bypass == "mean":  # the K/V slot also carries the bypassed heads' sums over all 12 tokens
        for slot in slots:
            assert_close(slot.running.count, torch.full((2, 1), 12.0, device=device))


@pytest.mark.parametrize("bypass", ["identity", "mean"])
def test_generation_with_padding_and_beams_matches_without_cache(family, bypass, device):
    model = make_tiny(family, device=device)
    apply_harp(model, list(MEAN_ALPHAS), MEAN_ALPHAS, bypass=bypass, keep_heads=MEAN_KEEP)
    x = ids(2, 8, device=device)
    mask = torch.ones_like(x)
    x[0, :3], mask[0, :3] = 0, 0  # left padding
    kw = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        for beams in (1, 2):
            cached = model.generate(x, num_beams=beams, use_cache=True, **kw)
            assert torch.equal(cached, model.generate(x, num_beams=beams, use_cache=False, **kw))
        alone = model.generate(x[:1, 3:], max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(x, use_cache=True, **kw)[0, 3:], alone[0])


# ---------------------------------------------------------------------------------------------- what remains
def kv_groups_kept(ad, keep: dict) -> list[int]:
    """KV groups each layer still caches: all in a dense layer, those of kept heads in a kept-heads layer, none in a
    bypassed one."""
    return [len({h // ad.n_rep for h in keep[i]}) if i in keep else 0 if i in ALPHAS else ad.n_kv_heads
            for i in range(ad.n_layers)]


@pytest.mark.parametrize("bypass", ["identity", "mean"])  # the mean's running sums are no K/V and no parameters
def test_kv_bytes_and_parameters_are_what_remains(family, bypass, device):
    dense, model = make_tiny(family, device=device), make_tiny(family, device=device)
    keep = {1: [0, 1], 3: [3]}
    plan = apply_harp(model, list(ALPHAS), ALPHAS, fold=False, bypass=bypass, keep_heads=keep)
    ad, t = get_adapter(dense), 6  # below Gemma's sliding window of 8, so every layer caches every token
    with torch.no_grad():
        cache = model(ids(1, t, device=device), use_cache=True).past_key_values
    per_layer = [2 * t * groups * ad.head_dim * 4 for groups in kv_groups_kept(ad, keep)]
    assert kv_bytes_per_layer(cache) == per_layer and prompt_kv_bytes(model, t) == sum(per_layer)
    row = ad.hidden + (ad.attention(1).q_proj.bias is not None)  # weights and bias of one q, k or v row
    gone = 0
    for heads in keep.values():
        layout = head_layout(ad.n_heads, ad.n_kv_heads, heads, True)
        gone += (ad.n_heads - len(heads)) * ad.head_dim * row  # q rows of bypassed heads
        gone += (ad.n_kv_heads - len(layout["kept_groups"])) * ad.head_dim * row  # k rows of uncached groups
        gone += (ad.n_kv_heads - len(layout["value_groups"])) * ad.head_dim * row  # v rows nobody reads
    n = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert n(dense) - n(model) == gone
    assert param_report(dense.config, plan)["params_removed"] == gone


def test_mqa_keeps_the_whole_kv_of_a_layer_that_keeps_any_head(device):
    """Gemma-3's tiny config has one KV group: keeping one head keeps the layer's entire K/V cache."""
    model = make_tiny("gemma3", device=device)
    apply_harp(model, [1, 3], ALPHAS, keep_heads={1: [2]})
    with torch.no_grad():
        cache = model(ids(1, 6, device=device), use_cache=True).past_key_values
    assert kv_bytes_per_layer(cache) == [2 * 6 * 16 * 4, 2 * 6 * 16 * 4, 2 * 6 * 16 * 4, 0]


# ---------------------------------------------------------------------------------------------- plans and checkpoints
@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve_source("smollm2-135m")[0])


@pytest.mark.parametrize("fold,bypass", [(True, "identity"), (False, "identity"), (True, "mean")])
def test_plan_and_checkpoint_round_trip(family, fold, bypass, tokenizer, tmp_path):
    model = make_tiny(family)
    keep = {1: [0, 1, 2], 3: [3]}
    plan = apply_harp(model, [1, 2, 3], {1: 0.6, 2: 0.0, 3: 0.3}, fold=fold, bypass=bypass, keep_heads=keep)
    plan.to_json(tmp_path / "plan.json")
    assert HarpPlan.from_json(tmp_path / "plan.json") == plan == model.harp_plan
    assert json.loads((tmp_path / "plan.json").read_text())["keep_heads"] == {"1": [0, 1, 2], "3": [3]}
    save_checkpoint(model, tmp_path / "ckpt", tokenizer)
    assert all((tmp_path / "ckpt" / f"modeling_harp_{part}.py").exists() for part in ("keep", "mean", "checks"))
    structure = json.loads((tmp_path / "ckpt" / "config.json").read_text())["harp_structure"]
    assert [e.get("mixing", "identity") for e in structure if e["kind"] == "keep"] == [bypass, bypass]
    loaded, _ = load_model(str(tmp_path / "ckpt"))
    remote = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", trust_remote_code=True)
    x = ids()
    for other in (loaded, remote):
        assert_close(logits(other, x), logits(model, x), rtol=0, atol=0)
        greedy = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
        assert torch.equal(other.generate(x[:1], **greedy), model.generate(x[:1], **greedy))
    assert loaded.harp_plan == plan


@pytest.mark.parametrize("bypass", ["identity", "mean"])
def test_a_kept_heads_checkpoint_loads_with_plain_transformers_in_a_fresh_process(bypass, tokenizer, tmp_path):
    model = make_tiny("qwen2")  # q/k/v biases: their rows are sliced with the heads
    apply_harp(model, [1, 3], ALPHAS, bypass=bypass, keep_heads={1: [1], 3: [0, 3]})
    save_checkpoint(model, tmp_path / "ckpt", tokenizer)
    torch.save(ids(), tmp_path / "ids.pt")
    script = ("import sys, torch\nsys.modules['harp_src'] = None\n"
              "from transformers import AutoModelForCausalLM\n"
              f"model = AutoModelForCausalLM.from_pretrained({str(tmp_path / 'ckpt')!r}, trust_remote_code=True)\n"
              f"with torch.no_grad():\n    torch.save(model(torch.load({str(tmp_path / 'ids.pt')!r})).logits, "
              f"{str(tmp_path / 'out.pt')!r})\n")
    env = dict(os.environ, HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1")
    subprocess.run([sys.executable, "-c", script], check=True, env=env, cwd=tmp_path, timeout=300)
    assert_close(torch.load(tmp_path / "out.pt"), logits(model, ids()), rtol=0, atol=0)
    assert list((tmp_path / "modules").rglob("modeling_harp_keep.py"))
    assert list((tmp_path / "modules").rglob("modeling_harp_mean.py"))


def state(model) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("keep,bypass,message", [
    ({1: [4]}, "identity", "head 4 is out of range"),
    ({2: [0]}, "identity", "does not bypass"),
    ({1: [0, 0]}, "identity", "lists a head twice"),
    ({1: "0"}, "identity", "list of query head indices"),
    ([1, 0], "identity", "mapping"),
])
def test_bad_kept_heads_are_refused_with_the_model_unchanged(keep, bypass, message):
    model = make_tiny("llama")
    before = state(model)
    with pytest.raises(ValueError, match=message):
        apply_harp(model, [1, 3], ALPHAS, bypass=bypass, keep_heads=keep)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items()) and len(before) == len(state(model))
    assert getattr(model, "harp_plan", None) is None


def test_a_plan_whose_kept_heads_disagree_with_the_checkpoint_is_refused(tokenizer, tmp_path):
    model = make_tiny("llama")
    apply_harp(model, [1, 3], ALPHAS, keep_heads={1: [0, 1]})
    save_checkpoint(model, tmp_path / "ckpt", tokenizer)
    path = tmp_path / "ckpt" / "config.json"
    good = json.loads(path.read_text())
    # load_model compares the plan's own rebuild with the structure, the checkpoint's file checks each entry: both
    # refuse, naming the layer and the heads
    for edit, message in ((lambda c: c["harp_plan"]["harp"].update(keep_heads={"1": [0, 2]}), r"layers\.1.*\[0, 2\]"),
                          (lambda c: c["harp_plan"]["harp"].pop("keep_heads"), r"layers\.1.*(bypass|keeps no head)"),
                          (lambda c: c["harp_plan"]["harp"].update(keep_heads={"1": [0, 1], "3": [2]}),
                           r"layer(s\.| )3.*(keep|\[2\])"),
                          (lambda c: c["harp_structure"][0].update(heads=[0, 9]), r"layers\.1.*\[0, 9\]"),
                          (lambda c: c["harp_plan"]["harp"].update(bypass="mean"), r"layers\.1.*mixing"),
                          (lambda c: c["harp_structure"][0].update(mixing="median"), r"layers\.1.*mixing.*median")):
        config = json.loads(json.dumps(good))
        edit(config)
        path.write_text(json.dumps(config))
        for load in (lambda: load_model(str(tmp_path / "ckpt")),
                     lambda: AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", trust_remote_code=True)):
            with pytest.raises(ValueError, match=message):
                load()


def test_every_layer_mean_bypassed_needs_one_that_keeps_heads():
    """The mean's running sums need one ordinary K/V slot beside them: a layer that keeps heads has one."""
    model = make_tiny("llama")
    before = state(model)
    with pytest.raises(ValueError, match="at least one layer that keeps its attention or some of its heads"):
        apply_harp(model, "0-3", 0.8, bypass="mean")
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    apply_harp(model, "0-3", 0.8, bypass="mean", keep_heads={3: [1]})
    x, kw = ids(1, 9), dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert model.generate(x, **kw).tolist() == model.generate(x, use_cache=False, **kw).tolist()


def test_a_kept_heads_layer_refuses_caches_that_cannot_carry_its_sums():
    """Only layer 3 is pruned (mean, keeping a head), so every refusal comes from its K/V slot: static caches,
    cropping (assisted decoding), a slot of another kind, and a slot holding earlier tokens without their sums."""
    model = make_tiny("llama")
    apply_harp(model, [3], 0.8, bypass="mean", keep_heads={3: [1]})
    x, kw = ids(1, 9), dict(max_new_tokens=3, do_sample=False, pad_token_id=0)
    with pytest.raises(ValueError, match="a static cache, or one built without the config, is not supported"):
        model.generate(x, cache_implementation="static", **kw)
    with pytest.raises(ValueError, match="can be cropped"):  # transformers' own check: assisted decoding crops
        model.generate(x, prompt_lookup_num_tokens=2, **kw)
    with torch.no_grad():
        cache = model(x, use_cache=True).past_key_values
    assert isinstance(cache.layers[3], WithRunningMean) and not cache.layers[3].is_croppable
    with pytest.raises(NotImplementedError, match="cannot be cropped"):
        cache.layers[3].crop(-2)
    assert cache.layers[3].get_seq_length() == 9  # refused before its K/V were cut
    cache.layers[3].crop(0)  # nothing to forget: allowed
    with pytest.raises(ValueError, match="a DummyLayer cannot"):
        carried_mean_state(Slots([DummyLayer()]), 0, 1)
    rebuilt = DynamicLayer()  # keys and values of 9 tokens, the sums lost
    rebuilt.update(cache.layers[3].keys, cache.layers[3].values)
    with pytest.raises(ValueError, match="holds 8 earlier tokens but not the running sums"):
        carried_mean_state(Slots([rebuilt]), 0, 1)


class Slots:
    """The one attribute of a cache that `carried_mean_state` reads."""

    def __init__(self, layers: list):
        self.layers = layers


@pytest.mark.parametrize("make", [DynamicLayer, lambda: DynamicSlidingWindowLayer(sliding_window=8)],
                         ids=["full", "sliding"])
def test_a_kept_heads_slot_moves_its_sums_with_its_keys_and_values(make):
    """Row b of the keys and values holds b, row b of the sums 2b (two tokens): every batch operation of beam search
    and of the fast scorer's copies must keep them in step, and a copy's selection must not reach the original."""
    cache = Slots([make()])
    kv = torch.arange(3.0)[:, None, None, None].expand(3, 1, 2, 4)  # [batch, KV heads, tokens, head_dim]
    cache.layers[0].update(kv, kv)
    causal_mean(torch.arange(3.0)[:, None, None].expand(3, 2, 4), None, carried_mean_state(cache, 0, 2))
    slot = cache.layers[0]

    def rows(layer) -> tuple[list, list]:
        return layer.keys[:, 0, 0, 0].tolist(), (layer.running.sum[:, 0] / 2).tolist()

    slot.reorder_cache(torch.tensor([2, 0, 1]))
    assert rows(slot) == ([2, 0, 1], [2, 0, 1])
    slot.batch_select_indices(torch.tensor([0, 2]))
    assert rows(slot) == ([2, 1], [2, 1])
    slot.batch_repeat_interleave(2)
    assert rows(slot) == ([2, 2, 1, 1], [2, 2, 1, 1])
    other = copy.copy(slot)
    other.batch_select_indices(torch.tensor([3]))
    assert rows(other) == ([1], [1]) and rows(slot) == ([2, 2, 1, 1], [2, 2, 1, 1])
    slot.reset()
    assert slot.running.sum is None and slot.get_seq_length() == 0


# ---------------------------------------------------------------------------------------------- α search and CLI
@pytest.mark.parametrize("bypass", ["identity", "mean"])
def test_search_with_kept_heads_cached_equals_naive(bypass):
    model = make_tiny("llama")
    calib = ids(4, 24, seed=1)
    keep = {2: [1], 3: [0, 2]}
    h_cached, h_naive = [], []
    cached = search_alphas(model, calib, [2, 3], bypass=bypass, keep_heads=keep, history=h_cached)
    naive = search_alphas(model, calib, [2, 3], bypass=bypass, keep_heads=keep, history=h_naive, cache_prefix=False)
    assert cached == naive
    assert_close([r["calib_ppl"] for r in h_cached], [r["calib_ppl"] for r in h_naive], rtol=1e-5, atol=0)
    plain = []
    search_alphas(model, calib, [2, 3], bypass=bypass, history=plain)
    assert [r["calib_ppl"] for r in plain] != [r["calib_ppl"] for r in h_cached]  # kept heads change every candidate


def test_cli_prunes_and_searches_with_kept_heads(tmp_path, capsys):
    assert main(["prune", "--model", "smollm2-135m", "--layers", "top:2", "--alphas", "0.5", "--keep-heads",
                 "28:0,1,2", "29:4", "--out", str(tmp_path / "plan.json")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert HarpPlan.from_json(tmp_path / "plan.json").keep_heads == {28: [0, 1, 2], 29: [4]}
    assert out["kv_cache_cut"] == pytest.approx((2 - 1 / 3 - 1 / 3) / 30)  # each layer caches 1 of 3 KV groups
    assert main(["search", "--model", "smollm2-135m", "--layers", "top:1", "--grid", "0,1", "--n-windows", "1",
                 "--seq-len", "32", "--keep-heads", "29:4", "--out", str(tmp_path / "searched.json")]) == 0
    assert HarpPlan.from_json(tmp_path / "searched.json").keep_heads == {29: [4]}
    assert main(["prune", "--model", "smollm2-135m", "--layers", "top:2", "--alphas", "0.5", "--bypass", "mean",
                 "--keep-heads", "29:4", "--out", str(tmp_path / "mean.json")]) == 0
    mean = HarpPlan.from_json(tmp_path / "mean.json")
    assert mean.bypass == "mean" and mean.keep_heads == {29: [4]}
    capsys.readouterr()
    for bad, message in ((["29:9"], "out of range"), (["28:1"], "does not bypass"), (["29"], "LAYER:HEAD")):
        assert main(["prune", "--model", "smollm2-135m", "--layers", "top:1", "--keep-heads", *bad]) == 2
        assert message in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- real SmolLM2
def test_smollm2_keeping_heads_is_exact():
    """Real weights: keeping every head of the bypassed layers is the dense model; keeping a few, cached decoding
    equals the full forward and the cache holds exactly the kept groups' K/V (K and V, 2 sequences, 13 tokens)."""
    dense, _ = load_model("smollm2-135m")
    model, _ = load_model("smollm2-135m")
    x = ids(2, 20)
    with harp_applied(model, [26, 27], {26: 0.4, 27: 0.8}, keep_heads={26: list(range(9)), 27: list(range(9))}):
        assert_close(logits(model, x), logits(dense, x), **TOL)
    keep = {22: [3, 4, 5], 23: [6], 24: [0, 8]}
    apply_harp(model, "top:8", 0.7, keep_heads=keep)
    full = logits(model, x)
    with torch.no_grad():
        out = model(x[:, :12], use_cache=True)
        step = model(x[:, 12:13], cache=out.past_key_values, use_cache=True)
    assert_close(step.logits[:, -1], full[:, 12], rtol=1e-4, atol=1e-4)  # 30 layers of fp32 sums in another order
    ad = get_adapter(dense)
    per_layer = [2 * 2 * 13 * g * ad.head_dim * 4 for g in [3] * 22 + [1, 1, 2] + [0] * 5]
    assert kv_bytes_per_layer(step.past_key_values) == per_layer
    with harp_applied(dense, list(range(22, 30)), 0.7, bypass="mean", keep_heads=keep):  # the others averaged
        full = logits(dense, x)
        with torch.no_grad():
            out = dense(x[:, :12], use_cache=True)
            step = dense(x[:, 12:13], cache=out.past_key_values, use_cache=True)
        assert_close(step.logits[:, -1], full[:, 12], rtol=1e-4, atol=1e-4)
        assert kv_bytes_per_layer(step.past_key_values) == per_layer


def test_kv_bytes_at_a_length_equal_what_a_prefill_of_it_caches(family):
    """`kv_bytes_at` (notebook 11's KV bytes per token) from a 4-token probe equals the cache of a real prefill,
    sliding-window layers (Gemma: a window of 8) included, with kept heads, bypassed and dense layers."""
    model = make_tiny(family)
    apply_harp(model, [1, 3], ALPHAS, keep_heads={1: [0, 3]})
    assert [kv_bytes_at(model, t) for t in (5, 7, 8, 20)] == [prompt_kv_bytes(model, t) for t in (5, 7, 8, 20)]
