"""Which layers HARP prunes: specs such as 'top:8', the one validation of a layer set, the paper's N scaled to
depth, and the number checks plans share."""

from __future__ import annotations

import numbers
from collections.abc import Iterable

import numpy as np

from ..model.adapter import Adapter


def is_number(x) -> bool:
    return isinstance(x, (numbers.Real, np.floating, np.integer)) and not isinstance(x, (bool, np.bool_))


def is_integer(x) -> bool:
    return isinstance(x, (numbers.Integral, np.integer)) and not isinstance(x, (bool, np.bool_))


def parse_layer_key(key) -> int:
    if not isinstance(key, str) or not key.isdecimal() or str(int(key)) != key:
        raise ValueError(f"layer key {key!r} is not a plain layer number such as \"28\"")
    return int(key)


def _layer_number(x, spec) -> int:
    if not is_integer(x):
        raise ValueError(f"layers must be integers (0-based indices), got {x!r} in {spec!r}")
    return int(x)


def parse_layers(spec: str | Iterable[int], n_layers: int) -> list[int]:
    """'top:8', 'bottom:4', '3,5,7', '20-29' or an iterable of ints -> list of 0-based layers (not yet range-checked:
    `check_layers` does that)."""
    if spec is None or not isinstance(spec, (str, Iterable)):
        raise ValueError(f"layers must be a spec such as 'top:8' or a list of layer indices, got {spec!r}")
    if not isinstance(spec, str):
        return [_layer_number(i, spec) for i in spec]
    spec = spec.strip()
    try:
        if ":" in spec:
            where, n = spec.split(":", 1)
            n = int(n)
            if not 0 <= n <= n_layers:
                raise ValueError(f"N must be in 0..{n_layers}")
            if where == "top":
                return list(range(n_layers - n, n_layers))
            if where == "bottom":
                return list(range(n))
            raise ValueError("unknown selection")
        out: list[int] = []
        for part in filter(None, (p.strip() for p in spec.split(","))):
            lo, _, hi = part.partition("-")
            out += list(range(int(lo), int(hi) + 1)) if hi else [int(lo)]
        return out
    except ValueError as err:
        raise ValueError(f"layers {spec!r} ({err}): use top:N, bottom:N, a range a-b or a list a,b,c") from None


def check_layers(adapter: Adapter, layers: str | Iterable[int]) -> list[int]:
    """The one validation of a layer set (pruning and α search): parsed, not empty, in range, each once, none pruned
    yet.

    Args:
        layers: 0-based indices or a spec such as "top:8" (see parse_layers).
    Returns:
        The layers, sorted ascending.
    """
    layers = parse_layers(layers, adapter.n_layers)
    if not layers:
        raise ValueError("no layers given: name at least one layer, e.g. 'top:8' or [28, 29]")
    for i in layers:
        adapter.check_layer(i)
    if len(set(layers)) != len(layers):
        raise ValueError(f"layers {layers} contain duplicates; give each layer once")
    already = [i for i in layers if adapter.is_bypassed(i)]
    if already:
        raise ValueError(f"layers {already} are already pruned; start again from the base model to re-prune them")
    return sorted(layers)


def quarter_depth(n_layers: int) -> int:
    """The paper's N = 8 of 32 layers, scaled to this depth."""
    return max(1, round(n_layers * 8 / 32))


def n_values(n_layers: int, n_max_frac: float = 0.5, count: int = 8) -> list[int]:
    """About `count` values of N from 1 to n_layers · n_max_frac, always with 1, the maximum and the paper's
    N = depth · 8/32 (for sweeps over the number of pruned layers)."""
    top = max(1, round(n_layers * n_max_frac))
    values = {max(1, round(1 + k * (top - 1) / max(count - 1, 1))) for k in range(count)}
    return sorted(values | {min(quarter_depth(n_layers), top)})
