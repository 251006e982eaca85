"""Bytes of K/V tensors a transformers cache holds, per layer and in all (pruned layers hold none)."""

from __future__ import annotations

import torch


def kv_bytes_per_layer(cache) -> list[int]:
    """Bytes of K/V tensors each layer of a transformers cache holds (a pruned layer's DummyLayer: 0)."""
    return [sum(t.numel() * t.element_size() for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
                if isinstance(t, torch.Tensor)) for layer in cache.layers]


def kv_cache_bytes(cache) -> int:
    """Bytes of K/V tensors a transformers cache holds (pruned layers hold none)."""
    return sum(kv_bytes_per_layer(cache))


@torch.no_grad()
def prompt_kv_bytes(model, seq_len: int) -> int:
    """Bytes of the KV cache `model` keeps after one prefill of a (seeded, random) `seq_len`-token prompt."""
    high = min(1000, model.get_input_embeddings().num_embeddings)  # token ids the model has (the bytes do not care)
    ids = torch.randint(3, high, (1, seq_len), generator=torch.Generator().manual_seed(0), device="cpu")
    out = model(input_ids=ids.to(next(model.parameters()).device), use_cache=True)
    return kv_cache_bytes(out.past_key_values)


@torch.no_grad()
def kv_bytes_at(model, seq_len: int, probe: int = 4) -> int:
    """Bytes of K/V a cache holds after a `seq_len`-token prefill, from one `probe`-token prefill: each layer's bytes
    per token times the tokens it keeps: all of them, or in a sliding-window layer the last `sliding_window` − 1 (what
    transformers' dynamic sliding layer keeps between calls). `probe` must fit every window, so each layer holds every
    probe token."""
    high = min(1000, model.get_input_embeddings().num_embeddings)
    ids = torch.randint(3, high, (1, probe), generator=torch.Generator().manual_seed(0))
    cache = model(input_ids=ids.to(next(model.parameters()).device), use_cache=True).past_key_values
    windows = [getattr(layer, "sliding_window", None) for layer in cache.layers]
    windows = [None if w is None else w - 1 for w in windows]
    if any(w is not None and w < probe for w in windows):
        raise ValueError(f"probe={probe} exceeds a sliding window ({min(w for w in windows if w)}): use a shorter one")
    return sum(b // probe * (seq_len if w is None else min(seq_len, w))
               for b, w in zip(kv_bytes_per_layer(cache), windows, strict=True))
