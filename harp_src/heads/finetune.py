"""Short LoRA recovery fine-tuning after pruning, as LLM-Pruner does, via `peft`; merged back into the weights.

o_proj is never wrapped: head pruning gates o_proj's input in a forward pre-hook, and a LoRA branch on o_proj would
read the un-gated input and bring the removed heads back.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import asdict, dataclass

import torch
from peft import LoraConfig, get_peft_model
from torch import nn
from tqdm.auto import tqdm

from ..eval.perplexity import check_windows
from ..model.nll import next_token_nll
from ..model.weights import n_params

TARGETS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "down_proj")  # never o_proj: see the docstring


@dataclass(frozen=True)
class FinetuneSpec:
    """One LoRA recovery fine-tune: optimiser steps, AdamW learning rate, adapter shape and sampling seed."""

    steps: int
    lr: float = 1e-4
    rank: int = 8
    alpha: int = 16
    dropout: float = 0.0
    batch_size: int = 1
    seed: int = 0
    targets: tuple[str, ...] = TARGETS

    def to_dict(self) -> dict:
        return {**asdict(self), "targets": list(self.targets)}

    def checked(self) -> FinetuneSpec:
        """This spec, after the checks lora_finetune makes (one clear error for a bad value)."""
        _check_spec(self)
        return self


def check_steps(steps, needed: bool = True) -> int:
    """Refuse a step count that is not an int, is negative, or is 0 where fine-tuning is needed.

    Returns:
        `steps` unchanged.
    """
    if isinstance(steps, bool) or not isinstance(steps, int):
        raise ValueError(f"fine-tuning steps must be an int, got {steps!r}: set FT_STEPS to a whole number")
    if steps < 0 or (needed and steps == 0):
        raise ValueError(f"fine-tuning with {steps} steps is not possible: set FT_STEPS >= 1 or use the one-shot "
                         "schedule")
    return steps


def _check_spec(spec: FinetuneSpec) -> None:
    check_steps(spec.steps)
    for name in ("rank", "alpha", "batch_size"):
        value = getattr(spec, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"FinetuneSpec.{name} must be a positive int, got {value!r}")
    if not spec.lr > 0 or not 0 <= spec.dropout < 1:
        raise ValueError(f"FinetuneSpec needs lr > 0 and 0 <= dropout < 1, got lr={spec.lr!r}, "
                         f"dropout={spec.dropout!r}")
    if not spec.targets or "o_proj" in spec.targets:
        raise ValueError(f"FinetuneSpec.targets must be non-empty and leave o_proj out (its input is gated by head "
                         f"pruning), got {spec.targets!r}")


def target_modules(model: nn.Module, targets: tuple[str, ...]) -> list[str]:
    """Full names of the nn.Linear modules whose last name component is in `targets`.

    Layers whose attention was replaced (a HARP bypass has no q_proj/k_proj) simply contribute fewer names; a module
    of a target's name that is not an nn.Linear is skipped rather than handed to peft, which would refuse it.
    """
    return [name for name, m in model.named_modules()
            if name.rpartition(".")[2] in targets and isinstance(m, nn.Linear)]


def _structure(model: nn.Module) -> list[tuple[str, str]]:
    return [(name, type(m).__name__) for name, m in model.named_modules()]


def _window_order(n_windows: int, count: int, seed: int) -> torch.Tensor:
    """`count` window indices: seeded permutations of range(n_windows), one after another (a local RNG)."""
    g = torch.Generator().manual_seed(seed)
    reps = -(-count // n_windows)
    return torch.cat([torch.randperm(n_windows, generator=g, device="cpu") for _ in range(reps)])[:count]


def next_token_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (fp32) of ids [B, T] under `model`, every position after the first predicted."""
    return next_token_nll(model(input_ids=ids, use_cache=False).logits, ids, "mean")


def _rng_devices(device: torch.device) -> list[int]:
    """The CUDA devices whose RNG the fine-tune may touch (dropout), so fork_rng restores just those."""
    if device.type != "cuda":
        return []
    return [device.index if device.index is not None else torch.cuda.current_device()]


