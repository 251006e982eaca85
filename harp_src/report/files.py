"""Atomic writes and strict reads: every file or folder the package writes appears whole or not at all, with the
usual permissions; every JSON it reads is refused, naming the file, if it is malformed or repeats a key."""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository: paths anchored on the package, not on the cwd


def umask() -> int:
    """The process umask (read without changing it for longer than the call)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def set_default_modes(path: str | os.PathLike) -> None:
    """Give `path` (and, for a folder, everything in it) the modes a plain `open` / `mkdir` would: 0666 / 0777 minus
    the umask. Temporary files and folders are private (0600 / 0700); what we publish should not be."""
    path = Path(path)
    mask = umask()
    entries = [path] + (sorted(path.rglob("*")) if path.is_dir() else [])
    for entry in entries:
        if not entry.is_symlink():
            entry.chmod((0o777 if entry.is_dir() else 0o666) & ~mask)


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary sibling of `path` to write; on success it replaces `path`, on error it is removed.

    The temporary name keeps the suffix (savefig and np.save choose their format by it). A folder works too: write
    the folder at the yielded path, and an existing folder at `path` is replaced by it. What appears has the usual
    modes (`set_default_modes`), whatever the writer gave the temporary.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.stem}.{uuid.uuid4().hex[:8]}.partial{path.suffix}")
    try:
        yield tmp
        set_default_modes(tmp)
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


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    keys = [k for k, _ in pairs]
    repeated = sorted({k for k in keys if keys.count(k) > 1})
    if repeated:
        raise ValueError(f"the key {repeated[0]!r} appears more than once in one object; keep one")
    return dict(pairs)


def parse_json(text: str, where: str):
    """Parse JSON text, refusing an object that repeats a key (json keeps the last one silently).

    Args:
        where: how to name the text in an error (a file path, "config.json of DIR").
    Raises:
        ValueError: naming `where`, the line and column for a syntax error, or the repeated key.
    """
    try:
        return json.loads(text, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where} is not valid JSON ({err.msg} at line {err.lineno}, column {err.colno}); "
                         "fix or regenerate the file") from None
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None


def check_object(d, what: str, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> dict:
    """`d` if it is a JSON object with every `required` key and no key outside `required` + `optional`; else one
    ValueError saying which keys it has, lacks or should not have (a typo such as "alpha" for "alphas")."""
    if not isinstance(d, dict):
        raise ValueError(f"{what} is a JSON object, got {type(d).__name__}")
    unknown = sorted(set(d) - set(required) - set(optional))
    missing = [k for k in required if k not in d]
    if unknown or missing:
        raise ValueError(f"{what} has the keys {list(required + optional)} ({', '.join(optional) or 'none'} "
                         f"optional); unknown {unknown}, missing {missing}")
    return d


def read_json(path: str | os.PathLike, what: str = "file"):
    """Read a JSON file strictly (`parse_json`); a missing or unreadable file is one ValueError naming it.

    Args:
        what: what the file should be, for the error ("plan file", "checkpoint config").
    """
    path = Path(path)
    if not path.is_file():
        state = "is a folder" if path.is_dir() else "does not exist"
        raise ValueError(f"{what} {path} {state}; give the path of the JSON file")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"{what} {path} cannot be read ({err}); check its permissions and encoding") from None
    return parse_json(text, f"{what} {path}")
