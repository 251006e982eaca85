"""The baseline methods by name: their scopes, which need calibration data, and the request every pruner takes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

FINE = ("mag-sp", "wanda-sp", "flap", "llm-pruner")
SCOPES: dict[str, tuple[str, ...]] = {
    **{m: ("heads+mlp", "mlp") for m in FINE},
    "shortgpt": ("blocks",),
    "attn-drop-top": ("attention",),
    "attn-drop-sim": ("attention",),
    "wanda": ("linear",),
}
METHODS = tuple(SCOPES)
DATA_FREE = ("mag-sp", "attn-drop-top")


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
