"""Token-level fidelity of a model to a reference on the same windows: KL(reference ‖ model), top-1 agreement,
Δ NLL per token, per window (for paired comparisons) and summarised with bootstrap intervals."""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..model.adapter import get_adapter
from .perplexity import check_windows
from .stats import mean_ci

# ---------------------------------------------------------------------------------------------- fidelity
FIDELITY_METRICS = {"kl": "KL(reference ‖ model) per token",  # what each metric is (nats), for tables and figures
                    "top1_agreement": "top-1 agreement with reference",
                    "delta_nll": "NLL(model) − NLL(reference) per token"}


def _vocab_size(model) -> int:
    return model.get_output_embeddings().weight.shape[0]


def _check_pair(reference, model, windows: torch.Tensor, tokenizers) -> None:
    check_windows(reference, windows)
    check_windows(model, windows)
    if _vocab_size(reference) != _vocab_size(model):
        raise ValueError(f"the models have different vocabularies ({_vocab_size(reference)} vs {_vocab_size(model)} "
                         "tokens): fidelity compares a model with its own dense version, over one tokenizer")
    if tokenizers is not None and tokenizers[0].get_vocab() != tokenizers[1].get_vocab():
        raise ValueError("the two tokenizers differ: the same token ids would mean different text to the models")


@torch.no_grad()
def final_states(model, ids: torch.Tensor) -> torch.Tensor:
    """The decoder's last hidden states [B, T, d], what the LM head reads (no cache)."""
    return model.get_decoder()(input_ids=ids.to(next(model.parameters()).device), use_cache=False).last_hidden_state


def reference_states(reference, windows: torch.Tensor, batch_size: int = 1) -> list[torch.Tensor]:
    """`reference`'s final states per batch of `windows`, to pass to `fidelity_windows` when one reference is
    compared with many models (its decoder then runs once, not once per model)."""
    return [final_states(reference, windows[s : s + batch_size]) for s in range(0, len(windows), batch_size)]


@torch.no_grad()
def _window_sums(reference, model, ids: torch.Tensor, chunk: int, ref_states: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """Per window [B]: summed KL, top-1 agreements, NLL of reference and of model, over the T − 1 predictions.

    Returns [B, 4]. The LM head runs on `chunk` positions at a time, so no [T × vocab] logits are ever held.
    """
    states = [final_states(reference, ids) if ref_states is None else ref_states, final_states(model, ids)]
    heads = (get_adapter(reference).head_logits, get_adapter(model).head_logits)
    targets = ids[:, 1:]
    sums = torch.zeros(ids.shape[0], 4, dtype=torch.float64, device="cpu")
    for start in range(0, ids.shape[1] - 1, chunk):
        end = min(start + chunk, ids.shape[1] - 1)
        lp_ref, lp = (F.log_softmax(head(h[:, start:end]).float(), dim=-1).cpu() for head, h in zip(heads, states,
                                                                                                     strict=True))
        t = targets[:, start:end, None].cpu()
        sums[:, 0] += (lp_ref.exp() * (lp_ref - lp)).sum(-1).sum(-1).double()
        sums[:, 1] += (lp_ref.argmax(-1) == lp.argmax(-1)).sum(-1).double()
        sums[:, 2] -= lp_ref.gather(-1, t).squeeze(-1).sum(-1).double()
        sums[:, 3] -= lp.gather(-1, t).squeeze(-1).sum(-1).double()
    return sums


def fidelity_windows(reference, model, windows: torch.Tensor, *, batch_size: int = 1, chunk: int = 128,
                     tokenizers: tuple | None = None, progress: bool = True,
                     ref_states: list[torch.Tensor] | None = None) -> pd.DataFrame:
    """Per window: the mean over its predicted tokens of KL(reference ‖ model), top-1 agreement, Δ NLL (model −
    reference) and both NLLs. Same arguments as `fidelity`; for paired comparisons of two pruned models.
    `ref_states`: `reference_states(reference, windows, batch_size)`, computed once for many models."""
    _check_pair(reference, model, windows, tokenizers)
    starts = range(0, len(windows), batch_size)
    if ref_states is not None and [len(r) for r in ref_states] != [len(windows[s : s + batch_size]) for s in starts]:
        raise ValueError("ref_states do not match these windows and batch_size; make them with "
                         "reference_states(reference, windows, batch_size)")
    per_window = []
    for k, start in enumerate(tqdm(starts, desc="fidelity", leave=False, disable=not progress)):
        per_window.append(_window_sums(reference, model, windows[start : start + batch_size], chunk,
                                       None if ref_states is None else ref_states[k]))
    sums = torch.cat(per_window) / (windows.shape[1] - 1)  # per-window means; equal lengths, so the mean is per token
    kl, agree, nll_ref, nll = sums.unbind(1)
    return pd.DataFrame({"window": range(len(windows)), "kl": kl.numpy(), "top1_agreement": agree.numpy(),
                         "delta_nll": (nll - nll_ref).numpy(), "nll_reference": nll_ref.numpy(), "nll": nll.numpy(),
                         "n_tokens": windows.shape[1] - 1})


def fidelity(reference, model, windows: torch.Tensor, *, batch_size: int = 1, chunk: int = 128, seed: int = 0,
             tokenizers: tuple | None = None, progress: bool = True) -> pd.DataFrame:
    """How closely `model` (e.g. HARP-pruned) follows `reference` (its dense model), token by token, on `windows`.

    Args:
        reference, model: causal LMs over the same vocabulary (and, if `tokenizers` are given, the same tokenizer).
        windows: held-out token windows [n, T] (e.g. enwiki or Lee *test*), within both models' context.
        batch_size: windows per forward; chunk: positions per LM-head call (memory: batch · chunk · vocab floats).
        seed: seeds the bootstrap over windows.
    Returns:
        DataFrame, one row per metric of FIDELITY_METRICS: metric, value (mean over all predicted tokens), ci_low,
        ci_high (95 % bootstrap interval over windows), n_tokens, n_windows, seed.
    """
    per_window = fidelity_windows(reference, model, windows, batch_size=batch_size, chunk=chunk, tokenizers=tokenizers,
                                  progress=progress)
    return fidelity_summary(per_window, seed)


def fidelity_summary(per_window: pd.DataFrame, seed: int = 0) -> pd.DataFrame:
    """`fidelity`'s rows from `fidelity_windows`' per-window values: mean and bootstrap interval over windows."""
    rows = []
    for metric in FIDELITY_METRICS:
        value, low, high = mean_ci(per_window[metric].to_numpy(dtype=np.float64), seed)
        rows.append(dict(metric=metric, value=value, ci_low=low, ci_high=high,
                         n_tokens=int(per_window.n_tokens.sum()), n_windows=len(per_window), seed=seed))
    return pd.DataFrame(rows)
