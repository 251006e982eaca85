"""`prune(model, method, budget_params, calib_windows, scope)`: the one entry to every baseline, through a registry of
pruners that share one signature; `pruned_copy` prunes a copy and leaves the model as it was; `applied_copy` and
`shared_copy` rebuild a pruned copy from its record."""

from __future__ import annotations

import copy
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from ..eval.perplexity import check_windows
from ..model.adapter import fingerprint, get_adapter
from ..model.weights import n_params, sharing_copy
from .budgets import capacity, scoped_layers
from .calibration import windows_meta
from .flap import flap
from .layer_drop import attention_drop_similar, attention_drop_top, shortgpt
from .llm_pruner import llm_pruner
from .magnitude import mag_sp
from .methods import DATA_FREE, METHODS, SCOPES, SEQUENTIAL, UNSTRUCTURED, Entries, PruneRequest
from .record import PruneRecord, apply_entry, edits_in_place, finish, linears, zeroed_count
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


def _entries(model: nn.Module, request: PruneRequest) -> Entries:
    """The pruner's entries for `model` (in eval mode meanwhile; its training flag is restored)."""
    was_training = model.training
    model.eval()
    try:
        return PRUNERS[request.method](model, request)
    finally:
        model.train(was_training)


def _applied(model: nn.Module, request: PruneRequest, found: Entries, before: int) -> PruneRecord:
    """Apply the entries to `model` (unless the pruner already did) and record what was removed from `before`
    parameters."""
    entries, applied = found
    ad = get_adapter(model)
    if not applied:
        for i in sorted(entries):
            apply_entry(ad, i, entries[i])
    record = PruneRecord(request.method, request.scope, request.budget, fingerprint(model.config), entries,
                         before - n_params(model), zeroed_count(entries, ad), windows_meta(request.windows))
    finish(model, record)
    return record


def _request(model, method, budget_params, calib_windows, scope, *, batch_size, progress) -> PruneRequest:
    """The checked request of a `prune` call (see `_check_call` for what is refused)."""
    scope = _check_call(model, method, scope, budget_params, calib_windows)
    return PruneRequest(method, scope, int(budget_params), calib_windows, batch_size, progress)


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
    request = _request(model, method, budget_params, calib_windows, scope, batch_size=batch_size,
                       progress=progress)
    before = n_params(model)
    return _applied(model, request, _entries(model, request), before)


def _copy_for(model: nn.Module, entries: dict[int, dict]) -> nn.Module:
    """A deep copy of `model` for `entries` to be applied to. It shares (does not copy) the projections of the layers
    whose entries replace them by new, sliced ones; call `_unshare` after applying."""
    ad = get_adapter(model)
    shared = [p for i, e in entries.items() if not edits_in_place(e) for lin in linears(ad, i).values()
              for p in lin.parameters()]
    return copy.deepcopy(model, {id(p): p for p in shared})


def _edited(model: nn.Module, entries: dict[int, dict]) -> list[nn.Module]:
    """The projections `entries` edit in place (unstructured zeroing): a copy may not share them."""
    ad = get_adapter(model)
    return [lin for i, e in entries.items() if edits_in_place(e) for lin in linears(ad, i).values()]


def _unshare(pruned: nn.Module, model: nn.Module) -> None:
    """Give `pruned` its own clone of every parameter it still shares with `model` (tied ones stay tied)."""
    own, clones = {id(p) for p in model.parameters()}, {}
    for module in pruned.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if id(p) in own:
                if id(p) not in clones:
                    clones[id(p)] = nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad)
                setattr(module, name, clones[id(p)])


def pruned_copy(model: nn.Module, method: str, budget_params: int, calib_windows: torch.Tensor | None = None,
                scope: str | None = None, *, batch_size: int = 2, progress: bool = True,
                share: bool = False) -> tuple[nn.Module, PruneRecord]:
    """A pruned copy of `model` and its PruneRecord, as `prune` on a deep copy would give them; `model` is unchanged.

    Every method but the layer-sequential ones (SEQUENTIAL) scores `model` itself, then copies it without the
    projections of the layers it prunes (slicing replaces them by new ones; what is left shared is cloned after). So
    neither the scoring's working memory (LLM-Pruner's gradients: ~4 GB on a 1.5B model in fp32) nor the projections
    about to be replaced are held beside a full copy. Arguments as for `prune`, and:

    share: for a copy only measured beside `model` (inference), the weights pruning keeps as they are stay `model`'s
        own tensors (`sharing_copy`), as in `shared_copy`; train or edit neither model in place while both are in use.
    """
    request = _request(model, method, budget_params, calib_windows, scope, batch_size=batch_size,
                       progress=progress)
    before = n_params(model)
    if method in SEQUENTIAL:
        # scored on the copy as it is pruned: only pruning that slices (never edits a weight in place) may share
        pruned = sharing_copy(model) if share and method not in UNSTRUCTURED else copy.deepcopy(model)
        return pruned, _applied(pruned, request, _entries(pruned, request), before)
    found = _entries(model, request)
    pruned = sharing_copy(model, keep=_edited(model, found[0])) if share else _copy_for(model, found[0])
    record = _applied(pruned, request, found, before)
    if not share:
        _unshare(pruned, model)
    return pruned, record


def applied_copy(model: nn.Module, record: PruneRecord) -> nn.Module:
    """A copy of `model` pruned as `record` says, as `record.apply` on a deep copy would give it (refused, with `model`
    unchanged, where the record does not fit); the projections the record replaces are never copied."""
    pruned = _copy_for(model, record.layers)
    record.apply(pruned)
    _unshare(pruned, model)
    return pruned


def shared_copy(model: nn.Module, record: PruneRecord) -> nn.Module:
    """The model `record` describes, for inference beside `model` (timing, evaluation): equal to `applied_copy`'s, but
    the weights the record keeps as they are stay `model`'s own tensors (`sharing_copy`), so it costs only what the
    pruning replaces. Refused, with `model` unchanged, where the record does not fit. Train or edit neither model in
    place while both are in use."""
    pruned = sharing_copy(model, keep=_edited(model, record.layers))
    record.apply(pruned)
    return pruned
