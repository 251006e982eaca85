"""Run a model from a cached layer boundary, so configurations that share their lower layers share that work.

One dense forward records, for every decoder layer, its input hidden state and the keyword arguments the
model passed it (mask, rotary embeddings, ...). Any stack that leaves layers below `start` unchanged can then be
evaluated by running only layers start..L-1, the final norm and the LM head.
"""

from __future__ import annotations

import math

import torch

from ..model.adapter import get_adapter
from ..model.nll import token_nll
from .harp import harp_applied

CHUNK = 64  # positions per LM-head call: the [B · chunk × vocab] logits stay in cache instead of memory


def window_nll(adapter, normed: torch.Tensor, ids: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """Summed next-token NLL per window [B] (float64) of final-normed states [B, T, d] for `ids` [B, T], the LM head
    and log-softmax run on `chunk` positions at a time, so the [B × T × vocab] logits are never held at once."""
    total = torch.zeros(ids.shape[0], dtype=torch.float64, device="cpu")
    for start in range(0, ids.shape[1] - 1, chunk):
        end = min(start + chunk, ids.shape[1] - 1)
        logits = adapter.head_logits(normed[:, start:end])
        nll = token_nll(logits, ids[:, start + 1 : end + 1])
        total += nll.detach().view(ids.shape[0], -1).sum(-1).double().cpu()
    return total


def chunked_nll(adapter, normed: torch.Tensor, ids: torch.Tensor, chunk: int = CHUNK) -> float:
    """Summed next-token NLL over all windows: `window_nll` added up (the same number as one LM-head call, up to
    summation order)."""
    return float(window_nll(adapter, normed, ids, chunk).sum())


class Boundaries:
    """Inputs of every decoder layer for a list of batches of windows (computed once, dense model)."""

    def __init__(self, model, windows: torch.Tensor, batch_size: int = 4, chunk: int = CHUNK):
        self.model, self.chunk = model, chunk
        self.ad = get_adapter(model)
        device = next(model.parameters()).device
        self.batches = []  # (ids, [per-layer input], [per-layer kwargs])
        with torch.no_grad():
            for start in range(0, len(windows), batch_size):
                ids = windows[start : start + batch_size].to(device)
                self.batches.append((ids, *self._capture(ids)))

    def _capture(self, ids):
        inputs, kwargs = [], []

        def hook(mod, args, kw):
            inputs.append(args[0] if args else kw["hidden_states"])
            kwargs.append({k: v for k, v in kw.items() if k != "hidden_states"})

        handles = [layer.register_forward_pre_hook(hook, with_kwargs=True) for layer in self.ad.layers]
        try:
            self.model.get_decoder()(input_ids=ids, use_cache=False)
        finally:
            for h in handles:
                h.remove()
        return inputs, kwargs

    def window_nll_from(self, start: int) -> torch.Tensor:
        """Summed next-token NLL per window [n_windows] (float64) when running layers start..L-1 of the model as it
        is now."""
        parts = []
        with torch.no_grad():
            for ids, inputs, kwargs in self.batches:
                h = inputs[start]
                for i in range(start, self.ad.n_layers):
                    out = self.ad.layers[i](h, **kwargs[i])
                    h = out[0] if isinstance(out, tuple) else out
                parts.append(window_nll(self.ad, self.ad.final_norm(h), ids, self.chunk))
        return torch.cat(parts)

    @property
    def n_predicted(self) -> int:
        """Next-token predictions per window (T − 1)."""
        return self.batches[0][0].shape[1] - 1

    def nll_from(self, start: int) -> tuple[float, int]:
        """Summed next-token NLL and the number of predicted tokens when running layers start..L-1."""
        per_window = self.window_nll_from(start)
        return float(per_window.sum()), len(per_window) * self.n_predicted


def nll_of_plan(bounds: Boundaries, layers: list[int], alphas, fold: bool = True, bypass: str = "identity"
                ) -> tuple[float, int]:
    """NLL of the model with `layers` pruned, rerunning only from the lowest layer the plan bypasses up."""
    if not layers:
        return bounds.nll_from(bounds.ad.n_layers - 1)
    with harp_applied(bounds.model, layers, alphas, fold, bypass) as plan:
        return bounds.nll_from(plan.layers[0])


def ppl_of_plan(bounds: Boundaries, alphas: dict[int, float]) -> float:
    """Perplexity on the bounds' windows with `alphas` ({layer: α}) applied; {} is the dense model (full run)."""
    nll, count = nll_of_plan(bounds, sorted(alphas), alphas) if alphas else bounds.nll_from(0)
    return math.exp(nll / count)
