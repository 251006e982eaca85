"""Pruned models as ordinary checkpoints: `save_checkpoint` writes one; `load_model` reads any model, and a pruned
checkpoint only after its plan has been checked against its structure.

What goes into a checkpoint, and how it is rebuilt, lives in `modeling_harp` (the file the checkpoint carries).
Saving never deletes what it did not write: an existing folder is replaced only if it is a checkpoint of this
project holding nothing else, and only when asked (`overwrite`), after the new one is complete, in one step. A save
claims its folder first (`save_claim`): a second save to it, from any process, is refused while the first runs, and
what an interrupted save left beside it is removed by the next save or by `cleanup`.
"""

from __future__ import annotations

import copy
import fnmatch
import json
import os
import shutil
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import transformers
from torch import nn
from transformers import AutoModelForCausalLM

from .method.harp import HarpPlan
from .model.loading import load_pretrained, resolve_source
from .model.modeling_harp import CLASSES, PLAN, STRUCTURE, describe, mark_pruned
from .pruning.record import PruneRecord
from .report.files import (
    ROOT,
    check_writable,
    claimed,
    clean_leftovers,
    partial_dir,
    put_in_place,
    read_json,
    set_default_modes,
)

# The files a checkpoint consists of (model, config, this repository's modeling file, tokenizer); anything else in a
# folder is somebody's, and the folder is never replaced.
CHECKPOINT_FILES = ("config.json", "generation_config.json", "model.safetensors", "model-*-of-*.safetensors",
                    "model.safetensors.index.json", "modeling_harp.py", "modeling_harp_checks.py",
                    "modeling_harp_keep.py", "modeling_harp_mean.py", "tokenizer.json", "tokenizer_config.json",
                    "special_tokens_map.json", "chat_template.jinja", "vocab.json", "merges.txt", "tokenizer.model",
                    "added_tokens.json")
# The registry of plan kinds a checkpoint's config.json can carry (`harp_plan`: {kind: dict}), filled here, where
# checkpoints are loaded, so restoring a plan never depends on which modules happen to have been imported.
PLAN_KINDS: dict[str, type] = {"harp": HarpPlan, "baseline": PruneRecord}


# ---------------------------------------------------------------------------------------------- saving
def has_plan(model: nn.Module) -> bool:
    """Whether `model` was pruned here (a HARP plan or a baseline's record is on it)."""
    return getattr(model, "harp_plan", None) is not None or getattr(model, "prune_record", None) is not None


def foreign_files(directory: Path) -> list[str]:
    """What in `directory` is not a checkpoint file (sub-folders included), sorted."""
    return sorted(p.name + ("/" if p.is_dir() else "") for p in directory.iterdir()
                  if p.is_dir() or not any(fnmatch.fnmatch(p.name, pattern) for pattern in CHECKPOINT_FILES))


def is_checkpoint(directory: Path) -> bool:
    """Whether `directory` holds a checkpoint of this project (its config.json carries a plan)."""
    try:
        config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and PLAN in config


def _protected(target: Path) -> str | None:
    """Why `target` must never be replaced (a folder that holds the user's work), or None."""
    resolved = target.resolve()
    places = {Path("/"): "the file-system root", Path.home().resolve(): "your home directory",
              ROOT: "this repository's root", Path.cwd().resolve(): "the current directory"}
    if resolved in places:
        return places[resolved]
    if Path.cwd().resolve().is_relative_to(resolved) or ROOT.is_relative_to(resolved):
        return "a folder that contains the current directory or this repository"
    return None


def check_save_target(directory: str | os.PathLike, overwrite: bool = False) -> Path:
    """Refuse, before anything is computed or written, a checkpoint folder that would replace somebody's files.

    Accepted: a path that does not exist yet, an empty folder, and (with `overwrite`) a checkpoint of this project
    that holds only checkpoint files.

    Returns:
        The target as an absolute path.
    """
    if not isinstance(overwrite, bool):
        raise ValueError(f"overwrite must be True or False, got {overwrite!r}")
    target = Path(os.path.abspath(os.fspath(directory)))
    why = _protected(target)
    if why is not None:
        raise ValueError(f"refusing to save a checkpoint to {directory}: it is {why}; choose a new folder, "
                         "e.g. ./pruned-model")
    if not target.exists() and not target.is_symlink():
        return target
    if not target.is_dir() or target.is_symlink():
        raise ValueError(f"{directory} exists and is not a folder; choose a new folder for the checkpoint")
    if not any(target.iterdir()):
        return target
    if not is_checkpoint(target):
        raise ValueError(f"{directory} exists and is not a checkpoint of this project; nothing was written. "
                         "Choose a new folder (saving never replaces other files)")
    extra = foreign_files(target)
    if extra:
        raise ValueError(f"{directory} holds a checkpoint but also {extra[0]}, which is not part of it; nothing "
                         "was written. Move those files away or choose a new folder")
    if not overwrite:
        raise ValueError(f"{directory} already holds a checkpoint; nothing was written. Pass --overwrite "
                         "(overwrite=True) to replace it, or choose a new folder")
    return target