def _wrap(model: nn.Module, config: LoraConfig) -> nn.Module:
    """peft's get_peft_model, without the FutureWarning it triggers in transformers 5 (peft asks the model
    `is_gradient_checkpointing`, deprecated there)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        return get_peft_model(model, config)


def _train(peft_model: nn.Module, windows: torch.Tensor, spec: FinetuneSpec, progress: bool) -> list[float]:
    """AdamW over the trainable (LoRA) parameters for `spec.steps` steps; returns the per-step training losses."""
    params = [p for p in peft_model.parameters() if p.requires_grad]
    optimiser = torch.optim.AdamW(params, lr=spec.lr)
    device = next(peft_model.parameters()).device
    order = _window_order(len(windows), spec.steps * spec.batch_size, spec.seed).view(spec.steps, spec.batch_size)
    losses = []
    peft_model.train()
    bar = tqdm(order, desc="lora fine-tune", leave=False, disable=not progress)
    for batch in bar:
        loss = next_token_loss(peft_model, windows[batch].to(device))
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        optimiser.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    return losses


def _restore(model: nn.Module, requires_grad: dict[str, bool], pretraining_tp) -> None:
    """Put back what peft changed on the base model: requires_grad flags, no grads, config.pretraining_tp; eval mode."""
    for name, p in model.named_parameters():
        p.requires_grad_(requires_grad[name])
        p.grad = None
    if pretraining_tp is not None:  # PeftModel sets it to 1 (peft_model.py)
        model.config.pretraining_tp = pretraining_tp
    model.eval()


def lora_finetune(model: nn.Module, windows: torch.Tensor, spec: FinetuneSpec, progress: bool = True) -> dict:
    """Fine-tune `model` in place with LoRA adapters on `spec.targets`, then merge them into its weights.

    Afterwards `model` is the same object, of the same class and module structure, with the same parameters (count and
    names), in eval mode, requires_grad flags as before and no grads; hooks and attributes the caller set on it or on
    its o_proj modules are kept (o_proj is never wrapped, and peft restores the original Linear objects on merging).
    The global RNG state is left as it was.

    Args:
        model: a causal LM (a copy: it is changed); its parameters must be float.
        windows: LongTensor [n, T] of training windows; each step takes `spec.batch_size` of them, seeded
            permutations one after another.
        spec: steps, learning rate, adapter rank / alpha / dropout, batch size, seed and target module names.
        progress: show a tqdm bar with the running loss.
    Returns:
        {"steps", "lr", "rank", "alpha", "trainable_params", "losses" (per step), "seconds", "targets" (the target
        names found), "modules" (how many Linear modules were adapted)}.
    """
    _check_spec(spec)
    check_windows(model, windows)
    names = target_modules(model, spec.targets)
    if not names:
        raise ValueError(f"the model has no nn.Linear named any of {spec.targets}: nothing to fine-tune")
    # all checks passed: from here on the model changes
    structure, count = _structure(model), n_params(model)
    requires_grad = {name: p.requires_grad for name, p in model.named_parameters()}
    pretraining_tp = getattr(model.config, "pretraining_tp", None)
    config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout, target_modules=names,
                        bias="none", task_type="CAUSAL_LM")
    start = time.perf_counter()
    with torch.random.fork_rng(devices=_rng_devices(next(model.parameters()).device)):
        torch.manual_seed(spec.seed)  # the adapters' initialisation (lora_A) and dropout
        peft_model = _wrap(model, config)
        trainable = n_params(peft_model, trainable=True)
        try:
            losses = _train(peft_model, windows, spec, progress)
        except BaseException:  # a failed step (a bad token id, out of memory, Ctrl-C): give the model back untouched
            peft_model.unload()
            _restore(model, requires_grad, pretraining_tp)
            raise
    merged = peft_model.merge_and_unload()
    _restore(model, requires_grad, pretraining_tp)
    if merged is not model or _structure(model) != structure or n_params(model) != count:
        raise RuntimeError("peft's merge_and_unload did not give back the model it was given, with its structure")
    found = {name.rpartition(".")[2] for name in names}
    return {"steps": spec.steps, "lr": spec.lr, "rank": spec.rank, "alpha": spec.alpha, "trainable_params": trainable,
            "losses": losses, "seconds": time.perf_counter() - start,
            "targets": [t for t in spec.targets if t in found], "modules": len(names)}
