"""LRP relevance of every attention head (layer, query head): gradient × input through an LRP backward.

Relevance is gradient × input after the backward pass has been made to follow LRP rules, as in CP-LRP (Ali et al.
2022, "XAI for Transformers: Better Explanations through Conservative Propagation", ICML) and AttnLRP (Achtibat
et al. 2024, "AttnLRP: Attention-Aware Layer-Wise Relevance Propagation for Transformers", ICML). Each rule is a
value-preserving gradient override: the forward value y stays bit-identical and the backward is that of a surrogate
s, i.e. y.detach() + s − s.detach(), implemented exactly (no rounding of the value) by `override_gradient`.

1. Attention probabilities are constants in the backward (CP-LRP): relevance reaches the values V only, none goes
   through Q or K. `lrp_attention_forward` is transformers' eager attention (repeat_kv, scaling, soft-capping,
   additive mask incl. sliding window, fp32 softmax, dropout) with `probs.detach()`; it is registered under
   `LRP_ATTENTION` with `AttentionInterface` and, with transformers' eager mask, with `AttentionMaskInterface`.
2. Norms (`Adapter.norm_modules`, every RMSNorm: input/post-attention norms, Gemma's pre/post-feedforward
   and q/k norms, the final norm): the normalising factor rsqrt(mean x² + eps) is a constant (the LN-rule of Ali et
   al. and AttnLRP's identity rule for normalisation), so the gradient is out / x elementwise; this holds for
   Gemma's (1 + w) scale as well.
3. Element-wise MLP activations (`mlp.act_fn`: SiLU, gelu_tanh): AttnLRP's identity rule, gradient f(x) / x, so
   relevance passes unchanged.
4. The gated product act(gate(x)) · up(x): AttnLRP's uniform rule, half the relevance to each factor (the gradient
   entering `down_proj` is halved).
5. Everything else (linear layers, residual adds, embeddings, LM head) keeps its plain gradient: gradient × input is
   LRP-0, the ε-rule with ε → 0, conservative for bias-free linear layers (biases absorb their share). Gemma-2's
   final logit soft-capping c·tanh(l / c) follows the identity rule (the LM head's output gradient is pre-scaled so
   that the tanh's backward yields c·tanh(l / c) / l); logits with |l / c| ≳ 9 saturate tanh in fp32 and pass none.

The target is `target_logits`: the summed logit of each observed next token. Logits, not log-probabilities: LRP's
conservation needs a positively homogeneous output, and log-softmax is not (it subtracts a log-sum-exp of all logits).
A head's relevance is the signed Σ over positions and its head_dim columns of x · ∂target/∂x at its `o_proj` input.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import repeat_kv

from ..eval.perplexity import check_windows
from ..model.adapter import Adapter, get_adapter
from ..model.weights import only_trainable

LRP_ATTENTION = "harp_lrp"  # no "sdpa"/"flash"/"flex" in the name: transformers dispatches on those substrings


class _GradientOverride(torch.autograd.Function):
    """Forward: `value`, untouched. Backward: the incoming gradient goes to `surrogate` (and none to `value`)."""

    @staticmethod
    def forward(ctx, value: torch.Tensor, surrogate: torch.Tensor) -> torch.Tensor:
        return value.view_as(value)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        return None, grad


def override_gradient(value: torch.Tensor, surrogate: torch.Tensor) -> torch.Tensor:
    """`value` in the forward, `surrogate`'s backward: y.detach() + s − s.detach() without its rounding.

    Args:
        value: the tensor the forward pass keeps, any shape.
        surrogate: a tensor of the same shape whose graph receives the gradient.
    """
    return _GradientOverride.apply(value, surrogate)


def lrp_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    dropout: float = 0.0,
    scaling: float | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Transformers' eager attention (Gemma's version: with soft-capping) with constant probabilities (rule 1).

    Args:
        query: [B, H, T, hd]; key, value: [B, KV, S, hd]; attention_mask: additive [B, 1, T, S] or None.
    Returns:
        (attention output [B, T, H, hd], attention probabilities [B, H, T, S]).
    """
    scaling = module.head_dim**-0.5 if scaling is None else scaling
    keys = repeat_kv(key, module.num_key_value_groups)
    values = repeat_kv(value, module.num_key_value_groups)
    scores = torch.matmul(query, keys.transpose(2, 3)) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None:
        scores = scores + attention_mask
    probs = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    probs = nn.functional.dropout(probs, p=dropout, training=module.training)
    out = torch.matmul(probs.detach(), values)  # CP-LRP: A is a constant, relevance flows through V only
    return out.transpose(1, 2).contiguous(), probs


