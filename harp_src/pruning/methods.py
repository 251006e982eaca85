"""The baseline methods by name: their scopes, which need calibration data, and the request every pruner takes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

FINE = ("mag-sp", "wanda-sp", "flap", "llm-pruner")
# "heads+mlp" only where heads and channels compete in one global ranking (FLAP's rule, LLM-Pruner's global mode):
# the uniform-ratio methods round their head share to zero at these budgets, so their heads+mlp was their mlp (27).
SCOPES: dict[str, tuple[str, ...]] = {
    "mag-sp": ("mlp",),
    "wanda-sp": ("mlp",),
    "flap": ("heads+mlp", "mlp"),
    "llm-pruner": ("heads+mlp", "mlp"),
    "shortgpt": ("blocks",),
    "attn-drop-top": ("attention",),
    "attn-drop-sim": ("attention",),
    "wanda": ("linear",),
}
METHODS = tuple(SCOPES)
DATA_FREE = ("mag-sp", "attn-drop-top")
SEQUENTIAL = ("wanda", "wanda-sp")  # prune layer i before calibrating layer i+1: their scoring changes the model
UNSTRUCTURED = ("wanda",)  # zeroes weights in dense shapes: removes no parameter, so it is a contrast, never "best"


@dataclass(frozen=True)
class PruneRequest:
    """What `prune` asks of a pruner, already checked: the method, its scope, the budget in parameters, the
    calibration windows [n, T] (None for data-free methods), and how to run the calibration passes."""

    method: str
    scope: str
    budget: int
    windows: torch.Tensor | None
    batch_size: int = 2
    progress: bool = True

    @property
    def heads(self) -> bool:
        """Whether attention units are pruned too (scope "heads+mlp")."""
        return self.scope == "heads+mlp"


# What a pruner returns: the record entries per layer, and whether they are already applied to the model (the
# layer-sequential methods prune each layer before calibrating the next).
Entries = tuple[dict[int, dict], bool]
