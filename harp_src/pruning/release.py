"""The configuration the paper's release scripts evaluate: HARP on the top N layers, then FLAP on MLP channels (with
its bias compensation) calibrated on the HARP model, until all attention weights of those layers are removed in the
paper's convention (`budgets.budgets`: "release"; FLAP removes the release budget less HARP's own)."""

from __future__ import annotations

import copy

import torch
from torch import nn

from ..method.harp import apply_harp
from ..model.weights import sharing_copy
from .prune import prune, pruned_copy, shared_copy
from .record import PruneRecord

METHOD = "harp+flap"


def harp_flap(dense: nn.Module, alphas: dict[int, float], flap_budget: int, calib: torch.Tensor, *,
              share: bool = False) -> tuple[nn.Module, PruneRecord | None]:
    """HARP with `alphas` on a copy of `dense`, then FLAP [mlp] removing `flap_budget` parameters, scored on `calib`
    (enwiki-train windows) through that HARP model. `dense` is left as it was; with `share` the copy holds `dense`'s
    own tensors where pruning keeps them (inference only), without it the copy owns its weights. Returns the model and
    FLAP's record (`harp_flap_again` rebuilds it from the α's and the record); with a budget of 0 (every α = 0: HARP
    alone already removes the layers' whole attention) FLAP removes nothing and the record is None."""
    harped = sharing_copy(dense) if share else copy.deepcopy(dense)
    apply_harp(harped, sorted(alphas), alphas, meta={"method": METHOD})
    if flap_budget <= 0:
        return harped, None
    if share:  # FLAP slices what it prunes: the new projections are the copy's, the rest stays dense's
        return pruned_copy(harped, "flap", flap_budget, calib, "mlp", progress=False, share=True)
    return harped, prune(harped, "flap", flap_budget, calib, "mlp", progress=False)


def harp_flap_again(dense: nn.Module, alphas: dict[int, float], record: PruneRecord | None) -> nn.Module:
    """The model `harp_flap` built, from its α's and FLAP's record (no calibration), sharing `dense`'s tensors."""
    harped = sharing_copy(dense)
    apply_harp(harped, sorted(alphas), alphas, meta={"method": METHOD})
    return harped if record is None else shared_copy(harped, record)
