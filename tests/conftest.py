"""Tiny randomly initialised models of every supported family (built in code, no downloads)."""

import time

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
)

SEED = 0
SESSION_START = time.time()  # conftest loads before any test or notebook runs (see test_notebooks.py)
COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
              max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def tiny_configs() -> dict:
    return {
        "llama": LlamaConfig(**COMMON, num_attention_heads=4, num_key_value_heads=2),
        "mistral": MistralConfig(**COMMON, num_attention_heads=4, num_key_value_heads=1, sliding_window=None),
        "qwen2": Qwen2Config(**COMMON, num_attention_heads=4, num_key_value_heads=2),
        "gemma2": Gemma2Config(**COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                               sliding_window=8, query_pre_attn_scalar=16),
        "gemma3": Gemma3TextConfig(**COMMON, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                                   sliding_window=8, query_pre_attn_scalar=16,
                                   layer_types=["sliding_attention", "full_attention"] * 2),
    }


FAMILIES = list(tiny_configs())
NO_SDPA = {"gemma2"}  # transformers has no sdpa path for Gemma-2 (soft-capping): it runs eager


def make_tiny(family: str, attn: str = "sdpa", seed: int = SEED):
    """A fresh tiny model; the same seed gives the same weights, so two copies can be compared."""
    torch.manual_seed(seed)
    attn = "eager" if family in NO_SDPA else attn
    config = tiny_configs()[family]
    config._attn_implementation = attn
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn).eval()
    with torch.no_grad():  # random norm weights so Gemma's (1 + w) and α folding are really exercised
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(-0.5, 0.5) if "gemma" in family else p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
    return model


@pytest.fixture(params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture
def ids():
    g = torch.Generator().manual_seed(SEED)
    return torch.randint(3, 128, (2, 12), generator=g)
