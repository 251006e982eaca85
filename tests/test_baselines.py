"""Structured-pruning baselines on tiny random models: budgets, real removal, exact record replay, bad input."""

import copy
import json

import pandas as pd
import pytest
import torch
from torch import nn
from torch.testing import assert_close

from conftest import make_tiny
from harp_src import apply_harp
from harp_src.compare.points import HARP_FLAP, LIKE, RELEASE, build, rebuild, recipe_of, timed_order, with_speeds
from harp_src.measure.timing import REFERENCE, harp_copy, latency_group, latency_pair, shape_key, time_shapes
from harp_src.method.accounting import param_report
from harp_src.method.harp import HarpPlan
from harp_src.model.adapter import fingerprint, get_adapter
from harp_src.model.modeling_harp import Constant
from harp_src.model.weights import held_bytes
from harp_src.pruning import calibration, methods
from harp_src.pruning import wanda as wanda_module
from harp_src.pruning.budgets import budgets, capacity
from harp_src.pruning.flap import compensation
from harp_src.pruning.llm_pruner import accumulate_gradients, taylor_scores
from harp_src.pruning.methods import METHODS, SCOPES
from harp_src.pruning.prune import applied_copy, prune, pruned_copy, shared_copy
from harp_src.pruning.record import MLP_PROJ, PruneRecord, apply_entry, linears
from harp_src.pruning.selection import global_entries
from harp_src.pruning.slicing import keep_channels, units
from harp_src.studies.frontier import HARP, variants, verdict, versus_harp

FAMILIES = ["llama", "qwen2", "gemma3"]  # GQA (2 KV heads of 4), GQA with q/k/v biases, MQA
CASES = [(m, s) for m in METHODS for s in SCOPES[m]]
FINE = set(methods.FINE)


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def calib(seed: int = 1, n: int = 4, t: int = 32) -> torch.Tensor:
    return torch.randint(3, 128, (n, t), generator=torch.Generator().manual_seed(seed))


