"""Scoring the synthetic long-context items: greedy generation, exact match of the passkey or answer."""

from __future__ import annotations

import re
import string
import time

import pandas as pd
import torch
from tqdm.auto import tqdm

from ..model.adapter import text_config


def _normalise(text: str) -> str:
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def is_correct(task: str, output: str, answers: list[str]) -> bool:
    """passkey: the first number generated is the key. multidoc: lm-eval triviaqa's exact match (answer cut at the
    first newline, period or comma; case, punctuation and articles ignored) against any accepted answer."""
    if task == "passkey":
        found = re.search(r"\d+", output)
        return bool(found) and found.group() == answers[0]
    first = re.split(r"[\n.,]", output.strip(), maxsplit=1)[0]
    return _normalise(first) in {_normalise(a) for a in answers}


@torch.no_grad()
def long_context_eval(model, tok, items: list[dict], max_new_tokens: int = 12, progress: bool = True
                      ) -> pd.DataFrame:
    """Greedy answers and exact-match scores for synthetic items; items longer than the model's context are skipped.

    Returns:
        DataFrame: item (its index in `items`), task, length, depth, n_tokens, answer, output, correct, seconds.
    """
    limit = getattr(text_config(model.config), "max_position_embeddings", None) or 10**9
    device = next(model.parameters()).device
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    rows = []
    for k, item in enumerate(tqdm(items, desc="long context", disable=not progress)):
        if item["n_tokens"] + max_new_tokens > limit:
            print(f"skipped a {item['task']} item of {item['n_tokens']} tokens: the model's context is {limit}")
            continue
        ids = torch.tensor([item["input_ids"]], device=device)
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=pad)
        text = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        correct = is_correct(item["task"], text, item["answers"])
        rows.append(dict(item=k, task=item["task"], length=item["length"], depth=item["depth"],
                         n_tokens=item["n_tokens"], answer=item["answers"][0], output=text, correct=correct,
                         seconds=time.perf_counter() - start))
    return pd.DataFrame(rows)
