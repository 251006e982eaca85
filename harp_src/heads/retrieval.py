"""Which query heads read from the context, training-free: the induction (copy) score on repeated random tokens,
and Wu et al.'s copy-paste hit rate on needle items.

A sequence is BOS + R + R, R a run of distinct tokens. A query at the j-th token of the second copy can predict its
next token only by finding the token that followed R[j]'s first occurrence (at prefix + j + 1) and copying it: the
attention mass a head puts there, averaged over the second copy's positions and the sequences, is its retrieval score
(the induction pattern of Olsson et al.; the copy heads that Wu et al., arXiv 2404.15574, find to carry retrieval).

The copy-paste score is Wu et al.'s retrieval score: while the answer to a needle question is produced, a head hits
when its most-attended position lies in the needle and holds the very token being produced; its score is the share of
answer tokens it hits. We feed the reference answer (teacher forcing) rather than the model's own greedy output, so
a model that cannot answer still scores its heads, on every answer token.
"""

from __future__ import annotations

import pandas as pd
import torch
from tqdm.auto import tqdm

from ..model.adapter import attention_backend, get_adapter

BATCH = 8  # sequences per forward


def repeated_sequences(pool: torch.Tensor, n_seqs: int, length: int, seed: int = 0,
                       bos: int | None = None) -> torch.Tensor:
    """[n_seqs, (1) + 2·length] token ids: BOS (when the tokenizer has one), then `length` distinct tokens drawn
    (seeded, without replacement) from `pool`'s distinct ids, then the same tokens again.

    Draw `pool` from calibration text (enwiki train) so that every token is one the model has seen used."""
    ids = torch.unique(pool.flatten())
    if bos is not None:
        ids = ids[ids != bos]
    if n_seqs < 1 or length < 2:
        raise ValueError(f"need n_seqs >= 1 and length >= 2, got {n_seqs} and {length}")
    if len(ids) < length:
        raise ValueError(f"the pool has {len(ids)} distinct tokens, fewer than length={length}: give more text")
    g = torch.Generator().manual_seed(seed)
    runs = torch.stack([ids[torch.randperm(len(ids), generator=g)[:length]] for _ in range(n_seqs)])
    prefix = torch.full((n_seqs, 0 if bos is None else 1), 0 if bos is None else bos, dtype=runs.dtype)
    return torch.cat([prefix, runs, runs], dim=1)


def induction_mass(weights: torch.Tensor, length: int, prefix: int) -> torch.Tensor:
    """Per head, the mean attention mass from each token of the second copy onto the token that followed its first
    occurrence: weights [B, H, T, T] (T = prefix + 2·length) → [H], summed over the batch (divide by sequences)."""
    j = torch.arange(length, device=weights.device)
    queries, keys = prefix + length + j, prefix + j + 1
    return weights[:, :, queries, keys].double().mean(-1).sum(0).cpu()


