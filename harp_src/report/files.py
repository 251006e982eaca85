"""Atomic writes and strict reads: every file or folder the package writes appears whole or not at all, with the
usual permissions; every JSON it reads is refused, naming the file, if it is malformed, repeats a key, is larger or
nested deeper than its kind allows. A folder being written is claimed first (`claimed`), so two writers never race,
and a finished folder replaces an old one in a single step (`put_in_place`)."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import os
import re
import shutil
import tempfile
import threading
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


MAX_DEPTH = 32  # no file of ours nests deeper than ~6; far deeper is a broken or hostile file


def depth(obj) -> int:
    """How deeply lists and objects nest in parsed JSON (a scalar: 0), counted without recursion."""
    deepest, stack = 0, [(obj, 0)]
    while stack:
        item, level = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is not None:
            deepest = max(deepest, level + 1)
            stack.extend((child, level + 1) for child in children)
    return deepest


def read_json(path: str | os.PathLike, what: str = "file", max_bytes: int | None = None):
    """Read a JSON file strictly (`parse_json`); a missing, unreadable, too large or too deeply nested file is one
    ValueError naming it. Any readable file works, pipes included (`--plan <(cat plan.json)`).

    Args:
        what: what the file should be, for the error ("plan file", "checkpoint config").
        max_bytes: refuse a larger file, after reading at most one byte more (None: no limit).
    """
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{what} {path} is a folder; give the path of the JSON file")
    if not path.exists():
        raise ValueError(f"{what} {path} does not exist; give the path of the JSON file")
    try:
        with open(path, "rb") as handle:
            data = handle.read(-1 if max_bytes is None else max_bytes + 1)
        text = data.decode("utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"{what} {path} cannot be read ({err}); check its permissions and encoding") from None
    if max_bytes is not None and len(data) > max_bytes:
        raise ValueError(f"{what} {path} is larger than {max_bytes:,} bytes, far more than such a file holds; "
                         "give the file this package wrote")
    too_deep = ValueError(f"{what} {path} nests lists or objects more than {MAX_DEPTH} deep; give the file this "
                          "package wrote")
    try:
        parsed = parse_json(text, f"{what} {path}")
    except RecursionError:
        raise too_deep from None
    if depth(parsed) > MAX_DEPTH:
        raise too_deep
    return parsed


# ---------------------------------------------------------------------------------------------- output paths
def check_writable(path: str | os.PathLike, what: str, folder: bool = False) -> Path:
    """Refuse, before any work, an output path that cannot be written: a folder where a file is wanted (or a file
    where a folder is), a path under a file, or a place this process may not create files in. Nothing is left behind.

    Args:
        what: how the user gave it, for the error ("--csv rows.csv").
        folder: the output is a folder (a checkpoint) rather than a file.
    Returns:
        The path, absolute.
    """
    target = Path(os.path.abspath(os.fspath(path)))
    if target.is_dir() and not folder:
        raise ValueError(f"{what} is a folder; give a file name")
    base = target.parent
    while not base.exists():
        base = base.parent
    if not base.is_dir():
        raise ValueError(f"{what} cannot be written: {base} is a file, not a folder; choose another path")
    try:
        tempfile.TemporaryFile(dir=base).close()  # the one sure test (root ignores permission bits)
    except OSError as err:
        raise ValueError(f"{what} cannot be written: no file can be created in {base} ({err.strerror}); choose "
                         "a folder you can write to") from None
    return target


# ---------------------------------------------------------------------------------------------- claimed folders
_HELD: dict[Path, list[int]] = {}  # claims held here: path -> [thread, depth] (re-entrant within its thread)


def lock_path(target: Path) -> Path:
    """The lock file that claims `target` (a hidden sibling; it exists only while a save runs)."""
    return target.with_name(f".{target.name}.lock")


def _lock(lock: Path, wait: bool = False) -> int | None:
    """An exclusive flock on `lock` (created if needed), or None if another process holds it (with `wait`, once it
    lets go). The kernel drops the lock when its holder dies, so a killed save never blocks the next one."""
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        try:
            if os.stat(lock).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)  # the previous holder removed the file between our open and flock: take the new one


@contextmanager
def exclusive(lock: str | os.PathLike) -> Iterator[None]:
    """Wait for an exclusive flock on the file `lock` (created with its folder if needed) and hold it while inside:
    processes preparing the same cache entry (two Ray steps, two pytest workers) take turns, and the second finds
    the first one's result. The kernel drops the lock when its holder dies."""
    lock = Path(lock)
    lock.parent.mkdir(parents=True, exist_ok=True)
    fd = _lock(lock, wait=True)
    try:
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def _created_parents(target: Path) -> list[Path]:
    """Create `target`'s missing parent folders; return the ones created, deepest first."""
    missing, base = [], target.parent
    while not base.exists():
        missing.append(base)
        base = base.parent
    target.parent.mkdir(parents=True, exist_ok=True)
    return missing


