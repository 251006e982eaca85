"""Counting, freezing, sharing and rebuilding a model's parameters: one implementation each."""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn


def n_params(module: nn.Module, trainable: bool = False, linear: bool = False) -> int:
    """Parameters of `module` (each tensor once): all, only those that require grad, or only nn.Linear ones."""
    if linear:
        return sum(p.numel() for m in module.modules() if isinstance(m, nn.Linear) for p in m.parameters())
    return sum(p.numel() for p in module.parameters() if p.requires_grad or not trainable)


def linear_with(weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Linear:
    """A new Linear holding copies of `weight` [out, in] and `bias`, on their device and dtype. It skips the random
    initialisation nn.Linear would run and pruning would overwrite (~35 ms per projection of a 1.5B model's MLP on 2
    CPU cores: half of building it)."""
    new = nn.utils.skip_init(nn.Linear, weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device,
                             dtype=weight.dtype)
    with torch.no_grad():
        new.weight.copy_(weight)
        if bias is not None:
            new.bias.copy_(bias)
    return new


@contextmanager
def only_trainable(model: nn.Module, params: Iterable[nn.Parameter] = ()) -> Iterator[None]:
    """Freeze every parameter of `model` except `params` while inside; each parameter's flag comes back after."""
    flags = {p: p.requires_grad for p in model.parameters()}
    for p in model.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    try:
        yield
    finally:
        for p, flag in flags.items():
            p.requires_grad_(flag)


def sharing_copy(model: nn.Module, keep: Iterable[nn.Module] = ()) -> nn.Module:
    """A deep copy of `model` whose Linear and Embedding weights are `model`'s own tensors (not copied), except those
    of the modules in `keep`, which are copied; everything else (norms, buffers, config) is copied.

    For a pruned model used beside its dense one for inference only (timing, evaluation): what pruning replaces by new
    modules is new in the copy, the rest is held once. Train or edit in place neither model while both are in use;
    `keep` the modules whose weights the pruning will edit in place.
    """
    kept = {id(p) for m in keep for p in m.parameters()}
    shared = {id(p): p for m in model.modules() if isinstance(m, (nn.Linear, nn.Embedding))
              for p in m.parameters(recurse=False) if id(p) not in kept}
    return copy.deepcopy(model, shared)


def held_bytes(model: nn.Module, beside: nn.Module | None = None) -> int:
    """Bytes of memory `model`'s parameters and buffers hold (each storage once), leaving out those stored in
    `beside`'s own: what a `sharing_copy` adds to memory next to the model it shares with."""
    theirs = set() if beside is None else {_storage(t) for t in _tensors(beside)}
    held = {_storage(t): t.untyped_storage().nbytes() for t in _tensors(model)}
    return sum(size for ptr, size in held.items() if ptr not in theirs)


def _tensors(model: nn.Module) -> Iterator:
    yield from model.parameters()
    yield from model.buffers()


def _storage(t) -> int:
    return t.untyped_storage().data_ptr()
