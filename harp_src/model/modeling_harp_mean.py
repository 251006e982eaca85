"""The causal-mean bypass's decoding state: which tokens are real, the running sums a cache keeps, the O(T) mean.

A mean-bypassed layer keeps no K/V, only the sum of the values seen so far and their count per sequence
(`RunningMean`, in place of the layer's empty cache slot). A layer that keeps some heads and mean-bypasses the others
keeps both: its K/V slot also carries the sums (`WithRunningMean`), so beam search reorders them together. Like
modeling_harp.py, which imports it, this file imports only torch and transformers and travels in every pruned
checkpoint.
"""

from __future__ import annotations

import copy

import torch
from transformers.cache_utils import DummyLayer, DynamicLayer, DynamicSlidingWindowLayer, StaticLayer


def real_tokens(attention_mask, q_len: int) -> torch.Tensor | None:
    """[B, q_len] bool: which of the current tokens are real (not padding), read from the 4D mask transformers
    passes to attention (bool from sdpa, additive from eager). A real token attends to itself; a padding token's own
    key is masked. The current tokens are the mask's last `q_len` key positions (dynamic caches, sliding or not).
    None: no mask, every token is real."""
    if attention_mask is None:
        return None
    if not torch.is_tensor(attention_mask) or attention_mask.dim() != 4:
        raise ValueError(f"the mean bypass reads padding from a 4D tensor mask (sdpa or eager attention), got "
                         f"{type(attention_mask).__name__}; load the model with attn_implementation='sdpa'")
    allowed = attention_mask if attention_mask.dtype == torch.bool else (
        attention_mask > torch.finfo(attention_mask.dtype).min / 2)
    rows = torch.arange(q_len, device=allowed.device)
    cols = rows + allowed.shape[-1] - q_len
    return allowed[:, 0, rows, cols]


class RunningMean(DummyLayer):
    """A cache slot that keeps a mean-bypassed layer's decoding state: the sum of the value vectors seen so far and
    their count, per sequence; constant size, no K/V. Beam search reorders it like any cache layer; it cannot be
    cropped (a sum cannot forget its last tokens), so generation strategies that crop (assisted decoding) and
    compiled static caches are refused."""

    is_croppable = False
    is_compileable = False

    def __init__(self):
        super().__init__()
        self.sum = self.count = None

    def reset(self) -> None:
        self.sum = self.count = None

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise NotImplementedError("a mean-bypassed layer keeps a running sum, which cannot be cropped: generate "
                                      "without assisted decoding or cache cropping")

    def _select(self, fn) -> None:
        if self.sum is not None:
            self.sum, self.count = fn(self.sum), fn(self.count)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select(lambda t: t[indices])


def causal_mean(v: torch.Tensor, real: torch.Tensor | None, state: RunningMean | None = None) -> torch.Tensor:
    """Uniform causal average of v [B, T, D]: position t gets the mean of the real positions ≤ t (those of earlier
    calls included when `state` carries them; 0 where none is real). O(T · D) by a cumulative sum in float32.
    `state` is advanced past these positions."""
    weight = torch.ones(v.shape[:2], dtype=torch.float32, device=v.device) if real is None else real.float()
    sums = torch.cumsum(v.float() * weight[..., None], dim=1)
    counts = torch.cumsum(weight, dim=1)[..., None]
    if state is not None:
        if state.sum is not None:
            sums, counts = sums + state.sum[:, None], counts + state.count[:, None]
        state.sum, state.count = sums[:, -1].clone(), counts[:, -1].clone()  # not views that hold all of `sums`
    return (sums / counts.clamp_min(1.0)).to(v.dtype)


class WithRunningMean:
    """Mixed into the K/V slot of a layer that keeps heads and mean-bypasses the others: the slot also holds the
    bypass's running sums (`running`), reordered, repeated, selected and reset with its K/V; it cannot be cropped."""

    is_croppable = False
    running: RunningMean

    def __copy__(self):
        # a copy's batch selection must not reach the original's sums (the fast scorer copies slots, then selects)
        other = object.__new__(type(self))
        other.__dict__.update(vars(self), running=copy.copy(self.running))
        return other

    def reset(self) -> None:
        super().reset()
        self.running.reset()

    def crop(self, tokens_to_remove: int) -> None:
        self.running.crop(tokens_to_remove)  # refuses before the K/V are cut
        super().crop(tokens_to_remove)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self.running.reorder_cache(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self.running.batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self.running.batch_select_indices(indices)


class DynamicLayerWithMean(WithRunningMean, DynamicLayer):
    """A full-attention K/V slot with the running sums of its layer's mean-bypassed heads."""


class SlidingLayerWithMean(WithRunningMean, DynamicSlidingWindowLayer):
    """A sliding-window K/V slot with the running sums of its layer's mean-bypassed heads."""


WITH_MEAN = {DynamicLayer: DynamicLayerWithMean, DynamicSlidingWindowLayer: SlidingLayerWithMean}


def dynamic_slots(cache, layer_idx: int) -> list:
    """`cache.layers`, refused unless the cache is dynamic and has a slot for layer `layer_idx`: a static one's mask
    spans slots not yet written, and `real_tokens` would misread it."""
    slots = cache.layers
    if len(slots) <= layer_idx or any(isinstance(s, StaticLayer) for s in slots):
        raise ValueError("the mean bypass keeps its running sums in a dynamic cache made from the pruned model's "
                         "config (the default); a static cache, or one built without the config, is not supported")
    return slots


def mean_state(cache, layer_idx: int) -> RunningMean | None:
    """The running sums of a layer with no K/V in `cache` (None without a cache): its own slot, made on first use in
    place of the empty one."""
    if cache is None:
        return None
    slots = dynamic_slots(cache, layer_idx)
    if not isinstance(slots[layer_idx], RunningMean):
        if not isinstance(slots[layer_idx], DummyLayer):
            raise ValueError(f"layer {layer_idx} has a K/V slot in this cache, so its running mean has no place: "
                             "build the cache from the pruned model's config, and keep at least one layer that is "
                             "not mean-bypassed (transformers needs one ordinary slot)")
        slots[layer_idx] = RunningMean()
    return slots[layer_idx]


def carried_mean_state(cache, layer_idx: int, q_len: int) -> RunningMean | None:
    """The running sums of a layer that keeps heads, carried by its K/V slot in `cache` (None without a cache). On
    first use the slot, just updated with the current `q_len` tokens, must hold no earlier ones: their sums would be
    missing."""
    if cache is None:
        return None
    slot = dynamic_slots(cache, layer_idx)[layer_idx]  # the kept heads' attention has just written it
    if isinstance(slot, WithRunningMean):
        return slot.running
    if type(slot) not in WITH_MEAN:
        raise ValueError(f"layer {layer_idx} keeps heads and mean-bypasses the others, so its K/V slot also "
                         f"holds running sums; a {type(slot).__name__} cannot: use the default dynamic cache")
    if slot.get_seq_length() != q_len:
        raise ValueError(f"layer {layer_idx}'s K/V slot holds {slot.get_seq_length() - q_len} earlier tokens but "
                         "not the running sums of its mean-bypassed heads (a cache rebuilt from keys and values "
                         "only?): decode with the cache the model's own forward returned")
    carrier = object.__new__(WITH_MEAN[type(slot)])  # the same K/V state; the cache reads its slots by index
    carrier.__dict__.update(vars(slot), running=RunningMean())
    cache.layers[layer_idx] = carrier
    return carrier.running
