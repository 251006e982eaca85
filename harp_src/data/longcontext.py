"""Synthetic long-context items from a seed (LongBench is not available offline): a passkey hidden in enwiki test
text, and multi-document QA with one gold document among enwiki distractors."""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from .corpora import bos_id, corpus_text
from .lm_tasks.local_data import load as load_local_data

TASKS = ("passkey", "multidoc")


PASSKEY_INTRO = ("There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it; I will ask "
                 "you for it at the end.\n\n")


PASSKEY_NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key. "


PASSKEY_QUESTION = "\n\nWhat is the pass key? The pass key is"


DOC_INTRO = "Below are several documents. One of them answers the question that follows them.\n\n"


GOLD_DOC = "Document [{i}] (quiz archive): The answer to the question \"{question}?\" is {answer}.\n\n"


DISTRACTOR_DOC = "Document [{i}] (encyclopedia): "


DOC_QUESTION = "Answer the question using the documents above.\nQuestion: {question}?\nAnswer:"


DOC_TOKENS = 256  # distractor document length


QA_SOURCES = {"triviaqa": "hf_datasets/trivia_qa/rc.wikipedia.nocontext", "nq_open": "hf_datasets/nq_open/none"}


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


@lru_cache(maxsize=4)
def _haystack(tok, split: str = "test") -> np.ndarray:
    """Token ids of an enwiki split: test for evaluation (the α search only sees the train split); train where the
    items choose something, such as the heads a pruned model keeps."""
    return np.asarray(_ids(tok, corpus_text("enwiki", split)), dtype=np.int64)


def _chunk(tok, n: int, rng: np.random.Generator, split: str = "test") -> list[int]:
    hay = _haystack(tok, split)
    if n > len(hay):
        raise ValueError(f"asked for {n} haystack tokens; the enwiki test split has {len(hay)}")
    start = int(rng.integers(0, len(hay) - n + 1))
    return hay[start : start + n].tolist()


def _check(lengths, depths, n_per_cell: int) -> None:
    if not lengths or any(int(n) < 64 for n in lengths):
        raise ValueError(f"lengths={lengths}: give token counts of at least 64")
    if not depths or any(not 0.0 <= float(d) <= 1.0 for d in depths):
        raise ValueError(f"depths={depths}: give relative depths in [0, 1]")
    if int(n_per_cell) < 1:
        raise ValueError(f"n_per_cell={n_per_cell} must be >= 1")


def _item(tok, task: str, length: int, depth: float, ids: list[int], answers: list[str]) -> dict:
    bos = bos_id(tok)
    ids = ([bos] if bos is not None else []) + ids
    return dict(task=task, length=int(length), depth=float(depth), n_tokens=len(ids), input_ids=ids,
                answers=answers, prompt=tok.decode(ids))


def passkey_items(tok, lengths=(1024, 2048, 4096), depths=(0.1, 0.5, 0.9), n_per_cell: int = 1,
                  seed: int = 0, *, split: str = "test") -> list[dict]:
    """Passkey retrieval prompts of exactly `length` tokens (BOS included) with the key at relative `depth`, hidden
    in enwiki `split` text (test for evaluation; train to choose heads by them, `heads.retrieval.copy_paste_scores`).

    Returns:
        list of dicts: task, length, depth, n_tokens, input_ids, answers (the key as a string), prompt (text).
    """
    _check(lengths, depths, n_per_cell)
    rng, items = np.random.default_rng(seed), []
    head, tail = _ids(tok, PASSKEY_INTRO), _ids(tok, PASSKEY_QUESTION)
    for length in lengths:
        for depth in depths:
            for _ in range(n_per_cell):
                key = str(int(rng.integers(10000, 100000)))
                needle = _ids(tok, PASSKEY_NEEDLE.format(key=key))
                n_hay = int(length) - len(head) - len(needle) - len(tail) - (bos_id(tok) is not None)
                hay = _chunk(tok, n_hay, rng, split)
                cut = round(depth * n_hay)
                items.append(_item(tok, "passkey", length, depth, head + hay[:cut] + needle + hay[cut:] + tail, [key]))
    return items


@lru_cache(maxsize=2)
def _qa_pairs(source: str) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """(question, answers) from the local TriviaQA / NQ-open validation data; the first answer is stated."""
    split = load_local_data(QA_SOURCES[source])["validation"]
    if source == "triviaqa":
        return tuple((d["question"].rstrip("?"), (d["answer"]["value"], *d["answer"]["aliases"])) for d in split)
    return tuple((d["question"].rstrip("?"), tuple(d["answer"])) for d in split)


def multidoc_items(tok, lengths=(1024, 2048, 4096), depths=(0.1, 0.5, 0.9), n_per_cell: int = 1, seed: int = 0,
                   source: str = "triviaqa") -> list[dict]:
    """Multi-document QA prompts of `length` tokens (± a few, where labels tokenise differently): the document
    stating the answer sits at relative position `depth` among enwiki distractor documents of DOC_TOKENS tokens.

    Returns:
        list of dicts as passkey_items; answers are every accepted answer string (aliases).
    """
    _check(lengths, depths, n_per_cell)
    if source not in QA_SOURCES:
        raise ValueError(f"source={source!r}: choose one of {sorted(QA_SOURCES)}")
    rng, items, pairs = np.random.default_rng(seed), [], _qa_pairs(source)
    head = _ids(tok, DOC_INTRO)
    for length in lengths:
        for depth in depths:
            for _ in range(n_per_cell):
                question, answers = pairs[int(rng.integers(len(pairs)))]
                gold_text = GOLD_DOC.format(i="{i}", question=question, answer=answers[0])
                tail = _ids(tok, "\n\n" + DOC_QUESTION.format(question=question))
                budget = int(length) - len(head) - len(tail) - (bos_id(tok) is not None)
                budget -= len(_ids(tok, gold_text.format(i=99)))
                docs = []
                while budget > 0:  # distractors of DOC_TOKENS tokens, the last one shorter to hit the length
                    label = _ids(tok, ("\n\n" if docs else "") + DISTRACTOR_DOC.format(i=len(docs) + 1))
                    body = _chunk(tok, max(min(DOC_TOKENS, budget - len(label)), 1), rng)
                    docs.append(label + body)
                    budget -= len(label) + len(body)
                slot = round(depth * len(docs))
                gold = _ids(tok, ("\n\n" if slot else "") + gold_text.format(i=slot + 1).rstrip("\n"))
                ids = head + [t for d in docs[:slot] for t in d] + gold + [t for d in docs[slot:] for t in d] + tail
                items.append(_item(tok, "multidoc", length, depth, ids, list(answers)))
    return items