def budget_of(model, method, scope) -> int:
    # large enough that one MLP channel (192 parameters here) is under 1 % of it
    return max(capacity(model, method, scope) // 5, 20_000) if method in FINE else capacity(model, method, scope) // 5


def expected_removed(model_before, record) -> int:
    """Parameters the record's kept lists remove, counted from the unit layout of the dense model."""
    ad = get_adapter(model_before)
    u = units(ad)
    total = 0
    for i, e in record.layers.items():
        if e.get("heads") == [] and e.get("channels") == []:
            return None  # whole blocks: counted by n_params below
        if "heads" in e:
            total += (u.n_heads - len(e["heads"])) * u.head_params
        if "channels" in e:
            total += (u.n_channels - len(e["channels"])) * u.channel_params
        total -= ad.hidden * ("heads_bias" in e and ad.attention(i).o_proj.bias is None)
        total -= ad.hidden * ("channels_bias" in e and ad.mlp(i).down_proj.bias is None)
    return total


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method,scope", CASES)
def test_budget_removal_generate_and_replay(family, method, scope, ids):
    model = make_tiny(family)
    before = n_params(model)
    budget = budget_of(model, method, scope)
    record = prune(model, method, budget, calib(), scope, progress=False)
    assert record.params_removed == before - n_params(model)
    if method == "wanda":
        assert record.params_removed == 0 and record.weights_zeroed == budget
        zeros = sum(int((lin.weight == 0).sum()) for layer in get_adapter(model).layers
                    for lin in layer.modules() if isinstance(lin, nn.Linear))
        assert zeros == budget  # random weights have no zeros of their own
    elif method in FINE:
        assert abs(record.params_removed - budget) <= 0.01 * budget
        assert record.params_removed == expected_removed(make_tiny(family), record)
    else:  # whole blocks or attention layers: the count closest to the budget
        each = record.params_removed / len(record.layers)
        assert abs(record.params_removed - budget) <= each / 2 + 1
    # forward and cached generation work, and the cache changes nothing
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()
    cached = model.generate(ids[:1], max_new_tokens=6, do_sample=False)
    uncached = model.generate(ids[:1], max_new_tokens=6, do_sample=False, use_cache=False)
    assert torch.equal(cached, uncached)
    # the record, through JSON, rebuilds the same model bit for bit
    again = make_tiny(family)
    PruneRecord.from_dict(json.loads(json.dumps(record.to_dict()))).apply(again)
    a, b = model.state_dict(), again.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert n_params(again) == n_params(model)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method,scope", CASES)
def test_pruned_copy_is_pruning_a_copy_and_leaves_the_model_as_it_was(family, method, scope):
    dense = make_tiny(family)
    before = {k: v.clone() for k, v in dense.state_dict().items()}
    flags = [p.requires_grad for p in dense.parameters()]
    budget = budget_of(dense, method, scope)
    reference = copy.deepcopy(dense)
    expected = prune(reference, method, budget, calib(), scope, progress=False)
    pruned, record = pruned_copy(dense, method, budget, calib(), scope, progress=False)
    assert record.to_dict() == expected.to_dict() and pruned.prune_record.to_dict() == expected.to_dict()
    assert_close(pruned.state_dict(), reference.state_dict(), rtol=0, atol=0)
    assert_close(dense.state_dict(), before, rtol=0, atol=0)  # scored in place (not SEQUENTIAL), yet unchanged
    assert [p.requires_grad for p in dense.parameters()] == flags and all(p.grad is None for p in dense.parameters())
    assert not hasattr(dense, "prune_record") and n_params(dense) - n_params(pruned) == record.params_removed
    # the copy owns every weight (those it shared while being pruned were replaced or cloned)
    assert not {p.data_ptr() for p in pruned.parameters()} & {p.data_ptr() for p in dense.parameters()}
    # the record, applied to a copy, rebuilds the same model the same way
    again = applied_copy(dense, PruneRecord.from_dict(json.loads(json.dumps(record.to_dict()))))
    assert_close(again.state_dict(), reference.state_dict(), rtol=0, atol=0)
    assert_close(dense.state_dict(), before, rtol=0, atol=0)
    assert not {p.data_ptr() for p in again.parameters()} & {p.data_ptr() for p in dense.parameters()}
    # for inference beside dense, the same model holding only what pruning replaced (dense stays as it was)
    shared = shared_copy(dense, record)
    assert_close(shared.state_dict(), reference.state_dict(), rtol=0, atol=0)
    assert_close(dense.state_dict(), before, rtol=0, atol=0)
    assert own_bytes(shared, dense) < own_bytes(again, dense)
    measured, same = pruned_copy(dense, method, budget, calib(), scope, progress=False, share=True)
    assert same.to_dict() == expected.to_dict()
    assert_close(measured.state_dict(), reference.state_dict(), rtol=0, atol=0)
    assert_close(dense.state_dict(), before, rtol=0, atol=0)
    # sequential unstructured Wanda zeroes the copy it scores as it goes: that one copy cannot share
    assert own_bytes(measured, dense) < own_bytes(again, dense) or method in methods.UNSTRUCTURED


def own_bytes(model: nn.Module, other: nn.Module) -> int:
    """Bytes of `model`'s parameters that are not `other`'s tensors."""
    theirs = {p.data_ptr() for p in other.parameters()}
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.data_ptr() not in theirs)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method", ["harp", "harp-mean"])
def test_a_rebuilt_harp_point_is_the_harp_model_sharing_the_weights_it_keeps(family, method, ids):
    dense = make_tiny(family)
    before = {k: v.clone() for k, v in dense.state_dict().items()}
    n = get_adapter(dense).n_layers
    alphas = {n - 2: 0.5, n - 1: 0.0}  # one bypass (Gemma: α folded into a norm in place) and one dropped layer
    expected = copy.deepcopy(dense)
    apply_harp(expected, sorted(alphas), alphas, bypass="mean" if method == "harp-mean" else "identity")
    model = rebuild(dense, {"record": None, "alphas": alphas, "method": method})
    assert_close(model.state_dict(), expected.state_dict(), rtol=0, atol=0)
    with torch.no_grad():
        assert_close(model(ids).logits, expected(ids).logits, rtol=0, atol=0)
    assert_close(dense.state_dict(), before, rtol=0, atol=0)
    # it owns only the folded o_proj's and the norms; the embedding and every kept projection are dense's
    assert own_bytes(model, dense) < own_bytes(expected, dense) // 4