AttentionInterface.register(LRP_ATTENTION, lrp_attention_forward)
AttentionMaskInterface.register(LRP_ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["eager"])  # additive float masks


# ---------------------------------------------------------------------------------------------- the rules as hooks
def _first_input(args: tuple, kwargs: dict) -> torch.Tensor:
    return args[0] if args else next(iter(kwargs.values()))


def identity_rule(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`out` with the gradient out / x elementwise (0 where x = 0): relevance x · ∂/∂x equals out · ∂/∂out.

    Args:
        x: the element-wise (or constant-scaled) map's input; out: its output, same shape.
    """
    with torch.no_grad():
        ratio = torch.where(x != 0, out / x, torch.zeros_like(out))
    return override_gradient(out, x * ratio)


def _identity_hook(module: nn.Module, args: tuple, kwargs: dict, out: torch.Tensor) -> torch.Tensor:
    return identity_rule(_first_input(args, kwargs), out)


def _half_gradient_hook(module: nn.Module, args: tuple) -> tuple:
    z = args[0]  # act(gate(x)) · up(x): the uniform rule gives each factor half its relevance
    return (override_gradient(z, 0.5 * z),) + args[1:]


def softcap_identity_hook(cap: float):
    """A forward hook for the LM head whose logits l go through cap · tanh(l / cap) next: it pre-scales their
    gradient by (cap · tanh(l / cap) / l) / (1 − tanh²(l / cap)), so that after the tanh's backward the gradient
    at l is cap · tanh(l / cap) / l (identity rule)."""

    def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            t = torch.tanh(out / cap)
            slope = 1 - t * t
            ratio = torch.where(out != 0, cap * t / out, torch.ones_like(out))
            scale = torch.where(slope > 0, ratio / slope, torch.zeros_like(out))
        return override_gradient(out, out * scale)

    return hook


@contextmanager
def _attention_implementation(model: nn.Module, name: str) -> Iterator[None]:
    original = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(original)


@contextmanager
def _replaced_activation(mlp: nn.Module) -> Iterator[None]:
    """A plain-function `act_fn` cannot carry hooks: wrap it in the identity rule while the context lasts."""
    act = mlp.act_fn
    mlp.act_fn = lambda x: identity_rule(x, act(x))
    try:
        yield
    finally:
        mlp.act_fn = act


def _install_mlp_rules(mlp: nn.Module, stack: ExitStack) -> None:
    act = getattr(mlp, "act_fn", None)
    if isinstance(act, nn.Module):
        stack.callback(act.register_forward_hook(_identity_hook, with_kwargs=True).remove)
    elif callable(act):
        stack.enter_context(_replaced_activation(mlp))
    down = getattr(mlp, "down_proj", None)
    if isinstance(down, nn.Module):
        stack.callback(down.register_forward_pre_hook(_half_gradient_hook).remove)


@contextmanager
def lrp_rules(model: nn.Module) -> Iterator[None]:
    """Make the model's backward follow the LRP rules of the module docstring; the forward is unchanged (equal to
    eager attention's). On exit, even after an error, the model has its attention implementation back and no hooks.
    """
    adapter = get_adapter(model)
    with ExitStack() as stack:
        stack.enter_context(_attention_implementation(model, LRP_ATTENTION))
        for module in adapter.norm_modules():
            stack.callback(module.register_forward_hook(_identity_hook, with_kwargs=True).remove)
        for i in range(adapter.n_layers):
            _install_mlp_rules(adapter.mlp(i), stack)
        cap = adapter.logit_softcap
        if cap:
            stack.callback(model.get_output_embeddings().register_forward_hook(softcap_identity_hook(cap)).remove)
        yield


def target_logits(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """What is explained: per window, Σ over t < T − 1 of the logit of the observed next token ids[:, t + 1].

    Args:
        logits: [B, T, vocab]; ids: [B, T].
    Returns:
        [B]
    """
    return logits[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1).sum(-1)


# ---------------------------------------------------------------------------------------------- relevance
@dataclass
class Relevance:
    """LRP relevance of a batch of windows (float64, signed). NaN rows: layers whose attention is not dense.

    target: [B] the explained value; embeddings: [B] at the embedding output (= target when conservative);
    heads: [B, L, H] at each head's o_proj input columns; attention: [B, L] at each o_proj output.
    """

    target: torch.Tensor
    embeddings: torch.Tensor
    heads: torch.Tensor
    attention: torch.Tensor


@contextmanager
def _frozen(model: nn.Module) -> Iterator[None]:
    """Eval mode and no parameter gradients while the context lasts; mode and flags restored after."""
    was_training = model.training
    model.eval()
    try:
        with only_trainable(model):
            yield
    finally:
        model.train(was_training)


@contextmanager
def _recording(model: nn.Module, adapter: Adapter) -> Iterator[dict]:
    """Keep (with gradients) the embedding output and each dense layer's o_proj input and output."""
    store: dict = {}

    def keep_embedding(module, args, out):
        store["embeddings"] = out.detach().requires_grad_()  # a leaf: parameters take no gradient
        return store["embeddings"]

    def keep_o_proj(i):
        def hook(module, args, out):
            args[0].retain_grad()
            out.retain_grad()
            store[i] = (args[0], out)

        return hook

    embed = model.get_input_embeddings()
    with ExitStack() as stack:
        stack.callback(embed.register_forward_hook(keep_embedding).remove)
        for i in range(adapter.n_layers):
            if adapter.attention_is_dense(i):
                stack.callback(adapter.attention(i).o_proj.register_forward_hook(keep_o_proj(i)).remove)
        yield store


def _x_grad(x: torch.Tensor) -> torch.Tensor:
    return x.detach().double() * x.grad.double()


def _collect(store: dict, adapter: Adapter, target: torch.Tensor) -> Relevance:
    batch, L, H = target.shape[0], adapter.n_layers, adapter.n_heads
    heads = torch.full((batch, L, H), float("nan"), dtype=torch.float64, device="cpu")
    attention = torch.full((batch, L), float("nan"), dtype=torch.float64, device="cpu")
    for i in range(L):
        if i in store:
            x, out = store[i]
            heads[:, i] = _x_grad(x).unflatten(-1, (H, adapter.head_dim)).sum((1, 3)).cpu()
            attention[:, i] = _x_grad(out).sum((1, 2)).cpu()
    embeddings = _x_grad(store["embeddings"]).sum((1, 2)).cpu()
    return Relevance(target.detach().double().cpu(), embeddings, heads, attention)


def lrp_relevance(model: nn.Module, ids: torch.Tensor) -> Relevance:
    """LRP relevance of one batch at the embeddings, each head and each attention output (see module docstring).

    Args:
        ids: LongTensor [B, T] on the model's device.
    Returns:
        `Relevance`; the model is left as it was (mode, requires_grad flags, attention backend, no hooks, no grads).
    """
    check_windows(model, ids)
    adapter = get_adapter(model)
    with _frozen(model), lrp_rules(model), _recording(model, adapter) as store, torch.enable_grad():
        target = target_logits(model(input_ids=ids, use_cache=False).logits, ids)
        target.sum().backward()
        return _collect(store, adapter, target)


def lrp_head_scores(model: nn.Module, windows: torch.Tensor, batch_size: int = 1, progress: bool = True
                    ) -> torch.Tensor:
    """Mean over windows of |R[layer, head]|, each head's LRP relevance for the window's next-token logits.

    Args:
        windows: LongTensor [n, T].
        batch_size: windows per forward/backward pass.
    Returns:
        float64 [n_layers, n_heads] on the CPU; NaN rows for layers whose attention is not dense.
    """
    check_windows(model, windows)
    adapter = get_adapter(model)
    device = next(model.parameters()).device
    total = torch.zeros(adapter.n_layers, adapter.n_heads, dtype=torch.float64, device="cpu")
    for start in tqdm(range(0, len(windows), batch_size), desc="LRP", leave=False, disable=not progress):
        total += lrp_relevance(model, windows[start : start + batch_size].to(device)).heads.abs().sum(0)
    return total / len(windows)
