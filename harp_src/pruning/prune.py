"""`prune(model, method, budget_params, calib_windows, scope)`: the one entry to every baseline, through a registry of
pruners that share one signature."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from ..eval.perplexity import check_windows
from ..model.adapter import fingerprint, get_adapter
from ..model.weights import n_params
from .budgets import capacity, scoped_layers
from .calibration import windows_meta
from .flap import flap
from .layer_drop import attention_drop_similar, attention_drop_top, shortgpt
from .llm_pruner import llm_pruner
from .magnitude import mag_sp
from .methods import DATA_FREE, METHODS, SCOPES, Entries, PruneRequest
from .record import PruneRecord, apply_entry, finish, zeroed_count
from .wanda import wanda, wanda_sp

# The one registry: method name -> pruner, all with the signature (model, PruneRequest) -> Entries.
PRUNERS: dict[str, Callable[[nn.Module, PruneRequest], Entries]] = {
    "mag-sp": mag_sp,
    "wanda-sp": wanda_sp,
    "flap": flap,
    "llm-pruner": llm_pruner,
    "shortgpt": shortgpt,
    "attn-drop-top": attention_drop_top,
    "attn-drop-sim": attention_drop_similar,
    "wanda": wanda,
}


def _check_call(model, method: str, scope: str | None, budget_params, calib_windows) -> str:
    if method not in SCOPES:
        raise ValueError(f"unknown method '{method}'; choose one of {', '.join(METHODS)}")
    scope = scope or SCOPES[method][0]
    if scope not in SCOPES[method]:
        raise ValueError(f"method '{method}' has no scope '{scope}'; valid: {', '.join(SCOPES[method])}")
    if isinstance(budget_params, bool) or not isinstance(budget_params, (int, np.integer)) or budget_params <= 0:
        raise ValueError(f"{method}: budget_params must be a positive number of parameters, got {budget_params!r}")
    ad = get_adapter(model)
    needs = {"heads+mlp": (True, True), "mlp": (False, True), "blocks": (True, True), "attention": (True, False),
             "linear": (True, True)}[scope]
    for i in scoped_layers(method, ad.n_layers):
        if (needs[0] and not ad.attention_is_dense(i)) or (needs[1] and not ad.mlp_is_dense(i)):
            raise ValueError(f"layer {i} is already pruned; {method} (scope {scope}) needs the unpruned layers")
    if method not in DATA_FREE:
        if calib_windows is None or len(calib_windows) == 0:
            raise ValueError(f"{method} scores units on calibration data: pass calib_windows, e.g. "
                             "data.ppl_windows(tok, 'enwiki', 'train', n_windows=8)")
        check_windows(model, calib_windows)
    most = capacity(model, method, scope)
    if budget_params > most:
        raise ValueError(f"a budget of {budget_params:,} parameters exceeds the {most:,} that {method} "
                         f"(scope {scope}) can remove from this model; choose a smaller budget")
    return scope


def prune(model: nn.Module, method: str, budget_params: int, calib_windows: torch.Tensor | None = None,
          scope: str | None = None, *, batch_size: int = 2, progress: bool = True) -> PruneRecord:
    """Prune `model` in place with a baseline method at a parameter budget.

    Args:
        model: a loaded causal LM of a supported family, unpruned where the method prunes.
        method: one of METHODS.
        budget_params: parameters to remove (weights to zero, for "wanda"); see `budgets` for HARP's two budgets.
        calib_windows: [n, T] token windows from calibration text (enwiki train) for the data-driven methods.
        scope: "heads+mlp" (default) or "mlp" for the fine-grained methods; the others have one scope.
    Returns:
        The PruneRecord (`model.prune_record`); `params_removed` is the model's real parameter drop.
    """
    scope = _check_call(model, method, scope, budget_params, calib_windows)
    before = n_params(model)
    was_training = model.training
    model.eval()
    try:
        request = PruneRequest(method, scope, int(budget_params), calib_windows, batch_size, progress)
        entries, applied = PRUNERS[method](model, request)
    finally:
        model.train(was_training)
    ad = get_adapter(model)
    if not applied:
        for i in sorted(entries):
            apply_entry(ad, i, entries[i])
    zeroed = zeroed_count(entries, ad)
    record = PruneRecord(method, scope, int(budget_params), fingerprint(model.config), entries,
                         before - n_params(model), zeroed, windows_meta(calib_windows))
    finish(model, record)
    return record
