"""Atomic writes: a file appears whole or not at all; a failed write leaves neither the file nor a temporary."""

import json

import pytest

from harp_src.report.files import atomic_path, write_json, write_text


def test_write_replaces_whole_files(tmp_path):
    path = write_text(tmp_path / "sub" / "a.txt", "first")
    assert path.read_text() == "first"
    write_json(path, {"x": 1, "p": tmp_path})  # non-JSON values are written as str
    assert json.loads(path.read_text()) == {"x": 1, "p": str(tmp_path)} and path.read_text().endswith("\n")
    assert sorted(p.name for p in path.parent.iterdir()) == ["a.txt"]


def test_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = write_text(tmp_path / "table.csv", "old")
    with pytest.raises(RuntimeError, match="boom"), atomic_path(path) as tmp:
        assert tmp.suffix == ".csv" and tmp.parent == path.parent  # savefig / np.save pick the format by suffix
        tmp.write_text("half")
        raise RuntimeError("boom")
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["table.csv"]


def test_a_folder_is_replaced_whole(tmp_path):
    target = tmp_path / "model"
    for version in ("v1", "v2"):
        with atomic_path(target) as tmp:
            tmp.mkdir()
            (tmp / "weights.txt").write_text(version)
    assert [p.name for p in target.iterdir()] == ["weights.txt"] and (target / "weights.txt").read_text() == "v2"
    assert [p.name for p in tmp_path.iterdir()] == ["model"]
