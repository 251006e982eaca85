"""Budgets in parameters: HARP's two (its own and the release scripts'), what each method can remove at most, and how
a uniform ratio turns a budget into heads and channels per layer."""

from __future__ import annotations

from torch import nn

from ..method.accounting import param_report
from ..method.harp import HarpPlan
from ..model.adapter import Adapter, get_adapter
from ..model.weights import n_params
from .record import linears
from .slicing import Units, units


# ---------------------------------------------------------------------------------------------- budgets
def budgets(model_or_config, plan: HarpPlan) -> dict[str, int]:
    """The two budgets of a HARP plan (parameters of nn.Linear weights, the paper's convention).

    "harp": what HARP itself removes, N·(Q + K) + #{α = 0}·(V + O).
    "release": all attention weights of the plan's layers, what the authors' release scripts fill with FLAP.
    """
    release = HarpPlan(plan.fingerprint, {i: 0.0 for i in plan.layers}, plan.fold)
    return {"harp": param_report(model_or_config, plan)["removed_paper"],
            "release": param_report(model_or_config, release)["removed_paper"]}


def llm_pruner_layers(n_layers: int) -> list[int]:
    """LLM-Pruner's default layer range (4..29 of Llama-7B's 32), scaled to `n_layers`."""
    return list(range(round(4 / 32 * n_layers), n_layers - round(2 / 32 * n_layers)))


def scoped_layers(method: str, n_layers: int) -> list[int]:
    return llm_pruner_layers(n_layers) if method == "llm-pruner" else list(range(n_layers))


def attention_params(ad: Adapter, i: int) -> int:
    return n_params(ad.attention(i)) + sum(n_params(n) for n in ad.attention_norms(i))


def block_params(ad: Adapter, i: int) -> int:
    return n_params(ad.layers[i])


def capacity(model: nn.Module, method: str, scope: str) -> int:
    """The most parameters `method` can remove from `model` (weights it can zero, for wanda)."""
    ad = get_adapter(model)
    if method == "shortgpt":
        return sum(block_params(ad, i) for i in range(ad.n_layers))
    if method.startswith("attn-drop"):
        return sum(attention_params(ad, i) for i in range(ad.n_layers))
    if method == "wanda":
        return sum(lin.weight.numel() for i in range(ad.n_layers) for lin in linears(ad, i).values())
    u = units(ad)
    per_layer = u.n_channels * u.channel_params + (u.n_heads * u.head_params if scope == "heads+mlp" else 0)
    return len(scoped_layers(method, ad.n_layers)) * per_layer


def uniform_counts(u: Units, layers: list[int], budget: int, heads: bool) -> tuple[int, dict[int, int]]:
    """(attention units removed in every layer, {layer: MLP channels removed}) for ≈ `budget` parameters at one
    ratio in every layer: the head count is the ratio rounded (never over budget), channels fill the rest to
    within one channel."""
    n = len(layers)
    per_layer = u.n_channels * u.channel_params + (u.n_heads * u.head_params if heads else 0)
    h = min(round(budget / (n * per_layer) * u.n_heads), u.n_heads) if heads else 0
    while h and n * h * u.head_params > budget:
        h -= 1
    total = min(round((budget - n * h * u.head_params) / u.channel_params), n * u.n_channels)
    base, extra = divmod(total, n)
    return h, {layer: base + (k < extra) for k, layer in enumerate(layers)}


def closest_count(budget: int, each: int, most: int) -> int:
    return int(min(max(1, round(budget / each)), most))
