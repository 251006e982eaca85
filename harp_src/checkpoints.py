"""Pruned models as ordinary checkpoints: `save_checkpoint` writes one that loads with `load_model(dir)` or with
`AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)` where this repository is not installed.

What goes into a checkpoint, and how it is rebuilt, lives in `modeling_harp` (the file the checkpoint carries).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings
from pathlib import Path

import torch
from torch import nn

from .modeling_harp import CLASSES, mark_pruned


def has_plan(model: nn.Module) -> bool:
    """Whether `model` was pruned here (a HARP plan or a baseline's record is on it)."""
    return getattr(model, "harp_plan", None) is not None or getattr(model, "prune_record", None) is not None


def save_checkpoint(model: nn.Module, directory: str | os.PathLike, tokenizer=None) -> dict:
    """Write `model` (and its tokenizer) as a checkpoint in `directory`, replacing what was there only once the new
    one is complete. A pruned model keeps only the weights that exist, its plan and structure in config.json and
    the modeling file; a model with no plan is saved as an ordinary dense checkpoint, with a warning.

    Args:
        model: a causal LM, typically after `apply_harp` or `baselines.prune`.
        directory: the checkpoint folder.
        tokenizer: saved beside the weights (default: the one `load_model` attached to the model, if any).
    Returns:
        dict: directory, pruned (bool), weights_bytes (the safetensors files' size).
    """
    directory = Path(directory)
    pruned = has_plan(model)
    if pruned and not mark_pruned(model):
        raise ValueError(f"a pruned {type(model).__name__} cannot be saved as a checkpoint yet: pruned-checkpoint "
                         f"classes exist for {sorted(c.__bases__[1].__name__ for c in CLASSES.values())}")
    if not pruned:
        warnings.warn("this model has no HARP plan or baseline record: saving an ordinary dense checkpoint",
                      stacklevel=2)
    tokenizer = tokenizer if tokenizer is not None else getattr(model, "harp_tokenizer", None)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    tmp.chmod(0o777 & ~_umask())  # mkdtemp makes it private; a checkpoint is meant to be shared
    try:
        model.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if directory.exists():
            shutil.rmtree(directory)
        tmp.rename(directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"directory": str(directory), "pruned": pruned, "weights_bytes": weights_bytes(directory)}


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def weights_bytes(directory: str | os.PathLike) -> int:
    """Bytes of a checkpoint's weight files (*.safetensors)."""
    return sum(f.stat().st_size for f in Path(directory).glob("*.safetensors"))


def tensor_bytes(model: nn.Module) -> int:
    """Bytes of a model's distinct weight tensors (tied ones counted once), what its checkpoint stores."""
    seen, total = set(), 0
    for t in model.state_dict().values():
        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.numel() * t.element_size()
    return total
