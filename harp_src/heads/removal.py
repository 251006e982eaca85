"""Really removing attention heads under the GQA rule (every KV group loses the same number of query heads)."""

from __future__ import annotations

from ..model.adapter import Adapter, get_adapter, mark_kv_free
from ..model.weights import n_params
from ..pruning.slicing import balanced_groups, keep_query_heads


def check_heads(adapter: Adapter, heads: dict[int, list[int]]) -> dict[int, list[int]]:
    """`heads` ({layer: [query head, ...]}) checked against the model: layers and head indices in range, distinct."""
    out = {}
    for layer, hs in heads.items():
        adapter.check_layer(layer)
        hs = list(hs)
        bad = [h for h in hs if isinstance(h, bool) or not isinstance(h, int) or not 0 <= h < adapter.n_heads]
        if bad:
            raise ValueError(f"head index {bad[0]!r} of layer {layer} is out of range: this model has heads "
                             f"0..{adapter.n_heads - 1} per layer")
        if len(set(hs)) != len(hs):
            raise ValueError(f"layer {layer} lists a head twice: {hs}")
        out[layer] = sorted(hs)
    return out


# ---------------------------------------------------------------------------------------------- real removal
def slice_off_heads(model, heads: dict[int, list[int]]) -> int:
    """Remove `heads` ({layer: [query head, ...]}) from the weights in place; returns the parameters removed.

    Every layer must lose the same number of query heads from each of its KV groups (`pruning.slicing.balanced_groups`),
    the only removals that keep a valid GQA layout; a layer that loses all its heads becomes a constant sub-layer
    with no KV cache. Checked for every layer before anything changes.
    """
    ad = get_adapter(model)
    heads = {i: hs for i, hs in check_heads(ad, heads).items() if hs}
    for i, hs in heads.items():
        if not ad.attention_is_dense(i):
            raise ValueError(f"layer {i}'s attention is no longer dense (bypassed, dropped or sliced); "
                             "slice heads off a dense model")
        balanced_groups(ad, i, hs)
    before = n_params(model)
    for i, hs in heads.items():
        keep_query_heads(ad, i, [h for h in range(ad.n_heads) if h not in hs])
    emptied = [i for i, hs in heads.items() if len(hs) == ad.n_heads]
    if emptied:
        mark_kv_free(model, emptied)
    return before - n_params(model)
