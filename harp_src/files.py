"""Atomic writes: every file or folder the package writes appears whole or not at all (a crash leaves no half file)."""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary sibling of `path` to write; on success it replaces `path`, on error it is removed.

    The temporary name keeps the suffix (savefig and np.save choose their format by it). A folder works too: write
    the folder at the yielded path, and an existing folder at `path` is replaced by it.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.stem}.{uuid.uuid4().hex[:8]}.partial{path.suffix}")
    try:
        yield tmp
        if tmp.is_dir() and path.is_dir():
            shutil.rmtree(path)
        os.replace(tmp, path)
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp)
        elif tmp.exists():
            tmp.unlink()


def write_text(path: str | os.PathLike, text: str) -> Path:
    """Write `text` (UTF-8) to `path` atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)


def write_json(path: str | os.PathLike, obj) -> Path:
    """Write `obj` as indented JSON (non-JSON values as str) with a final newline, atomically."""
    return write_text(path, json.dumps(obj, indent=1, default=str) + "\n")
