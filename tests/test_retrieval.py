"""The retrieval scores per query head (issue 50), induction and Wu et al.'s copy-paste: sequences, two paths that must
agree, exact values on hand-made attention, bad input, and real SmolLM2's copy heads."""

import pytest
import torch

from conftest import FAMILIES, make_tiny
from harp_src.heads.retrieval import (
    copy_hits,
    copy_paste_scores,
    induction_mass,
    needle_positions,
    repeated_sequences,
    retrieval_scores,
)
from harp_src.model.adapter import get_adapter

POOL = torch.arange(3, 128)  # the tiny models' ordinary tokens (0-2: pad, BOS, EOS)


def test_sequences_are_bos_then_distinct_tokens_twice_and_seeded():
    seqs = repeated_sequences(POOL, 5, 10, seed=3, bos=1)
    assert seqs.shape == (5, 21) and (seqs[:, 0] == 1).all()
    torch.testing.assert_close(seqs[:, 1:11], seqs[:, 11:], rtol=0, atol=0)
    assert all(len(set(row[1:11].tolist())) == 10 for row in seqs)
    assert torch.equal(seqs, repeated_sequences(POOL, 5, 10, seed=3, bos=1))
    assert not torch.equal(seqs, repeated_sequences(POOL, 5, 10, seed=4, bos=1))
    assert repeated_sequences(POOL, 2, 4).shape == (2, 8)  # no BOS (Qwen's tokenizer has none)


@pytest.mark.parametrize("family", FAMILIES)
def test_hooked_scores_equal_the_attention_weights_transformers_returns(family):
    model = make_tiny(family, attn="eager")
    seqs = repeated_sequences(POOL, 3, 3, seed=0, bos=1)  # 7 tokens: inside Gemma's sliding window of 8
    scores = retrieval_scores(model, seqs, prefix=1, progress=False)
    with torch.no_grad():
        attentions = model(input_ids=seqs, output_attentions=True, use_cache=False).attentions
    ad = get_adapter(model)
    assert len(scores) == ad.n_layers * ad.n_heads
    for i, weights in enumerate(attentions):
        expected = induction_mass(weights, 3, 1) / len(seqs)
        got = torch.tensor(scores[scores.layer == i].sort_values("head").retrieval.to_numpy())
        torch.testing.assert_close(got, expected)
    assert model.config._attn_implementation == "eager"  # switched back


