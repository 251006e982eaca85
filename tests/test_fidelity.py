"""Token-level fidelity of a pruned model to its dense one: exact at identity, positive for HARP, bad input."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from conftest import make_tiny
from harp_src import apply_harp
from harp_src.eval.fidelity import FIDELITY_METRICS, fidelity, fidelity_windows, reference_states


def windows(n=6, t=16, seed=0):
    return torch.randint(3, 128, (n, t), generator=torch.Generator().manual_seed(seed))


def test_a_model_is_faithful_to_itself(family):
    model = make_tiny(family)
    df = fidelity(model, model, windows(), batch_size=2, progress=False).set_index("metric")
    assert list(df.index) == list(FIDELITY_METRICS)
    assert df.value["kl"] == 0 and df.value["top1_agreement"] == 1 and df.value["delta_nll"] == 0
    assert (df.n_tokens == 6 * 15).all() and (df.n_windows == 6).all()


def test_harp_model_by_hand(family):
    """KL > 0 for a HARP model, and every number equals a direct computation over all positions."""
    dense, pruned = make_tiny(family), make_tiny(family)
    apply_harp(pruned, [1, 3], {1: 0.5, 3: 0.0})
    w = windows()
    df = fidelity(dense, pruned, w, batch_size=4, chunk=5, progress=False).set_index("metric")
    with torch.no_grad():
        lp_d = F.log_softmax(dense(w).logits[:, :-1].float(), -1)
        lp_p = F.log_softmax(pruned(w).logits[:, :-1].float(), -1)
    kl = (lp_d.exp() * (lp_d - lp_p)).sum(-1)
    target = w[:, 1:, None]
    dnll = lp_d.gather(-1, target) - lp_p.gather(-1, target)
    assert df.value["kl"] > 0
    assert df.value["kl"] == pytest.approx(kl.mean().item(), rel=1e-4)
    assert df.value["top1_agreement"] == pytest.approx((lp_d.argmax(-1) == lp_p.argmax(-1)).float().mean().item())
    assert df.value["delta_nll"] == pytest.approx(dnll.mean().item(), rel=1e-4, abs=1e-6)
    assert (df.ci_low <= df.value).all() and (df.value <= df.ci_high).all()
    assert math.isfinite(df.ci_high["kl"]) and df.ci_high["kl"] > df.ci_low["kl"]


def test_reference_states_computed_once_give_the_same_numbers(family):
    dense, pruned = make_tiny(family), make_tiny(family)
    apply_harp(pruned, [1, 3], {1: 0.5, 3: 0.0})
    w = windows(n=5)
    fresh = fidelity_windows(dense, pruned, w, batch_size=2, chunk=7, progress=False)
    reused = fidelity_windows(dense, pruned, w, batch_size=2, chunk=7, progress=False,
                              ref_states=reference_states(dense, w, batch_size=2))
    assert_close(torch.tensor(reused.drop(columns="window").to_numpy()),
                 torch.tensor(fresh.drop(columns="window").to_numpy()))
    with pytest.raises(ValueError, match="ref_states do not match"):
        fidelity_windows(dense, pruned, w, batch_size=1, progress=False, ref_states=reference_states(dense, w, 2))


def test_bad_input():
    dense = make_tiny("llama")
    other = make_tiny("qwen2")
    other.resize_token_embeddings(200)
    with pytest.raises(ValueError, match="different vocabularies"):
        fidelity(dense, other, windows(), progress=False)
    with pytest.raises(ValueError, match="context"):
        fidelity(dense, dense, torch.zeros(1, 300, dtype=torch.long), progress=False)


class _Vocab:
    """The one tokenizer method `fidelity` compares."""

    def __init__(self, vocab: dict):
        self.vocab = vocab

    def get_vocab(self) -> dict:
        return self.vocab


def test_different_tokenizers_are_refused():
    model = make_tiny("llama")
    same = ({"a": 0, "b": 1}, {"a": 0, "b": 1})
    fidelity(model, model, windows(), tokenizers=tuple(_Vocab(v) for v in same), progress=False)
    with pytest.raises(ValueError, match="tokenizers differ"):
        fidelity(model, model, windows(), tokenizers=(_Vocab({"a": 0, "b": 1}), _Vocab({"a": 1, "b": 0})),
                 progress=False)
