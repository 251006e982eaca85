"""A gate per attention head at the o_proj input, and Michel et al.'s Taylor masking confidence from its gradient."""

from __future__ import annotations

import torch
from tqdm.auto import tqdm

from ..eval.perplexity import check_windows
from ..model.adapter import get_adapter
from ..model.nll import next_token_nll
from ..model.weights import only_trainable
from .removal import check_heads


def _dtype(model) -> torch.dtype:
    return torch.promote_types(next(model.parameters()).dtype, torch.float32)


class HeadGates:
    """Gates [n_layers, n_heads] at every dense layer's o_proj input; use as a context manager or call `remove()`.

    Args:
        model: a causal LM of a supported family.
        requires_grad: make the gates a leaf tensor with gradients (for Taylor scores).
    """

    def __init__(self, model, requires_grad: bool = False):
        self.adapter = ad = get_adapter(model)
        device = next(model.parameters()).device
        self.values = torch.ones(ad.n_layers, ad.n_heads, dtype=_dtype(model), device=device,
                                 requires_grad=requires_grad)
        self.handles = [ad.attention(i).o_proj.register_forward_pre_hook(self._hook(i))
                        for i in range(ad.n_layers) if ad.attention_is_dense(i)]

    def _hook(self, i: int):
        hd = self.adapter.head_dim

        def hook(module, args):
            x = args[0]
            gated = x.unflatten(-1, (-1, hd)) * self.values[i][:, None].to(x.dtype)
            return (gated.flatten(-2),) + args[1:]
        return hook

    def close_heads(self, heads: dict[int, list[int]]) -> HeadGates:
        """Set the gates of `heads` ({layer: [head, ...]}) to 0, all others to 1."""
        heads = check_heads(self.adapter, heads)
        with torch.no_grad():
            self.values.fill_(1.0)
            for layer, hs in heads.items():
                self.values[layer, hs] = 0.0
        return self

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def __enter__(self) -> HeadGates:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def window_loss(model, ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (fp32) of each window [B, T] → [B]."""
    nll = next_token_nll(model(input_ids=ids, use_cache=False).logits, ids)
    return nll.view(ids.shape[0], -1).mean(-1)


def gate_gradients(model, windows: torch.Tensor, progress: bool = True) -> torch.Tensor:
    """∂L(x)/∂ξ at ξ = 1 for every window x (L = its mean token NLL): [n_windows, n_layers, n_heads], signed."""
    check_windows(model, windows)
    device = next(model.parameters()).device
    grads = []
    with only_trainable(model), HeadGates(model, requires_grad=True) as gates, torch.enable_grad():
        for x in tqdm(windows, desc="Taylor scores", leave=False, disable=not progress):  # only the gates learn
            gates.values.grad = None
            window_loss(model, x[None].to(device)).sum().backward()
            grads.append(gates.values.grad.detach().cpu().clone())
    return torch.stack(grads)


def taylor_head_scores(model, windows: torch.Tensor, normalise: bool = True, progress: bool = True
                       ) -> torch.Tensor:
    """Masking confidence E_x |∂L(x)/∂ξ_h| [n_layers, n_heads]; with `normalise`, each layer divided by its L2 norm."""
    scores = gate_gradients(model, windows, progress).abs().mean(0).double()
    return per_layer_l2(scores) if normalise else scores


def per_layer_l2(scores: torch.Tensor) -> torch.Tensor:
    """Each layer's row of head scores [n_layers, n_heads] divided by its L2 norm (Michel et al.'s normalisation)."""
    return scores / scores.norm(dim=1, keepdim=True).clamp_min(1e-30)
