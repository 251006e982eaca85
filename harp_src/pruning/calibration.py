"""Calibration passes: per-input-column statistics of chosen Linear modules from forward pre-hooks, over the whole
model or layer by layer on the already-pruned layers below."""

from __future__ import annotations

import hashlib

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
def sequential(model: nn.Module, request: PruneRequest, desc: str, layer_entry) -> dict[int, dict]:
    """Layer by layer from the bottom: calibrate layer i on the already-pruned layers below, prune it.

    Args:
        layer_entry: (layer, InputStats of its q_proj, o_proj, gate_proj and down_proj inputs) -> record entry.
    """
    ad = get_adapter(model)
    entries = {}
    for i in tqdm(range(ad.n_layers), desc=desc, disable=not request.progress, leave=False):
        lin = linears(ad, i)
        watched = {f"{i}.{p}": lin[p] for p in ("q_proj", "o_proj", "gate_proj", "down_proj")}
        stats = calibrate(model, request.windows, watched, request.batch_size, stop_at=i)
        entries[i] = layer_entry(i, stats)
        apply_entry(ad, i, entries[i])
    return entries


def windows_meta(windows) -> dict:
    if windows is None:
        return {}
    arr = np.ascontiguousarray(windows.cpu().numpy())
    return {"calib_windows": list(arr.shape), "calib_sha256": hashlib.sha256(arr.tobytes()).hexdigest()}