@pytest.mark.parametrize("family", FAMILIES)
def test_uniform_attention_gives_one_over_the_keys_a_query_sees(family):
    """With W_Q = W_K = 0 every logit is 0, so a query at position q spreads 1/(q+1) over its keys."""
    model = make_tiny(family)
    ad, backend = get_adapter(model), model.config._attn_implementation
    for i in range(ad.n_layers):
        for proj in (ad.attention(i).q_proj, ad.attention(i).k_proj):
            torch.nn.init.zeros_(proj.weight)
            if proj.bias is not None:
                torch.nn.init.zeros_(proj.bias)
    length, prefix = 3, 1
    scores = retrieval_scores(model, repeated_sequences(POOL, 2, length, bos=1), prefix, progress=False)
    expected = sum(1 / (prefix + length + j + 1) for j in range(length)) / length
    torch.testing.assert_close(torch.tensor(scores.retrieval.to_numpy()),
                               torch.full((len(scores),), expected, dtype=torch.float64))
    assert (scores.kv_group == scores["head"] // ad.n_rep).all()
    assert model.config._attn_implementation == backend  # switched back (Gemma-2 is eager already)


@pytest.mark.parametrize("bad, match", [(lambda s: s[:, :-1], "prefix \\+ 2·length"),
                                        (lambda s: torch.cat([s[:, :4], s[:, 4:].flip(1)], 1), "repeat the first")])
def test_sequences_that_do_not_repeat_are_refused(bad, match):
    model = make_tiny("llama")
    seqs = repeated_sequences(POOL, 2, 3, bos=1)
    with pytest.raises(ValueError, match=match):
        retrieval_scores(model, bad(seqs), prefix=1, progress=False)
    with pytest.raises(ValueError, match="distinct tokens"):
        repeated_sequences(torch.tensor([5, 5, 6]), 1, 3)
    with pytest.raises(ValueError, match="length >= 2"):
        repeated_sequences(POOL, 1, 1)


@pytest.mark.slow
def test_smollm2_has_a_few_strong_copy_heads():
    """A trained model has induction heads: a few heads put most of their mass on the token to copy, while the
    typical head puts little there."""
    from harp_src import load_model
    from harp_src.data.corpora import ppl_windows

    model, tok = load_model("smollm2-135m")
    pool = ppl_windows(tok, "enwiki", "train", 2, 256, 0)
    scores = retrieval_scores(model, repeated_sequences(pool, 4, 40, bos=tok.bos_token_id), prefix=1, progress=False)
    ranked = scores.retrieval.sort_values(ascending=False).to_numpy()
    assert ranked[0] > 0.5 and scores.retrieval.median() < 0.1, (ranked[:5], scores.retrieval.median())
    assert (ranked[: len(ranked) // 20] > 5 * scores.retrieval.median()).all()  # the top 5 % stand out


# ---------------------------------------------------------------------------------------------- copy-paste (Wu et al.)
def test_a_head_hits_only_when_it_copies_the_produced_token_from_the_needle():
    ids = torch.tensor([[1, 9, 7, 8, 9, 7, 8, 5, 6, 7, 8]])  # prompt of 9 tokens (needle 7 8 twice), answer 7 8
    needle = needle_positions(ids[0, :9].tolist(), [7, 8])
    assert needle == [2, 3, 5, 6]
    weights = torch.zeros(1, 4, 11, 11)
    weights[0, 0, 8, 2], weights[0, 0, 9, 3] = 1, 1  # copies 7 then 8 from the needle: 2 hits
    weights[0, 1, 8, 5], weights[0, 1, 9, 1] = 1, 1  # 7 from the needle, then 9 from outside it: 1 hit
    weights[0, 2, 8, 3], weights[0, 2, 9, 2] = 1, 1  # needle positions, wrong tokens: 0
    weights[0, 3, 8, 9], weights[0, 3, 9, 10] = 1, 1  # the answer's own copies, outside the needle: 0
    assert copy_hits(weights, ids, needle, 2).tolist() == [2.0, 1.0, 0.0, 0.0]


class Digits:
    """A tokenizer stand-in for tiny models: the answer " 7 8" is the ids [7, 8]."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [int(t) for t in text.split()]}


def needle_item(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    hay = torch.randint(10, 120, (6,), generator=g).tolist()  # 15 tokens: beyond Gemma's window of 8
    return dict(input_ids=[1, *hay[:2], 7, 8, 4, 7, 8, *hay[2:], 3, 5], answers=["7 8"])


@pytest.mark.parametrize("family", FAMILIES)
def test_copy_paste_scores_equal_the_attention_weights_transformers_returns(family):
    model = make_tiny(family, attn="eager")
    items = [needle_item(s) for s in range(3)]
    scores = copy_paste_scores(model, Digits(), items, progress=False)
    expected = torch.zeros(get_adapter(model).n_layers, 4, dtype=torch.float64)
    for item in items:
        ids = torch.tensor([item["input_ids"] + [7, 8]])
        with torch.no_grad():
            attentions = model(input_ids=ids, output_attentions=True, use_cache=False).attentions
        for i, weights in enumerate(attentions):
            expected[i] += copy_hits(weights, ids, needle_positions(item["input_ids"], [7, 8]), 2)
    got = torch.tensor(scores.sort_values(["layer", "head"]).copy_paste.to_numpy()).view_as(expected)
    torch.testing.assert_close(got, expected / 6)


def test_items_without_their_answer_in_the_prompt_are_refused():
    model = make_tiny("llama")
    with pytest.raises(ValueError, match="does not occur in the prompt"):
        copy_paste_scores(model, Digits(), [dict(input_ids=[1, 5, 6, 9], answers=["7 8"])], progress=False)
    with pytest.raises(ValueError, match="no items"):
        copy_paste_scores(model, Digits(), [], progress=False)


@pytest.mark.slow
def test_smollm2_copy_paste_heads_are_its_induction_heads():
    """Wu et al.'s score on passkeys hidden in enwiki train text finds a few heads that copy the key, and they are
    among the strongest induction heads."""
    from harp_src import load_model
    from harp_src.data.corpora import ppl_windows
    from harp_src.data.longcontext import passkey_items

    model, tok = load_model("smollm2-135m")
    items = passkey_items(tok, lengths=(256,), depths=(0.2, 0.8), n_per_cell=3, split="train")
    copy = copy_paste_scores(model, tok, items, progress=False).set_index(["layer", "head"]).copy_paste
    pool = ppl_windows(tok, "enwiki", "train", 2, 256, 0)
    induction = retrieval_scores(model, repeated_sequences(pool, 4, 40, bos=tok.bos_token_id), prefix=1,
                                 progress=False).set_index(["layer", "head"]).retrieval
    top = copy.sort_values(ascending=False).index[:3]
    assert copy.iloc[copy.argmax()] > 0.7 and copy.median() == 0.0, copy.sort_values().tail()
    assert set(top) <= set(induction.sort_values(ascending=False).index[:10]), (list(top), induction.nlargest(10))
