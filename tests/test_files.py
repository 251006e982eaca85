"""Atomic writes: a file appears whole or not at all; a failed write leaves neither the file nor a temporary."""

import json
import subprocess
import sys
import time

import pytest

from harp_src.report import parts
from harp_src.report.files import atomic_path, exclusive, write_json, write_text
from harp_src.report.parts import source_digest, stored_part


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


def test_stored_parts_are_reused_only_for_the_same_parameters(tmp_path):
    calls = []

    def compute(value):
        def run():
            calls.append(value)
            return {"value": value}
        return run

    first, made = stored_part("nb", {"model": "m", "n": 1}, compute(1), reuse=True, folder=tmp_path)
    assert first == {"value": 1} and not made["reused"] and made["source_digest"] == source_digest()
    again, made = stored_part("nb", {"model": "m", "n": 1}, compute(2), reuse=True, folder=tmp_path)
    assert again == {"value": 1} and made["reused"] and calls == [1]  # same parameters: read back, not recomputed
    other, _ = stored_part("nb", {"model": "m", "n": 2}, compute(3), reuse=True, folder=tmp_path)
    fresh, made = stored_part("nb", {"model": "m", "n": 1}, compute(4), reuse=False, folder=tmp_path)
    assert other == {"value": 3} and fresh == {"value": 4} and not made["reused"] and calls == [1, 3, 4]
    assert stored_part("nb", {"model": "m", "n": 1}, compute(5), reuse=True, folder=tmp_path)[0] == {"value": 4}
    assert len(list(tmp_path.iterdir())) == 2  # one file per parameter set, no temporaries left


def test_stored_step_resumes_and_reports_its_provenance(tmp_path, monkeypatch):
    monkeypatch.setattr(parts, "PARTS", tmp_path)
    made, calls = [], []

    def compute():
        calls.append(1)
        return {"value": len(calls)}

    first = parts.stored_step("nb", {"point": "a"}, compute, True, made)
    again = parts.stored_step("nb", {"point": "a"}, compute, True, made)
    fresh = parts.stored_step("nb", {"point": "a"}, compute, False, made)  # not reused without REUSE_PARTS
    assert first == again == {"value": 1} and fresh == {"value": 2} and len(calls) == 2
    assert (tmp_path / "nb" / "steps").is_dir()
    summary = parts.steps_summary(made)
    assert summary["steps"] == 3 and summary["reused"] == 1 and len(summary["made_by"]) == 1
    assert summary["compute_seconds"] >= 0 and all("seconds" in m for m in made)


def test_exclusive_makes_a_second_process_wait_until_the_first_leaves(tmp_path):
    """Two processes preparing one cache entry (a converted model) take turns: the second waits, then goes on."""
    lock, log = tmp_path / "locks" / "entry.lock", tmp_path / "log"
    waiter = ("import sys, time; from harp_src.report.files import exclusive\n"
              "with exclusive(sys.argv[1]):\n"
              "    open(sys.argv[2], 'a').write(f'in {time.time()}\\n')\n")
    with exclusive(lock):
        other = subprocess.Popen([sys.executable, "-c", waiter, str(lock), str(log)])
        time.sleep(3)
        assert not log.exists() and other.poll() is None  # still waiting for the lock
        left = time.time()
    assert other.wait(timeout=60) == 0
    assert float(log.read_text().split()[1]) >= left