@torch.no_grad()
def retrieval_scores(model, sequences: torch.Tensor, prefix: int, progress: bool = True) -> pd.DataFrame:
    """The retrieval (induction) score of every query head of every dense attention layer, on `sequences` built by
    `repeated_sequences` (`prefix`: 1 with BOS, else 0).

    The model runs with eager attention (sdpa returns no weights) and is switched back afterwards.

    Returns:
        layer, head, kv_group (the KV head it reads: its GQA/MQA group), retrieval (mean mass, 0..1).
    """
    length = (sequences.shape[1] - prefix) // 2
    if length < 2 or sequences.shape[1] != prefix + 2 * length:
        raise ValueError(f"sequences must be prefix + 2·length tokens (prefix={prefix}, length >= 2), got "
                         f"{sequences.shape[1]} tokens")
    if not torch.equal(sequences[:, prefix:prefix + length], sequences[:, prefix + length:]):
        raise ValueError("the second half of each sequence must repeat the first: build them with "
                         "repeated_sequences")
    ad = get_adapter(model)
    device = next(model.parameters()).device
    layers = [i for i in range(ad.n_layers) if ad.attention_is_dense(i)]
    sums = {i: torch.zeros(ad.n_heads, dtype=torch.float64) for i in layers}

    def on_attention(i):
        def hook(module, args, kwargs, out):
            sums[i] += induction_mass(out[1], length, prefix)
        return hook

    handles = []
    with attention_backend(model, "eager"):
        try:
            handles = [ad.attention(i).register_forward_hook(on_attention(i), with_kwargs=True) for i in layers]
            for batch in tqdm(sequences.split(BATCH), desc="retrieval scores", leave=False, disable=not progress):
                model(input_ids=batch.to(device), use_cache=False)
        finally:
            for h in handles:
                h.remove()
    n = len(sequences)
    return pd.DataFrame([{"layer": i, "head": h, "kv_group": h // ad.n_rep, "retrieval": float(sums[i][h]) / n}
                         for i in layers for h in range(ad.n_heads)])


def needle_positions(ids: list[int], answer: list[int]) -> list[int]:
    """Positions of every occurrence of the answer's tokens as a run in `ids` (the needle states the key twice)."""
    n = len(answer)
    starts = [p for p in range(len(ids) - n + 1) if ids[p:p + n] == answer]
    if not starts:
        raise ValueError("the answer does not occur in the prompt: copy-paste scores need needle items "
                         "(data.longcontext.passkey_items)")
    return sorted({p + k for p in starts for k in range(n)})


def copy_hits(weights: torch.Tensor, ids: torch.Tensor, needle: list[int], n_answer: int) -> torch.Tensor:
    """Per head, how many answer tokens it copies: weights [1, H, T, T] over prompt + answer (T tokens); the query
    before answer token k attends most to a needle position holding that token → [H]."""
    queries = torch.arange(ids.shape[-1] - n_answer - 1, ids.shape[-1] - 1, device=weights.device)
    top = weights[0, :, queries].argmax(-1)  # [H, n_answer] most-attended key position
    targets = ids[0, queries + 1].to(top.device)
    inside = torch.zeros(ids.shape[-1], dtype=torch.bool, device=top.device)
    inside[needle] = True
    return (inside[top] & (ids[0].to(top.device)[top] == targets)).sum(-1).double().cpu()


@torch.no_grad()
def copy_paste_scores(model, tok, items: list[dict], progress: bool = True) -> pd.DataFrame:
    """Wu et al.'s copy-paste retrieval score of every query head of every dense attention layer, on needle items
    (`passkey_items(..., split="train")`, so heads are not chosen on evaluation text). Eager attention, switched back.

    Returns:
        layer, head, kv_group, copy_paste (share of answer tokens the head copied from the needle, 0..1).
    """
    if not items:
        raise ValueError("no items: give needle items such as data.longcontext.passkey_items(tok, split='train')")
    ad = get_adapter(model)
    device = next(model.parameters()).device
    layers = [i for i in range(ad.n_layers) if ad.attention_is_dense(i)]
    hits = {i: torch.zeros(ad.n_heads, dtype=torch.float64) for i in layers}
    state: dict = {}

    def on_attention(i):
        def hook(module, args, kwargs, out):
            hits[i] += copy_hits(out[1], state["ids"], state["needle"], state["n"])
        return hook

    total, handles = 0, []
    with attention_backend(model, "eager"):
        try:
            handles = [ad.attention(i).register_forward_hook(on_attention(i), with_kwargs=True) for i in layers]
            for item in tqdm(items, desc="copy-paste scores", leave=False, disable=not progress):
                answer = tok(" " + item["answers"][0], add_special_tokens=False)["input_ids"]
                state.update(ids=torch.tensor([item["input_ids"] + answer], device=device), n=len(answer),
                             needle=needle_positions(item["input_ids"], answer))
                model(input_ids=state["ids"], use_cache=False)
                total += len(answer)
        finally:
            for h in handles:
                h.remove()
    return pd.DataFrame([{"layer": i, "head": h, "kv_group": h // ad.n_rep, "copy_paste": float(hits[i][h]) / total}
                         for i in layers for h in range(ad.n_heads)])