@contextmanager
def claimed(target: str | os.PathLike, what: str) -> Iterator[Path]:
    """Hold an exclusive claim on the folder `target` while inside: another claim of it, from another process or
    thread, is refused at once (one ValueError naming `what`); within one thread a claim is re-entrant (a command
    claims its output, then the save inside it claims it again). Missing parent folders are created, and removed again
    on the way out if they are still empty. Yields the target as an absolute path."""
    target = Path(os.path.abspath(os.fspath(target)))
    if _HELD.get(target, [None])[0] == threading.get_ident():
        _HELD[target][1] += 1
        try:
            yield target
        finally:
            _HELD[target][1] -= 1
        return
    made = _created_parents(target)
    fd = _lock(lock_path(target))  # None while another process, or thread of this one, holds it
    if fd is None:
        _remove_if_empty(made)
        raise ValueError(f"another save to {what} is in progress; nothing was written. Wait for it to finish, or "
                         "choose another folder")
    _HELD[target] = [threading.get_ident(), 1]
    try:
        yield target
    finally:
        del _HELD[target]
        lock_path(target).unlink(missing_ok=True)  # before the lock goes: see `_lock`
        os.close(fd)
        _remove_if_empty(made)


def _remove_if_empty(folders: list[Path]) -> None:
    """Remove the folders a claim created (deepest first) where nothing else has been put in them meanwhile."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:  # not empty (another save's lock or output), or already gone
            return


def partial_dir(target: Path) -> Path:
    """A new private folder beside `target` to write its next version into (`leftovers` knows its name)."""
    return Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent))


def _set_aside_name(target: Path) -> Path:
    return target.with_name(f".{target.name}.replaced-{uuid.uuid4().hex[:8]}")


def leftovers(target: Path) -> list[Path]:
    """What interrupted writes of `target` left beside it: unfinished `.partial` folders and old versions set
    aside. Only call it while holding the claim on `target` (then no live write owns them)."""
    pattern = re.compile(rf"\.{re.escape(target.name)}\.([A-Za-z0-9_]{{8}}\.partial|replaced-[0-9a-f]{{8}})")
    if not target.parent.is_dir():
        return []
    return sorted(p for p in target.parent.iterdir() if pattern.fullmatch(p.name) and p.is_dir()
                  and not p.is_symlink())


def clean_leftovers(target: Path) -> list[str]:
    """Remove what interrupted writes of `target` left (`leftovers`), under the claim. Where a write was killed
    between the two renames of the fallback swap (no folder at `target`, the old one set aside), the old folder is
    put back first. Returns the names removed or restored."""
    found, done = leftovers(target), []
    set_aside = [p for p in found if ".replaced-" in p.name]
    if set_aside and not target.exists():
        os.rename(set_aside[0], target)
        done.append(f"{set_aside[0].name} -> {target.name}")
        found.remove(set_aside[0])
    for p in found:
        shutil.rmtree(p)
        done.append(p.name)
    return done


RENAME_EXCHANGE = 2  # renameat2(2): swap two paths atomically (Linux 3.15+, ext4, xfs, btrfs, tmpfs, ...)


def exchange(a: Path, b: Path) -> bool:
    """Swap the folders at `a` and `b` in one step; False where the system cannot (other platforms, some file
    systems)."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    if renameat2(-100, os.fsencode(a), -100, os.fsencode(b), RENAME_EXCHANGE) == 0:  # -100: AT_FDCWD
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code))


def put_in_place(new: Path, target: Path) -> None:
    """Put the complete folder `new` at `target`. Where `target` exists, the two are swapped in one step, so a reader
    (or a kill) sees the old folder or the new one, never none; the old one is then at `new`, for the caller to
    remove. Where the system cannot swap, the old folder is set aside first and put back if the second rename fails
    (a kill between the two is repaired by the next claim, `clean_leftovers`)."""
    if not target.exists():
        os.rename(new, target)
        return
    if exchange(new, target):
        return
    old = _set_aside_name(target)
    os.rename(target, old)
    try:
        os.rename(new, target)
    except BaseException:
        os.rename(old, target)
        raise
    os.rename(old, new)
