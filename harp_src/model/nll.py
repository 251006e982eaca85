"""Next-token negative log-likelihood: the one implementation every loss, perplexity and score here uses."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def token_nll(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "none") -> torch.Tensor:
    """NLL (nats, in float32 or wider: bf16 logits are promoted) of `targets` [B, T] under `logits` [B, T, vocab] at
    the same positions.

    Args:
        reduction: "none" (flat [B·T]), "sum" or "mean", as `F.cross_entropy`.
    """
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction=reduction)


def next_token_nll(logits: torch.Tensor, ids: torch.Tensor, reduction: str = "none") -> torch.Tensor:
    """NLL of each next token: position t's logits [B, T, vocab] predict ids[:, t + 1] ([B, T] token ids)."""
    return token_nll(logits[:, :-1], ids[:, 1:], reduction)
