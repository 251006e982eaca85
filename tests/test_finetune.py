"""LoRA recovery fine-tuning: it lowers the loss, merges back into the same model object and structure, keeps the
caller's o_proj hooks and attributes, is deterministic, and refuses bad input before touching the model."""

import copy
import json

import pytest
import torch

from conftest import make_tiny
from harp_src.heads.finetune import FinetuneSpec, check_steps, lora_finetune, next_token_loss, target_modules
from harp_src.method.harp import apply_harp
from harp_src.model.adapter import get_adapter

SPEC = FinetuneSpec(steps=30, lr=1e-2, seed=0)


def windows(n: int = 2, length: int = 32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (n, length), generator=g)


def snapshot(model) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


def structure(model) -> list[tuple[str, str]]:
    return [(name, type(m).__name__) for name, m in model.named_modules()]


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.fixture(scope="module")
def tuned():
    """One 30-step fine-tune of a tiny llama, with a counting pre-hook on layer 0's o_proj, a caller attribute and
    a frozen embedding; returns the model and everything recorded before the call."""
    model = make_tiny("llama")
    model.harp_source = {"model_id": "tiny-llama", "checksum": "x"}
    model.get_input_embeddings().weight.requires_grad_(False)
    calls = []
    o_proj = get_adapter(model).attention(0).o_proj
    handle = o_proj.register_forward_pre_hook(lambda mod, args: calls.append(1))
    before = {"weights": snapshot(model), "structure": structure(model), "params": n_params(model),
              "requires_grad": {n: p.requires_grad for n, p in model.named_parameters()},
              "source": model.harp_source, "o_proj": o_proj}
    with torch.no_grad():
        before["loss"] = next_token_loss(model, windows()).item()
    record = lora_finetune(model, windows(), SPEC, progress=False)
    yield model, record, before, calls
    handle.remove()


def test_finetune_lowers_the_training_loss(tuned):
    model, record, before, _ = tuned
    losses = record["losses"]
    assert len(losses) == SPEC.steps
    assert sum(losses[-5:]) / 5 < 0.9 * losses[0]
    with torch.no_grad():
        after = next_token_loss(model, windows()).item()
    assert after < before["loss"] - 0.2  # the merged model, plain forward
    assert record["trainable_params"] > 0 and record["targets"] == list(SPEC.targets)
    assert {"steps", "lr", "rank", "alpha", "seconds"} <= set(record)
    json.dumps(record)


def test_merged_model_keeps_structure_params_and_flags(tuned):
    model, _, before, _ = tuned
    assert structure(model) == before["structure"]
    assert n_params(model) == before["params"]
    assert not [n for n, _ in model.named_parameters() if "lora" in n.lower()]
    assert {n: p.requires_grad for n, p in model.named_parameters()} == before["requires_grad"]
    assert all(p.grad is None for p in model.parameters())
    assert not model.training


def test_merged_weights_live_in_the_callers_model(tuned):
    model, _, before, _ = tuned
    ad, weights = get_adapter(model), model.state_dict()
    assert model.harp_source is before["source"]
    changed = [name for name in weights if name.endswith(("q_proj.weight", "down_proj.weight"))
               and not torch.equal(weights[name], before["weights"][name])]
    assert len(changed) == 2 * ad.n_layers
    o_names = [name for name in weights if name.endswith("o_proj.weight")]
    assert o_names and all(torch.equal(weights[name], before["weights"][name]) for name in o_names)
    assert torch.equal(weights["model.embed_tokens.weight"], before["weights"]["model.embed_tokens.weight"])


def test_o_proj_pre_hook_survives(tuned):
    model, _, before, calls = tuned
    o_proj = get_adapter(model).attention(0).o_proj
    assert o_proj is before["o_proj"] and isinstance(o_proj, torch.nn.Linear)
    seen = len(calls)
    assert seen >= SPEC.steps  # it ran during training (o_proj is not wrapped) ...
    with torch.no_grad():
        model(input_ids=windows(1, 8))
    assert len(calls) == seen + 1  # ... and still runs afterwards


def test_a_head_gate_on_o_proj_still_removes_its_head():
    """The head-pruning loop's gate: a pre-hook zeroing query head 0's slice of o_proj's input. After fine-tuning
    with it in place, the model still equals one whose o_proj has that head's columns zeroed, with no gate."""
    model = make_tiny("llama")
    ad = get_adapter(model)
    head = slice(0, ad.head_dim)
    gate = {"on": True}

    def zero_head(mod, args):
        if not gate["on"]:
            return None
        x = args[0].clone()
        x[..., head] = 0
        return (x,)

    model.harp_gate = ad.attention(1).o_proj.register_forward_pre_hook(zero_head)
    lora_finetune(model, windows(), FinetuneSpec(steps=5, lr=1e-2), progress=False)
    reference = copy.deepcopy(model)
    with torch.no_grad():
        get_adapter(reference).attention(1).o_proj.weight[:, head] = 0
        gated = model(input_ids=windows()).logits
        gate["on"] = False
        ungated, expected = model(input_ids=windows()).logits, reference(input_ids=windows()).logits
    torch.testing.assert_close(gated, expected)
    assert not torch.allclose(gated, ungated)
    model.harp_gate.remove()


