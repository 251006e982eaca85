"""Perplexity: exp(mean next-token NLL) over token windows, after checking the windows fit the model; greedy text."""

from __future__ import annotations

import math

import torch
from tqdm.auto import tqdm

from ..model.adapter import text_config
from ..model.nll import next_token_nll


def check_windows(model, windows: torch.Tensor) -> None:
    """Refuse windows that are not a non-empty integer [n, T >= 2] tensor of token ids the model has, or are longer
    than the model's context."""
    if not isinstance(windows, torch.Tensor) or windows.ndim != 2 or windows.numel() == 0 or windows.shape[1] < 2:
        raise ValueError("windows must be a non-empty LongTensor [n_windows, seq_len] with seq_len >= 2")
    if windows.dtype.is_floating_point or windows.dtype.is_complex or windows.dtype == torch.bool:
        raise ValueError(f"windows hold token ids and must be an integer tensor, got {windows.dtype}; "
                         "build them with data.ppl_windows or tokenizer(...).input_ids")
    vocab = model.get_input_embeddings().num_embeddings
    low, high = int(windows.min()), int(windows.max())
    if low < 0 or high >= vocab:
        raise ValueError(f"windows hold token ids in {low}..{high}, but this model's vocabulary is 0..{vocab - 1}; "
                         "were they made with another tokenizer?")
    limit = getattr(text_config(model.config), "max_position_embeddings", None)
    if limit is not None and windows.shape[1] > limit:
        raise ValueError(f"windows are {windows.shape[1]} tokens long but the model's context is {limit} tokens")


@torch.no_grad()
def nll_sum(model, windows: torch.Tensor, batch_size: int = 4, progress: bool = True) -> tuple[float, int]:
    """Summed next-token NLL (nats) and the number of predicted tokens.

    Args:
        windows: LongTensor [n, T]; every position after the first is predicted.
    """
    check_windows(model, windows)
    device = next(model.parameters()).device
    total, count = 0.0, 0
    batches = range(0, len(windows), batch_size)
    for start in tqdm(batches, desc="perplexity", leave=False, disable=not progress):
        ids = windows[start : start + batch_size].to(device)
        total += next_token_nll(model(input_ids=ids, use_cache=False).logits, ids, "sum").item()
        count += ids[:, 1:].numel()
    return total, count


def perplexity(model, windows: torch.Tensor, batch_size: int = 4, progress: bool = True) -> float:
    """exp(mean token NLL) over all predicted tokens of `windows` [n, T]."""
    total, count = nll_sum(model, windows, batch_size, progress)
    return math.exp(total / count)


@torch.no_grad()
def greedy_text(model, tok, prompt: str, max_new_tokens: int = 30) -> str:
    """Greedy continuation of `prompt` (decoded new tokens only), with the KV cache."""
    ids = tok(prompt, return_tensors="pt").input_ids.to(next(model.parameters()).device)
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=tok.pad_token_id or tok.eos_token_id)
    return tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