def test_applied_copy_refuses_a_record_of_another_model_and_leaves_both_unchanged():
    record = prune(make_tiny("llama"), "flap", 20_000, calib(), "mlp", progress=False)
    other = make_tiny("qwen2")
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(ValueError, match="another model"):
        applied_copy(other, record)
    with pytest.raises(ValueError, match="another model"):
        shared_copy(other, record)
    assert_close(other.state_dict(), before, rtol=0, atol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_llm_pruner_channel_scores_need_only_the_mlp_gradients(family):
    model = make_tiny(family)
    ad = get_adapter(model)
    every = [p for i in range(ad.n_layers) for lin in linears(ad, i).values() for p in lin.parameters()]
    accumulate_gradients(model, calib(), every, 2, False)
    full = [taylor_scores(ad, i) for i in range(ad.n_layers)]
    model.zero_grad(set_to_none=True)
    mlp = [p for i in range(ad.n_layers) for name, lin in linears(ad, i).items() if name in MLP_PROJ
           for p in lin.parameters()]
    accumulate_gradients(model, calib(), mlp, 2, False)
    assert all(p.grad is None for i in range(ad.n_layers) for p in ad.attention(i).parameters())
    for i, (heads, channels) in enumerate(full):
        only, mlp_channels = taylor_scores(ad, i, heads=False)
        assert only is None and heads is not None
        assert_close(mlp_channels, channels)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_eager_and_sdpa_agree_after_head_pruning(family, ids):
    record = prune(make_tiny(family), "flap", 30_000, calib(), "heads+mlp", progress=False)
    assert any(len(e["heads"]) < units(get_adapter(make_tiny(family))).n_heads for e in record.layers.values())
    outs = []
    for attn in ("eager", "sdpa"):
        model = make_tiny(family, attn=attn)
        record.apply(model)
        with torch.no_grad():
            outs.append(model(ids).logits)
    assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-5)


def test_scores_come_from_calibration_only(ids):
    first = prune(make_tiny("llama"), "wanda-sp", 20_000, calib(seed=1), progress=False)
    model = make_tiny("llama")
    with torch.no_grad():
        model(ids)  # running the model on other (test) text first leaves nothing behind
    second = prune(model, "wanda-sp", 20_000, calib(seed=1), progress=False)
    other = prune(make_tiny("llama"), "wanda-sp", 20_000, calib(seed=2), progress=False)
    assert first.layers == second.layers and first.meta == second.meta
    assert first.meta["calib_sha256"] != other.meta["calib_sha256"]


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2", "gemma3"])  # gemma: sliding and global layers
@pytest.mark.parametrize("method", ["wanda", "wanda-sp"])
def test_layer_by_layer_calibration_carries_states_as_a_rerun_from_the_bottom_would(family, method):
    windows = calib(seed=1, n=3, t=24)  # longer than the Gemma sliding window (8); 3 windows: an uneven last batch
    carried = make_tiny(family)
    record = prune(carried, method, 20_000, windows, progress=False)
    # the reference: each layer calibrated by running the whole (partly pruned) model from the bottom up to it
    rerun = make_tiny(family)
    ad = get_adapter(rerun)

    def slow_sequential(model, request, desc, layer_entry):
        entries = {}
        for i in range(ad.n_layers):
            lin = linears(ad, i)
            watched = {f"{i}.{p}": lin[p] for p in ("q_proj", "o_proj", "gate_proj", "down_proj")}
            entries[i] = layer_entry(i, calibration.calibrate(model, request.windows, watched, request.batch_size,
                                                              stop_at=i))
            apply_entry(ad, i, entries[i])
        return entries

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(wanda_module, "sequential", slow_sequential)
        reference = prune(rerun, method, 20_000, windows, progress=False)
    assert record.layers == reference.layers
    for (name, a), (_, b) in zip(carried.named_parameters(), rerun.named_parameters(), strict=True):
        assert_close(a, b, rtol=0, atol=0, msg=name)


