"""Notebook 10's recovery (issue 29): a pruned model recovered with LoRA keeps its structure and parameter count,
saves and reloads through the checkpoint path exactly, and the study's tables say what they should on known data."""

import pandas as pd
import pytest
import torch
from torch.testing import assert_close
from transformers import AutoTokenizer

from conftest import make_tiny
from harp_src import apply_harp, load_model
from harp_src.checkpoints import save_checkpoint
from harp_src.heads.finetune import FinetuneSpec, lora_finetune
from harp_src.model.loading import resolve_source
from harp_src.model.weights import n_params
from harp_src.pruning.prune import prune
from harp_src.studies.recovery import RECOVERED, RecoveryParams, before_after, ranking, recovery_gains

ALPHAS = {2: 0.5, 3: 0.3}


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve_source("smollm2-135m")[0])


def windows(n=4, t=16, seed=1):
    return torch.randint(3, 120, (n, t), generator=torch.Generator().manual_seed(seed))


def recovered(model):
    before = {k: v.clone() for k, v in model.state_dict().items()}
    count = n_params(model)
    lora_finetune(model, windows(), FinetuneSpec(steps=3, lr=1e-2, seed=0), progress=False)
    assert n_params(model) == count  # merged back: no parameter gained
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())  # and the weights moved
    return model


@pytest.mark.parametrize(("family", "prune_it"), [
    ("llama", lambda m: apply_harp(m, list(ALPHAS), ALPHAS)),
    ("gemma3", lambda m: apply_harp(m, list(ALPHAS), ALPHAS)),  # α folded after Gemma's post-attention norm
    ("qwen2", lambda m: apply_harp(m, list(ALPHAS), ALPHAS, bypass="mean")),
    ("llama", lambda m: prune(m, "flap", 20_000, windows(4, 16, seed=2), "mlp", progress=False)),
    ("qwen2", lambda m: prune(m, "llm-pruner", 20_000, windows(4, 16, seed=2), "mlp", progress=False)),
    ("llama", lambda m: prune(m, "attn-drop-sim", 20_000, windows(4, 16, seed=2), progress=False)),  # no q/k/v left
])
def test_a_recovered_model_saves_and_reloads_exactly(family, prune_it, tokenizer, tmp_path):
    model = make_tiny(family)
    prune_it(model)
    recovered(model)
    save_checkpoint(model, tmp_path / "ckpt", tokenizer)
    loaded, _ = load_model(str(tmp_path / "ckpt"))
    x = windows(2, 12, seed=3)
    with torch.no_grad():
        assert_close(loaded(x).logits, model(x).logits, rtol=0, atol=0)


@pytest.mark.parametrize(("name", "value", "match"), [
    ("FT_STEPS", 0, "fine-tuning with 0 steps"),
    ("FT_RANK", 0, "FinetuneSpec.rank must be a positive int"),
    ("FT_LR", 0.0, "lr > 0"),
    ("FT_WINDOWS", 0, "FT_WINDOWS >= 1"),
    ("METHODS", ["flap:heads"], "method 'flap' has no scope 'heads'"),
])
def test_bad_parameters_are_one_clear_error(name, value, match):
    with pytest.raises(ValueError, match=match):
        RecoveryParams.defaults(**{name: value}).check()


def study():
    """Two points, two windows and two items, before and after: flap gains on KL, HARP gains more and passes it."""
    fid, items = [], []
    for level, kl in (("N=2", {"harp": (1.0, 1.2), "flap": (0.3, 0.5)}),
                      ("N=2" + RECOVERED, {"harp": (0.2, 0.3), "flap": (0.25, 0.35)})):
        for method, (a, b) in kl.items():
            scope = "attention" if method == "harp" else "mlp"
            fid += [dict(model="m", method=method, scope=scope, level=level, window=w, kl=k, delta_nll=k,
                         top1_agreement=1 - k) for w, k in enumerate((a, b))]
            items += [dict(model="m", method=method, scope=scope, level=level, task="arc_easy", doc_id=d, correct=c)
                      for d, c in enumerate((1.0, 0.0))]
    return {"fidelity": pd.DataFrame(fid), "items": pd.DataFrame(items)}


def test_gains_are_after_minus_before_on_the_same_windows():
    gains = recovery_gains(study()).set_index(["point", "metric"])
    assert gains.loc[("harp", "kl"), "diff"] == pytest.approx(-0.85)  # (0.2 - 1.0 + 0.3 - 1.2) / 2
    assert gains.loc[("flap [mlp]", "kl"), "diff"] == pytest.approx(-0.1)  # (0.25 - 0.3 + 0.35 - 0.5) / 2
    assert gains.loc[("harp", "arc_easy"), "diff"] == 0.0 and gains.loc[("harp", "kl"), "n"] == 2


def test_ranking_orders_best_first_per_stage():
    frontier = pd.DataFrame([
        dict(model="m", method="harp", scope="attention", level="N=2", metric="kl", value=1.1),
        dict(model="m", method="flap", scope="mlp", level="N=2", metric="kl", value=0.4),
        dict(model="m", method="harp", scope="attention", level="N=2" + RECOVERED, metric="kl", value=0.25),
        dict(model="m", method="flap", scope="mlp", level="N=2" + RECOVERED, metric="kl", value=0.3),
        dict(model="m", method="harp", scope="attention", level="N=2", metric="arc_easy − dense", value=-0.1),
    ])
    ranks = ranking(frontier).set_index("stage")
    assert ranks.loc["before", "order"] == "flap [mlp] > harp" and ranks.loc["before", "harp_rank"] == 2
    assert ranks.loc["after", "order"] == "harp > flap [mlp]" and ranks.loc["after", "harp_rank"] == 1
    assert set(before_after(frontier.assign(ci_low=0, ci_high=0)).stage) == {"before", "after"}