def test_deterministic_and_leaves_the_global_rng_alone():
    spec = FinetuneSpec(steps=4, lr=1e-2, dropout=0.1, batch_size=2, seed=3)
    a, b = make_tiny("llama"), make_tiny("llama")
    state = torch.get_rng_state()
    ra = lora_finetune(a, windows(3), spec, progress=False)
    assert torch.equal(torch.get_rng_state(), state)
    rb = lora_finetune(b, windows(3), spec, progress=False)
    assert ra["losses"] == rb["losses"]
    torch.testing.assert_close(a.state_dict(), b.state_dict(), rtol=0, atol=0)


@pytest.mark.parametrize("steps", [0, -1, True, 1.5, "3"])
def test_bad_steps_are_refused_and_the_model_is_unchanged(steps):
    model = make_tiny("llama")
    before = snapshot(model)
    with pytest.raises(ValueError, match="steps"):
        lora_finetune(model, windows(), FinetuneSpec(steps=steps), progress=False)
    torch.testing.assert_close(model.state_dict(), before, rtol=0, atol=0)


def test_check_steps():
    assert check_steps(5) == 5 and check_steps(0, needed=False) == 0
    with pytest.raises(ValueError, match="FT_STEPS >= 1 or use the one-shot schedule"):
        check_steps(0)
    for bad in (-1, True, 2.0):
        with pytest.raises(ValueError, match="steps"):
            check_steps(bad, needed=False)


@pytest.mark.parametrize("bad", [torch.arange(8), torch.zeros(2, 1, dtype=torch.long),
                                 torch.zeros(1, 300, dtype=torch.long), [[3, 4, 5]]], ids=["1d", "T1", "long", "list"])
def test_bad_windows_are_refused_and_the_model_is_unchanged(bad):
    model = make_tiny("llama")
    before, names = snapshot(model), structure(model)
    with pytest.raises(ValueError, match="windows"):
        lora_finetune(model, bad, FinetuneSpec(steps=2), progress=False)
    torch.testing.assert_close(model.state_dict(), before, rtol=0, atol=0)
    assert structure(model) == names


def test_a_failing_step_gives_the_model_back_unchanged():
    model = make_tiny("llama")
    before, layout = snapshot(model), structure(model)
    calls = []

    def fail_on_second_step(module, args):
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("a failure in the middle of fine-tuning")
    hook = model.model.layers[1].register_forward_pre_hook(fail_on_second_step)
    with pytest.raises(RuntimeError, match="middle of fine-tuning"):
        lora_finetune(model, windows(), FinetuneSpec(steps=2), progress=False)
    hook.remove()
    torch.testing.assert_close(model.state_dict(), before, rtol=0, atol=0)
    assert structure(model) == layout and all(p.requires_grad for p in model.parameters())


def test_bad_spec_is_refused():
    model = make_tiny("llama")
    for spec in (FinetuneSpec(steps=2, rank=0), FinetuneSpec(steps=2, targets=("q_proj", "o_proj")),
                 FinetuneSpec(steps=2, targets=("nothing_here",))):
        with pytest.raises(ValueError):
            lora_finetune(model, windows(), spec, progress=False)
    assert not [n for n, _ in model.named_modules() if "lora" in n]


def test_harp_bypassed_layers_without_q_and_k():
    model = make_tiny("llama")
    apply_harp(model, "top:2", 0.5)
    names = target_modules(model, FinetuneSpec(steps=1).targets)
    assert sum(n.endswith("q_proj") for n in names) == 2 and sum(n.endswith("v_proj") for n in names) == 4
    params, layout = n_params(model), structure(model)
    record = lora_finetune(model, windows(), FinetuneSpec(steps=2, lr=1e-2), progress=False)
    assert record["modules"] == len(names)
    assert n_params(model) == params and structure(model) == layout


def test_gemma3_smoke():
    model = make_tiny("gemma3")
    params, layout = n_params(model), structure(model)
    record = lora_finetune(model, windows(2, 16), FinetuneSpec(steps=2, batch_size=2), progress=False)
    assert len(record["losses"]) == 2 and all(torch.isfinite(torch.tensor(record["losses"])))
    assert n_params(model) == params and structure(model) == layout


def test_spec_to_dict_round_trips():
    spec = FinetuneSpec(steps=3, lr=2e-4)
    assert FinetuneSpec(**{**spec.to_dict(), "targets": tuple(spec.to_dict()["targets"])}) == spec
    json.dumps(spec.to_dict())