def test_mag_sp_removes_the_hand_computed_channels():
    model = make_tiny("llama")
    ad = get_adapter(model)
    u = units(ad)
    with torch.no_grad():
        for i in range(ad.n_layers):
            down = ad.mlp(i).down_proj.weight
            down.copy_(torch.arange(1, down.shape[1] + 1, dtype=down.dtype).expand_as(down))  # channel 0 smallest
    budget = ad.n_layers * u.channel_params * 64  # half the channels of every layer, at one ratio
    record = prune(model, "mag-sp", budget, progress=False)
    assert record.scope == "mlp"
    for e in record.layers.values():
        assert "heads" not in e and e["channels"] == list(range(64, 128))


def test_global_ranking_takes_the_hand_computed_heads_and_channels():
    """Heads and channels compete in one ranking: standardised per layer and module, the lowest taken first."""
    ad = get_adapter(make_tiny("llama"))
    u = units(ad)
    channels = torch.cat([torch.zeros(20), torch.full((u.n_channels - 20,), 10.0)]).double()
    scores = {i: (torch.tensor([1.0, 2.0]), channels) for i in range(4)}
    scores[3] = (torch.tensor([2.0, 1.0]), channels)  # layer 3's weaker unit is unit 1
    # z-scores: the 20 low channels of each layer -2.3, then each layer's weaker head unit -1, the rest above 0
    budget = 4 * u.head_params + 4 * 20 * u.channel_params
    entries, taken = global_entries(u, scores, budget)
    assert [entries[i]["heads"] for i in range(4)] == [[1], [1], [1], [0]]
    assert all(entries[i]["channels"][0] == 20 for i in range(4))
    assert sum({"heads": u.head_params, "channels": u.channel_params}[c[2]] for c in taken) == budget


@pytest.mark.parametrize("method", ["flap", "llm-pruner"])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_two_scopes_never_give_the_same_model(method, family):
    """heads+mlp really removes heads (one global ranking), so it is never the mlp scope's model under another
    name, at small and large budgets alike."""
    for budget in (20_000, 60_000):
        records = {scope: prune(make_tiny(family), method, budget, calib(), scope, progress=False)
                   for scope in SCOPES[method]}
        n_heads = units(get_adapter(make_tiny(family))).n_heads
        assert any(len(e["heads"]) < n_heads for e in records["heads+mlp"].layers.values()), (method, budget)
        assert records["heads+mlp"].layers != records["mlp"].layers


def test_compensation_keeps_output_for_a_constant_channel():
    model = make_tiny("llama")
    ad = get_adapter(model)
    mlp = ad.mlp(1)
    j = 5
    # channel j's input becomes constant: silu(b_g) · b_u whatever the token
    for name in ("gate_proj", "up_proj"):
        old = getattr(mlp, name)
        new = nn.Linear(old.in_features, old.out_features, bias=True)
        with torch.no_grad():
            new.weight.copy_(old.weight)
            new.weight[j] = 0
            new.bias.zero_()
            new.bias[j] = 0.7 if name == "gate_proj" else -1.3
        setattr(mlp, name, new)
    x = torch.randn(2, 7, ad.hidden)
    seen = {}
    handle = mlp.down_proj.register_forward_pre_hook(lambda m, a: seen.update(x=a[0]))
    with torch.no_grad():
        ref = mlp(x)
    handle.remove()
    mean = seen["x"].flatten(0, 1).double().mean(0)
    delta = torch.tensor(compensation(mlp.down_proj.weight, mean, [j]), dtype=torch.float64)
    keep_channels(ad, 1, [c for c in range(128) if c != j], delta)
    with torch.no_grad():
        assert_close(ad.mlp(1)(x), ref, rtol=1e-5, atol=1e-6)


