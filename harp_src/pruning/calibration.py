"""Calibration passes: per-input-column statistics of chosen Linear modules from forward pre-hooks, over the whole
model or layer by layer on the already-pruned layers below."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from ..model.adapter import get_adapter
from .methods import PruneRequest
from .record import apply_entry, linears


# ---------------------------------------------------------------------------------------------- calibration
class _Stop(Exception):
    """Raised by a hook to end a calibration forward once the layer of interest has run."""


class InputStats:
    """Per input column of some Linear modules: Σx, Σx² (float64) and the token count, from forward pre-hooks."""

    def __init__(self, modules: dict[str, nn.Linear]):
        self.sum: dict[str, torch.Tensor] = {}
        self.sq: dict[str, torch.Tensor] = {}
        self.n: dict[str, int] = {}
        self.handles = [m.register_forward_pre_hook(self._hook(k)) for k, m in modules.items()]

    def _hook(self, key: str):
        def hook(mod, args):
            x = args[0].detach().flatten(0, -2).double()
            self.sum[key] = self.sum.get(key, 0) + x.sum(0)
            self.sq[key] = self.sq.get(key, 0) + (x * x).sum(0)
            self.n[key] = self.n.get(key, 0) + x.shape[0]
        return hook

    def norm(self, key: str) -> torch.Tensor:
        return self.sq[key].sqrt()

    def mean(self, key: str) -> torch.Tensor:
        return self.sum[key] / self.n[key]

    def var(self, key: str) -> torch.Tensor:
        return (self.sq[key] / self.n[key] - self.mean(key) ** 2).clamp_min(0)

    def close(self) -> None:
        for h in self.handles:
            h.remove()


@torch.no_grad()
def calibrate(model: nn.Module, windows: torch.Tensor, modules: dict[str, nn.Linear], batch_size: int,
               stop_at: int | None = None) -> InputStats:
    """Run the decoder over `windows` (no LM head), collecting input statistics of `modules`; with `stop_at`, each
    forward ends after that layer."""
    ad, device = get_adapter(model), next(model.parameters()).device
    stats = InputStats(modules)
    stop = None
    if stop_at is not None:
        def halt(mod, args, out):
            raise _Stop
        stop = ad.layers[stop_at].register_forward_hook(halt)
    try:
        for start in range(0, len(windows), batch_size):
            try:
                model.get_decoder()(input_ids=windows[start:start + batch_size].to(device), use_cache=False)
            except _Stop:
                pass
    finally:
        stats.close()
        if stop is not None:
            stop.remove()
    return stats


# ---------------------------------------------------------------------------------------------- methods
@dataclass
class LayerInputs:
    """One batch of calibration windows as the decoder feeds its layers: the hidden states entering the first layer,
    and each layer's other inputs (masks and position embeddings: Gemma's sliding and global layers differ)."""

    hidden: torch.Tensor
    args: list[tuple]
    kwargs: list[dict]

    def run(self, layer: nn.Module, i: int, hidden: torch.Tensor) -> torch.Tensor:
        """Layer i (`layer`) on `hidden` with the inputs the decoder gave it."""
        out = layer(hidden, *self.args[i], **self.kwargs[i])
        return out[0] if isinstance(out, tuple) else out


def _capture(seen: dict, i: int):
    def hook(mod, args, kwargs):
        seen[i] = (args, kwargs)
    return hook


@torch.no_grad()
def layer_inputs(model: nn.Module, windows: torch.Tensor, batch_size: int) -> list[LayerInputs]:
    """Each batch's LayerInputs, captured by forward pre-hooks in one decoder forward (no LM head)."""
    ad, device = get_adapter(model), next(model.parameters()).device
    batches = []
    for start in range(0, len(windows), batch_size):
        seen: dict[int, tuple] = {}
        handles = [layer.register_forward_pre_hook(_capture(seen, i), with_kwargs=True)
                   for i, layer in enumerate(ad.layers)]
        try:
            model.get_decoder()(input_ids=windows[start:start + batch_size].to(device), use_cache=False)
        finally:
            for h in handles:
                h.remove()
        first_args, first_kwargs = seen[0]
        hidden = first_args[0] if first_args else first_kwargs["hidden_states"]
        rest = [(a[1:], k) if a else (a, {n: v for n, v in k.items() if n != "hidden_states"})
                for a, k in (seen[i] for i in range(ad.n_layers))]
        batches.append(LayerInputs(hidden, [a for a, _ in rest], [k for _, k in rest]))
    return batches


@torch.no_grad()
def sequential(model: nn.Module, request: PruneRequest, desc: str, layer_entry) -> dict[int, dict]:
    """Layer by layer from the bottom: calibrate layer i on the already-pruned layers below, prune it.

    The windows' hidden states are carried from layer to layer (each layer runs twice: once to collect its input
    statistics, once pruned to feed the next), so the whole pass costs ~3 model forwards, not L²/2 layer forwards.

    Args:
        layer_entry: (layer, InputStats of its q_proj, o_proj, gate_proj and down_proj inputs) -> record entry.
    """
    ad = get_adapter(model)
    batches = layer_inputs(model, request.windows, request.batch_size)
    hidden = [b.hidden for b in batches]
    entries = {}
    for i in tqdm(range(ad.n_layers), desc=desc, disable=not request.progress, leave=False):
        lin = linears(ad, i)
        stats = InputStats({f"{i}.{p}": lin[p] for p in ("q_proj", "o_proj", "gate_proj", "down_proj")})
        try:
            for b, h in zip(batches, hidden, strict=True):
                b.run(ad.layers[i], i, h)
        finally:
            stats.close()
        entries[i] = layer_entry(i, stats)
        apply_entry(ad, i, entries[i])
        hidden = [b.run(ad.layers[i], i, h) for b, h in zip(batches, hidden, strict=True)]
    return entries


def windows_meta(windows) -> dict:
    if windows is None:
        return {}
    arr = np.ascontiguousarray(windows.cpu().numpy())
    return {"calib_windows": list(arr.shape), "calib_sha256": hashlib.sha256(arr.tobytes()).hexdigest()}
