"""The paper's own setting, from public numbers: the Llama-3.1-8B config, the official code's α list, reported results.

Used where a config-only comparison with the paper is made (FLOP bounds, the parameter ratio); see
../shared/DESIGN.md §5.
"""

from __future__ import annotations

from transformers import LlamaConfig

# the public Llama-3.1-8B shapes (no weights needed for FLOP and parameter counts)
LLAMA31_8B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                  intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False)
# the official code's Llama-3.1-8B top-8 list, top layer first (DESIGN.md §5)
OFFICIAL_LLAMA31_8B_TOP_FIRST = (0.8, 0.2, 0.1, 0.1, 0.0, 0.1, 0.0, 0.0)
PAPER_LLAMA31_8B = {"speedup_64k": 1.167, "param_ratio": 0.033}  # the paper's reported numbers
PAPER_CONTEXT = 65536  # the paper's long-context timing length ("64k")


def paper_numbers() -> list[float]:
    """The paper's setting and reported results as plain numbers (shapes, α's, speed-up, its 64k length): facts a
    conclusion may quote beside this study's results."""
    return [float(v) for v in (*LLAMA31_8B.values(), *OFFICIAL_LLAMA31_8B_TOP_FIRST, *PAPER_LLAMA31_8B.values(),
                               PAPER_CONTEXT) if not isinstance(v, bool)]


def llama31_8b_config() -> LlamaConfig:
    """A fresh LlamaConfig with Llama-3.1-8B's shapes."""
    return LlamaConfig(**LLAMA31_8B)


def official_llama31_8b_alphas() -> dict[int, float]:
    """The official top-8 α's as {0-based layer: α} (the list is top-first: layer 31 gets its first entry)."""
    last = LLAMA31_8B["num_hidden_layers"] - 1
    return {last - k: a for k, a in enumerate(OFFICIAL_LLAMA31_8B_TOP_FIRST)}


# The paper's four Hub models (public configs): layers and parameter counts, so that a graph of steps on them can be
# declared and its cost predicted (`runner --plan --profile paper`) where the Hub is unreachable and no weights are.
PAPER_MODELS = {
    "meta-llama/Llama-3.1-8B": {"num_layers": 32, "params": 8_030_261_248},
    "mistralai/Mistral-7B-v0.3": {"num_layers": 32, "params": 7_248_023_552},
    "Qwen/Qwen2-7B": {"num_layers": 28, "params": 7_615_616_512},
    "google/gemma-2-9b": {"num_layers": 42, "params": 9_241_705_984},
}