def test_harp_then_flap_on_mlp_fills_the_release_budget():
    model = make_tiny("llama")
    plan = apply_harp(model, "top:2", {2: 0.5, 3: 0.0})
    b = budgets(model, plan)
    assert b["release"] > b["harp"] > 0
    record = prune(model, "flap", b["release"] - b["harp"], calib(), scope="mlp", progress=False)
    assert abs(record.params_removed - (b["release"] - b["harp"])) <= 0.02 * b["release"]
    cached = model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=5, do_sample=False)
    assert torch.equal(cached, model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=5, do_sample=False,
                                              use_cache=False))


def test_dropped_attention_is_constant_and_kv_free():
    model = make_tiny("qwen2")
    record = prune(model, "attn-drop-top", 1, progress=False)
    assert list(record.layers) == [3]
    ad = get_adapter(model)
    assert isinstance(ad.attention(3), Constant)
    cache = model(torch.tensor([[4, 5, 6]]), use_cache=True).past_key_values
    assert getattr(cache.layers[3], "keys", None) is None


@pytest.mark.parametrize("kwargs,match", [
    (dict(method="magnitude", budget_params=1000), "unknown method 'magnitude'; choose one of mag-sp"),
    (dict(method="flap", budget_params=1000, scope="heads"), "valid: heads\\+mlp, mlp"),
    (dict(method="mag-sp", budget_params=10**9), "exceeds the"),
    (dict(method="mag-sp", budget_params=0), "positive number"),
    (dict(method="flap", budget_params=1000, calib_windows=torch.zeros(0, 8, dtype=torch.long)), "calibration"),
    (dict(method="wanda-sp", budget_params=1000), "calibration"),
])
def test_bad_input_leaves_the_model_unchanged(kwargs, match):
    model = make_tiny("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=match):
        prune(model, **kwargs)
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_record_refuses_another_model_and_a_pruned_one():
    record = prune(make_tiny("llama"), "mag-sp", 20_000, progress=False)
    with pytest.raises(ValueError, match="made for another model"):
        record.apply(make_tiny("qwen2"))
    pruned = make_tiny("llama")
    record.apply(pruned)
    with pytest.raises(ValueError, match="already pruned"):
        record.apply(pruned)
    harp = make_tiny("llama")
    apply_harp(harp, "top:1")
    with pytest.raises(ValueError, match="already pruned"):
        prune(harp, "flap", 20_000, calib(), "heads+mlp", progress=False)
    assert record.fingerprint == fingerprint(make_tiny("llama").config)


def test_latency_pair_times_both_models_interleaved():
    dense = make_tiny("llama")
    pruned = make_tiny("llama")
    prune(pruned, "attn-drop-top", 1, progress=False)
    row = latency_pair(dense, pruned, seq_len=16, repeats=2, warmup=1, decode_steps=2, threads=1)
    assert row["threads"] == 1 and row["seq_len"] == 16
    for key in ("prefill_reference_s", "prefill_s", "decode_reference_ms", "decode_ms"):
        assert row[key] > 0
    assert row["prefill_speedup"] == pytest.approx(row["prefill_reference_s"] / row["prefill_s"])
    assert row["decode_speedup"] == pytest.approx(row["decode_reference_ms"] / row["decode_ms"])


def test_latency_group_times_every_model_against_one_reference():
    dense = make_tiny("llama")
    dropped, harp = make_tiny("llama"), make_tiny("llama")
    prune(dropped, "attn-drop-top", 1, progress=False)
    apply_harp(harp, "top:1")
    rows = latency_group(dense, {"drop": dropped, "harp": harp}, 16, repeats=1, warmup=1, decode_steps=2, threads=1)
    assert set(rows) == {REFERENCE, "drop", "harp"}
    n_layers = dense.config.num_hidden_layers
    for row in rows.values():
        assert row["prefill_reference_s"] == rows[REFERENCE]["prefill_s"]  # one reference timing for the group
        assert row["decode_tokens_per_s"] == pytest.approx(1e3 / row["decode_ms"])
    # decoding continued from the timed prefill's cache: the prompt's K/V, minus the layers that keep none
    per_layer = rows[REFERENCE]["kv_bytes"] / n_layers
    assert rows["harp"]["kv_bytes"] == pytest.approx(per_layer * (n_layers - 1))
    assert rows["drop"]["kv_bytes"] == pytest.approx(per_layer * (n_layers - 1))
    with pytest.raises(ValueError, match="reference"):
        latency_group(dense, {REFERENCE: harp}, 16)


def test_time_shapes_builds_a_group_at_a_time_and_times_it_at_both_lengths():
    dense = make_tiny("llama")
    built = []

    def builder(bypass):
        def build():
            built.append(bypass)
            return harp_copy(dense, "top:2", 0.5, bypass=bypass)[0]
        return build

    timed = time_shapes(dense, {"identity": builder("identity"), "mean": builder("mean")}, (8, 16), repeats=1,
                        decode_steps=2, groups=[["identity"], ["mean"]])
    assert built == ["identity", "mean"] and set(timed) == {"identity", "mean", REFERENCE}
    for short, long in timed.values():
        assert (short["seq_len"], long["seq_len"]) == (8, 16) and "decode_ms" not in short and long["decode_ms"] > 0
    assert timed["mean"][1]["kv_bytes"] == timed["identity"][1]["kv_bytes"] == timed[REFERENCE][1]["kv_bytes"] / 2
    with pytest.raises(ValueError, match="must name each of the 2 builders once"):
        time_shapes(dense, {"identity": builder("identity"), "mean": builder("mean")}, (8, 16), repeats=1,
                    decode_steps=2, groups=[["identity"]])


def test_variant_specs():
    assert variants(["flap"]) == [("flap", "heads+mlp"), ("flap", "mlp")]
    assert variants(["flap:mlp", "shortgpt", "harp-bi"]) == [("flap", "mlp"), ("shortgpt", "blocks"),
                                                             ("harp-bi", "attention")]
    assert variants(["harp-mean"]) == [("harp-mean", "attention")]
    assert len(variants(["all"])) == sum(len(s) for s in SCOPES.values()) + 2  # every scope, harp-bi, harp-mean
    assert ("mag-sp", "heads+mlp") not in variants(["all"])  # its uniform ratio has no head allocation
    with pytest.raises(ValueError, match="unknown method 'flapp'"):
        variants(["flapp"])
    with pytest.raises(ValueError, match="no scope 'heads'"):
        variants(["flap:heads"])


def test_versus_harp_pairs_windows():
    """Synthetic per-window fidelity: a baseline whose KL is HARP's + 0.1 on every window differs by exactly 0.1."""
    rng = torch.Generator().manual_seed(0)
    base = torch.rand(40, generator=rng).double().numpy()
    rows = []
    for method, scope, shift in ((HARP, "attention", 0.0), ("flap", "mlp", 0.1)):
        rows.append(pd.DataFrame({"window": range(40), "kl": base + shift, "top1_agreement": 0.5, "delta_nll": base,
                                  "nll_reference": 3.0, "nll": 3.0 + base, "n_tokens": 127, "method": method,
                                  "scope": scope, "level": "N=4", "model": "m"}))
    vs = versus_harp({"fidelity": pd.concat(rows, ignore_index=True), "items": pd.DataFrame(columns=["method"])})
    kl = vs[(vs.metric == "kl") & (vs.method == "flap [mlp]")].iloc[0]
    assert kl["diff"] == pytest.approx(0.1) and kl.ci_low == pytest.approx(0.1) and kl.decided
    nll = vs[(vs.metric == "delta_nll")].iloc[0]
    assert nll["diff"] == pytest.approx(0.0, abs=1e-12) and not nll.decided


def test_shape_key_names_one_structure_once():
    """Speed depends on shapes alone: the same structure gives one key (timed once); another budget, another scope
    or unstructured zeros give another."""
    def pruned(method, budget, scope=None):
        model = make_tiny("llama")
        record = prune(model, method, budget, calib(), scope, progress=False)
        return shape_key(model, record)

    assert pruned("flap", 20_000, "mlp") == pruned("flap", 20_000, "mlp")
    assert pruned("flap", 20_000, "mlp") != pruned("flap", 40_000, "mlp")
    assert pruned("flap", 20_000, "mlp") != pruned("flap", 20_000, "heads+mlp")
    assert pruned("wanda", 20_000) != shape_key(make_tiny("llama"), None)  # zeros run on dense kernels, but are timed


def test_timing_times_each_shape_once_and_keeps_each_bypass_pair_in_one_round_robin():
    """06's timing step: one row per distinct shape (its first point), HARP and harp-mean of a level side by side
    (so a group of an even size never splits them); 09's keeps the points' order; `with_speeds` gives every point
    its shape's figures and refuses a point whose shape was not timed."""
    runs = pd.DataFrame([
        dict(method="dense", scope="", level="", n_layers=0, budget_params=0, shape="dense"),
        dict(method="harp", scope="attention", level="N=4", n_layers=4, budget_params=9, shape="h4"),
        dict(method="flap", scope="mlp", level="N=4", n_layers=4, budget_params=9, shape="f4"),
        dict(method="harp", scope="attention", level="N=2", n_layers=2, budget_params=5, shape="h2"),
        dict(method="harp", scope="attention", level="paper", n_layers=4, budget_params=7, shape="h4"),
        dict(method="flap", scope="mlp", level="paper", n_layers=4, budget_params=7, shape="f4p"),
        dict(method="harp-mean", scope="attention", level="N=2", n_layers=2, budget_params=5, shape="m2"),
        dict(method="harp-mean", scope="attention", level="N=4", n_layers=4, budget_params=9, shape="m4"),
    ]).assign(model="m")
    rows = runs[runs.method != "dense"].to_dict("records")
    assert [r["shape"] for r in timed_order(rows, pairs_first=True)] == ["h2", "m2", "h4", "m4", "f4", "f4p"]
    assert [r["shape"] for r in timed_order(rows, pairs_first=False)] == ["h4", "f4", "h2", "f4p", "m2", "m4"]
    assert timed_order(rows, pairs_first=True)[2]["level"] == "N=4"  # the first point of a shape builds it
    speed = {s: {"speedup_8k": k + 1.0} for k, s in enumerate(["dense", "h2", "m2", "h4", "m4", "f4", "f4p"])}
    timed = with_speeds(runs.assign(speedup_8k=0.0), speed)
    assert timed.speedup_8k.tolist() == [1.0, 4.0, 6.0, 2.0, 4.0, 7.0, 3.0, 5.0]
    with pytest.raises(ValueError, match="1 shapes of the points have no timing"):
        with_speeds(runs, {s: v for s, v in speed.items() if s != "m4"})


def test_verdict_separates_better_points_by_measured_speed():
    """A point better than HARP on KL (decided) dominates only if it is at least as fast at 8k; better_on_kl lists
    every decided better point whatever its speed, and an undecided one is in neither."""
    runs = pd.DataFrame(dict(model="m", level="N=4", scope=["attention", "mlp", "blocks", "mlp"],
                             method=[HARP, "flap", "shortgpt", "wanda-sp"], speedup_8k=[1.20, 1.25, 1.05, 1.30]))
    vs = pd.DataFrame(dict(model="m", level="N=4", metric="kl", method=["flap [mlp]", "shortgpt", "wanda-sp"],
                           diff=[-0.3, -0.2, -0.1], decided=[True, True, False]))
    row = verdict({"runs": runs}, vs).iloc[0]
    assert row.better_on_kl == "flap [mlp], shortgpt"
    assert (row.dominates_on_kl, row.better_but_slower) == ("flap [mlp]", "shortgpt")
    assert (row.better_on_lambada, row.harp_on_frontier) == ("none", False)
    slower = verdict({"runs": runs.assign(speedup_8k=[1.20, 1.10, 1.05, 1.30])}, vs).iloc[0]
    assert (slower.dominates_on_kl, slower.harp_on_frontier) == ("none", True)


def test_harp_flap_is_harp_then_flap_on_mlp_channels_calibrated_on_the_harp_model(family):
    """The release scripts' configuration (issue 50): FLAP's budget is the release budget less HARP's own (the paper's
    convention); the model equals HARP applied, then `prune(..., "flap", scope="mlp")` on it, whether its weights are
    shared with dense or its own; `rebuild` from the row gives it again; dense is left as it was; the parameters
    removed are HARP's real drop plus FLAP's."""
    dense = make_tiny(family)
    L = dense.config.num_hidden_layers
    plan = {L - 2: 0.5, L - 1: 0.25}
    recipe = recipe_of({"recipe": dict(method=HARP_FLAP, scope="mlp", level=RELEASE, n_layers=2, budget=RELEASE)},
                       {"plan": plan}, dense.config)
    both = budgets(dense.config, HarpPlan(fingerprint(dense.config), plan))
    assert (recipe["budget"], recipe["flap_budget"]) == (both["release"], both["release"] - both["harp"])
    assert recipe["alphas"] == plan and both["release"] > both["harp"] > 0
    g = torch.Generator().manual_seed(1)
    calib = torch.randint(3, dense.config.vocab_size, (2, 24), generator=g)
    x = torch.randint(3, dense.config.vocab_size, (2, 12), generator=g)
    before = dense(x).logits
    reference = copy.deepcopy(dense)
    apply_harp(reference, sorted(plan), plan)
    harp_removed = sum(p.numel() for p in dense.parameters()) - sum(p.numel() for p in reference.parameters())
    flap_record = prune(reference, "flap", recipe["flap_budget"], calib, "mlp", progress=False)
    shared, record = build(dense, recipe, calib, share=True)
    own, _ = build(dense, recipe, calib)
    again = rebuild(dense, {"method": HARP_FLAP, "record": record, "alphas": recipe["alphas"]})
    for model in (shared, own, again):
        assert_close(model(x).logits, reference(x).logits)
    assert_close(dense(x).logits, before, rtol=0, atol=0)
    assert held_bytes(shared, dense) < held_bytes(own, dense)  # shared: only what pruning replaced is its own
    assert record.layers == flap_record.layers and record.method == "flap" and record.scope == "mlp"
    n = sum(p.numel() for p in dense.parameters())
    assert n - sum(p.numel() for p in own.parameters()) == harp_removed + record.params_removed
    assert 0 < record.params_removed <= recipe["flap_budget"]
    assert harp_removed == param_report(dense.config, HarpPlan(fingerprint(dense.config), plan))["params_removed"]


def test_a_like_budget_is_what_the_other_point_really_removed():
    dense = make_tiny("llama")
    L = dense.config.num_hidden_layers
    recipe = recipe_of({"recipe": dict(method="flap", scope="mlp", level=RELEASE, n_layers=2, budget=LIKE)},
                       {"plan": {L - 2: 0.5, L - 1: 0.5}, "like": ({"params_removed": 12345},)}, dense.config)
    assert recipe["budget"] == 12345


def test_harp_flap_with_every_alpha_zero_is_harp_alone():
    """Every α = 0: HARP alone removes the layers' whole attention, the release budget, so FLAP's share is 0 and the
    model is the HARP model (no record), built and rebuilt alike."""
    dense = make_tiny("llama")
    L = dense.config.num_hidden_layers
    plan = {L - 2: 0.0, L - 1: 0.0}
    recipe = recipe_of({"recipe": dict(method=HARP_FLAP, scope="mlp", level=RELEASE, n_layers=2, budget=RELEASE)},
                       {"plan": plan}, dense.config)
    assert recipe["flap_budget"] == 0
    x = torch.randint(3, dense.config.vocab_size, (1, 10), generator=torch.Generator().manual_seed(2))
    model, record = build(dense, recipe, x, share=True)
    harp = copy.deepcopy(dense)
    apply_harp(harp, sorted(plan), plan)
    assert record is None
    for m in (model, rebuild(dense, {"method": HARP_FLAP, "record": None, "alphas": plan})):
        assert_close(m(x).logits, harp(x).logits)