@contextmanager
def save_claim(directory: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Claim a checkpoint folder while inside, after checking that it may be written (`check_save_target`) and can
    be (`check_writable`): another save to it, from this or any other process, is refused at once. The CLI holds the
    claim from before its work starts until the checkpoint is in place. Yields the target, absolute."""
    check_save_target(directory, overwrite)
    check_writable(directory, str(directory), folder=True)
    with claimed(directory, str(directory)) as target:
        yield target


def cleanup(directory: str | os.PathLike) -> list[str]:
    """Remove what interrupted saves of `directory` left beside it (hidden `.partial` folders, an old checkpoint set
    aside, which is put back if nothing is at `directory`); refused while a save of it runs. Returns the names."""
    target = Path(os.path.abspath(os.fspath(directory)))
    if not target.parent.is_dir():
        return []
    with claimed(target, str(directory)):
        return clean_leftovers(target)


def write_partial(model: nn.Module, tokenizer, folder: Path) -> None:
    """Write the checkpoint's files into `folder` (not yet at its place), with the usual file modes."""
    model.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    set_default_modes(folder)  # temporary folders and safetensors' files are private; a checkpoint is shared


def save_checkpoint(model: nn.Module, directory: str | os.PathLike, tokenizer=None, overwrite: bool = False) -> dict:
    """Write `model` (and its tokenizer) as a checkpoint folder. A pruned model keeps only the weights that exist,
    its plan and structure in config.json and the modeling file; a model with no plan is saved as an ordinary dense
    checkpoint, with a warning.

    The folder is claimed first (`save_claim`: a concurrent save to it is refused), the checkpoint is written into a
    hidden sibling folder and, when complete, swapped with the old one in a single rename, so a reader or a kill at any
    moment finds the old checkpoint or the new one at `directory`, and a failed save leaves it as it was. An existing
    folder is refused unless it is empty, or a checkpoint of this project holding nothing else and `overwrite` is True
    (see `check_save_target`). Leftovers of interrupted saves of the same folder are removed first.

    Args:
        model: a causal LM, typically after `apply_harp` or `pruning.prune.prune`.
        directory: the checkpoint folder.
        tokenizer: saved beside the weights (default: the one `load_model` attached to the model, if any).
        overwrite: replace an existing checkpoint of this project at `directory`.
    Returns:
        dict: directory, pruned (bool), weights_bytes (the safetensors files' size), and cleaned_up (what earlier,
        interrupted saves had left) where there was something.
    """
    target = check_save_target(directory, overwrite)
    pruned = has_plan(model)
    if pruned and not mark_pruned(model):
        raise ValueError(f"a pruned {type(model).__name__} cannot be saved as a checkpoint yet: pruned-checkpoint "
                         f"classes exist for {sorted(c.__bases__[1].__name__ for c in CLASSES.values())}")
    if not pruned:
        warnings.warn("this model has no HARP plan or baseline record: saving an ordinary dense checkpoint",
                      stacklevel=2)
    tokenizer = tokenizer if tokenizer is not None else getattr(model, "harp_tokenizer", None)
    with save_claim(directory, overwrite):
        cleaned = clean_leftovers(target)
        check_save_target(directory, overwrite)  # again, now that no other save can change it
        tmp = partial_dir(target)
        try:
            write_partial(model, tokenizer, tmp)
            put_in_place(tmp, target)  # from here on `tmp` holds the replaced checkpoint, if there was one
        except OSError as err:  # name the user's folder, not the temporary one
            raise OSError(err.errno, f"cannot save the checkpoint to {directory}: {err.strerror or err}") from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return {"directory": str(directory), "pruned": pruned, "weights_bytes": weights_bytes(target)} | (
        {"cleaned_up": cleaned} if cleaned else {})


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


# ---------------------------------------------------------------------------------------------- loading
def checkpoint_plans(config: dict, where: str) -> tuple[HarpPlan | None, PruneRecord | None]:
    """The HARP plan and baseline record a checkpoint's config.json carries (`harp_plan`), strictly parsed.

    Args:
        config: config.json as a dict; where: how to name it in errors (its path).
    """
    plans = config.get(PLAN) or {}
    if not isinstance(plans, dict) or not set(plans) <= set(PLAN_KINDS):
        found = sorted(plans) if isinstance(plans, dict) else type(plans).__name__
        raise ValueError(f"{where}: {PLAN} holds {found}; this version reads the kinds {list(PLAN_KINDS)}")
    restored = {kind: PLAN_KINDS[kind].from_dict(d, f"{where} ({PLAN}.{kind})") for kind, d in plans.items()}
    return restored.get("harp"), restored.get("baseline")


def _dense_meta_model(config: transformers.PretrainedConfig) -> nn.Module:
    clean = copy.deepcopy(config)
    for key in (STRUCTURE, PLAN, "auto_map"):
        clean.__dict__.pop(key, None)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(clean)


def _first_difference(expected: list[dict], declared: list[dict]) -> str | None:
    """Where the structure a plan produces and the one a checkpoint declares first differ, in words."""
    want = {e.get("path"): e for e in expected}
    have = {e.get("path"): e for e in declared if isinstance(e, dict)}
    if len(have) != len(declared):
        return "an entry of the structure that is not a module entry with a 'path'"
    for path in list(want) + [p for p in have if p not in want]:
        a, b = want.get(path), have.get(path)
        if a == b:
            continue
        if a is None:
            return f"{path}: the structure makes it a {b.get('kind')} module, the plan leaves it unpruned"
        if b is None:
            return f"{path}: the plan makes it a {a.get('kind')} module, the structure leaves it unpruned"
        keys = sorted(set(a) | set(b), key=lambda k: (k not in ("kind", "mixing"), k))  # what it is, first
        key = next(k for k in keys if a.get(k) != b.get(k))
        return f"{path}: its {key} is {a.get(key)!r} by the plan but {b.get(key)!r} in the structure"
    return None


def _pruned_meta(config: transformers.PretrainedConfig, steps: list) -> nn.Module:
    model = _dense_meta_model(config)
    for step in steps:
        step.apply(model)
    return model


def check_checkpoint(config: transformers.PretrainedConfig, harp: HarpPlan | None, record: PruneRecord | None,
                     where: str) -> None:
    """Refuse a checkpoint whose plan does not produce the structure it declares: applied to the dense model of its
    config (on the meta device, no weights), the plan and record must give exactly its `harp_structure`, so the
    layers exist, the bypassed and sliced modules are the ones the plan names, and α agrees with the folded weights.
    A model pruned by both was pruned in one order or the other (HARP first, or a baseline first): either is accepted.
    """
    declared = getattr(config, STRUCTURE, None) or []
    if not isinstance(declared, list):
        raise ValueError(f"{where}: its {STRUCTURE} is not a list of module entries; re-save the checkpoint")
    steps = [step for step in (harp, record) if step is not None]
    error, problem = None, None
    for order in [steps, steps[::-1]][:len(steps)] or [[]]:
        try:
            model = _pruned_meta(config, order)
        except ValueError as err:
            error = error or err
            continue
        found = _first_difference(json.loads(json.dumps(describe(model))), declared)
        if found is None:
            return
        problem = problem or found
    if problem is None:
        raise ValueError(f"{where}: its {PLAN} does not fit the model of its config: {error}") from None
    raise ValueError(f"{where}: its {PLAN} and {STRUCTURE} disagree at {problem}; re-save the checkpoint from the "
                     "pruned model")


def load_model(
    name_or_path: str = "smollm2-135m",
    dtype: torch.dtype | str = torch.float32,
    device: str | None = "cpu",
    attn_implementation: str | None = None,
    device_map: str | dict | None = None,
):
    """Load a causal LM and its tokenizer; a pruned checkpoint is checked against its plan before its weights load.

    Args:
        name_or_path: a packaged name (`smollm2-135m`, `gemma3-270m`, `qwen2.5-coder-1.5b`), a local HF
            directory (a pruned checkpoint included), or a Hub id.
        dtype: torch dtype (or its name, e.g. "bfloat16").
        device: where to put the model ("cpu", "cuda"); ignored when `device_map` is given.
        attn_implementation: "sdpa", "eager" (any transformers backend name); None: transformers' choice
            (sdpa where the family supports it, e.g. not Gemma-2, whose soft-capping needs eager).
        device_map: passed to transformers/accelerate, e.g. "auto" to spread a large model over GPUs.

    Returns:
        (model, tokenizer); `model.harp_source` records the model id and checksum; a pruned checkpoint's model
        carries its `harp_plan` / `prune_record`.
    """
    source, _ = resolve_source(name_or_path)
    where = f"{name_or_path} (config.json)"
    if Path(source, "config.json").is_file():
        where = str(Path(source, "config.json"))
        read_json(where, "checkpoint config")  # malformed JSON or a repeated key: refused, naming the file
    config = transformers.AutoConfig.from_pretrained(source)
    harp, record = checkpoint_plans(config.to_dict(), where)
    if harp is not None or record is not None or getattr(config, STRUCTURE, None):
        check_checkpoint(config, harp, record, where)
    model, tok = load_pretrained(name_or_path, dtype, device, attn_implementation, device_map)
    model.harp_plan, model.prune_record = harp, record
    if harp is not None or record is not None:
        mark_pruned(model)  # saving it again keeps the plan
    return model, tok
