"""Offline corpora and perplexity windows."""

import hashlib
import json

import pytest
import torch

from harp_src.data.corpora import MANIFEST, bos_id, calibration_samples, corpus_text, disjoint_samples, ppl_windows


class ToyTokenizer:
    """Characters as tokens; optionally prepends BOS like Gemma's tokenizer does."""

    def __init__(self, bos: bool):
        self.bos_token_id = 1 if bos else None
        self.name_or_path, self.bos = f"toy-{bos}", bos

    def __len__(self):
        return 256

    def __call__(self, text, add_special_tokens=True):
        ids = [min(ord(c), 255) for c in text]
        return {"input_ids": ([1] if self.bos and add_special_tokens else []) + ids}


@pytest.mark.parametrize("corpus", ["enwiki", "lee"])
def test_splits_match_manifest_and_are_disjoint(corpus):
    manifest = json.loads(MANIFEST.read_text())["files"]
    train, test = corpus_text(corpus, "train"), corpus_text(corpus, "test")
    for split, text in (("train", train), ("test", test)):
        assert hashlib.sha256(text.encode()).hexdigest() == manifest[f"{corpus}_{split}.txt"]["sha256"]
    test_articles = set(test.split("\n\n"))
    assert len(test) > 50_000 and len(train) > 3 * len(test)
    assert not {a for a in train.split("\n\n") if len(a) > 200} & {a for a in test_articles if len(a) > 200}


def test_windows_are_seeded_and_shaped():
    tok = ToyTokenizer(bos=False)
    a = ppl_windows(tok, "enwiki", "test", 5, 64, seed=0)
    assert a.shape == (5, 64) and a.dtype == torch.long
    assert torch.equal(a, ppl_windows(tok, "enwiki", "test", 5, 64, seed=0))
    assert not torch.equal(a, ppl_windows(tok, "enwiki", "test", 5, 64, seed=1))
    text = corpus_text("enwiki", "test")
    assert "".join(chr(int(i)) for i in a[0]) in text  # a window is a contiguous piece of the test split


def test_bos_starts_each_window_when_the_tokenizer_adds_one():
    assert bos_id(ToyTokenizer(bos=True)) == 1 and bos_id(ToyTokenizer(bos=False)) is None
    w = ppl_windows(ToyTokenizer(bos=True), "lee", "train", 3, 32, seed=0)
    assert w.shape == (3, 32) and (w[:, 0] == 1).all() and (w[:, 1:] != 1).all()


def test_too_many_or_too_long_windows_are_refused():
    tok = ToyTokenizer(bos=False)
    with pytest.raises(ValueError, match="lower n_windows or seq_len"):
        ppl_windows(tok, "lee", "test", 10, 100_000)
    with pytest.raises(ValueError, match="unknown corpus"):
        ppl_windows(tok, "wikitext", "test")
    with pytest.raises(ValueError, match="unknown split"):
        ppl_windows(tok, "enwiki", "validation")


def test_calibration_samples_are_disjoint_nested_and_from_train_only():
    tok = ToyTokenizer(bos=False)
    samples, extra = calibration_samples(tok, 3, [2, 8], 200, seed=0, extra=5)  # long: no chance repeats
    assert sorted(samples) == [2, 8] and extra.shape == (5, 200)
    assert all(len(samples[n]) == 3 and all(s.shape == (n, 200) for s in samples[n]) for n in (2, 8))
    as_text = [["".join(chr(int(i)) for i in w) for w in s] for s in [*samples[8], extra]]
    flat = [w for s in as_text for w in s]
    assert len(set(flat)) == len(flat) == 3 * 8 + 5  # no window in two samples, the extra one included
    for small, large in zip(samples[2], samples[8], strict=True):
        assert torch.equal(small, large[:2])  # sizes nested: sample s of 2 windows starts sample s of 8
    # each window is one of the train split's aligned chunks (text can repeat across articles, e.g. tables, so the
    # check is on positions in the token stream, not on strings)
    ids = tok(corpus_text("enwiki", "train"))["input_ids"]
    chunks = {tuple(ids[c : c + 200]) for c in range(0, len(ids) - 199, 200)}
    assert all(tuple(int(i) for i in w) in chunks for s in [*samples[8], extra] for w in s)
    with pytest.raises(ValueError, match="draw a larger pool"):
        disjoint_samples(torch.zeros(10, 4, dtype=torch.long), 3, [4])
    with pytest.raises(ValueError, match="n_samples >= 1"):
        disjoint_samples(torch.zeros(10, 4, dtype=torch.long), 0, [4])
