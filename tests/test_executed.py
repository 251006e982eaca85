"""Executed notebooks in figures/notebooks/: the full-profile parameters, figures byte-identical to the committed
ones, no run-to-run noise; and the check fails on a doctored copy."""

import copy
import hashlib
import json
import shutil
from pathlib import Path

import nbformat
import pytest

from harp_src.report.executed import (
    EXECUTED,
    LINE_LENGTH,
    check_executed,
    clean_executed,
    embedded_figures,
    wrapped_parameters,
)
from harp_src.report.files import ROOT
from harp_src.report.params import NOTEBOOKS
from harp_src.runner import profile_parameters

COPIES = sorted(EXECUTED.glob("*.ipynb"))


def test_there_are_executed_notebooks_and_each_has_its_source():
    assert COPIES, "figures/notebooks/ is empty: run python -m harp_src.runner --profile full"
    for path in COPIES:
        assert (NOTEBOOKS / path.name).exists(), f"{path.name} has no source notebook in notebooks/"


@pytest.mark.parametrize("path", COPIES, ids=[p.stem for p in COPIES])
def test_executed_notebook_matches_the_committed_figures(path):
    assert check_executed(path, ROOT / "figures", profile_parameters("full", path.stem)) == []


def _cells(path: Path) -> list[tuple[str, str]]:
    """(cell type, source) of a notebook's cells, without the parameters papermill injects."""
    nb = nbformat.read(path, as_version=4)
    return [(c.cell_type, c.source) for c in nb.cells if "injected-parameters" not in c.metadata.get("tags", [])]


@pytest.mark.parametrize("path", COPIES, ids=[p.stem for p in COPIES])
def test_executed_notebook_reads_as_its_source(path):
    # a conclusion edited after the run must reach the copy a reader opens too
    assert _cells(path) == _cells(NOTEBOOKS / path.name), f"{path.name}: rerun it, or carry the source's text over"


@pytest.fixture
def doctored(tmp_path) -> tuple[Path, Path, dict]:
    """A copy of the first executed notebook and of the figures it embeds, in tmp_path."""
    source = COPIES[0]
    figures = tmp_path / "figures"
    figures.mkdir()
    nb = nbformat.read(source, as_version=4)
    for fig in embedded_figures(nb):
        shutil.copy(ROOT / "figures" / fig["file"], figures / fig["file"])
    path = tmp_path / source.name
    shutil.copy(source, path)
    return path, figures, profile_parameters("full", source.stem)


def test_the_copy_passes_before_it_is_doctored(doctored):
    assert check_executed(*doctored) == []


def test_a_changed_figure_fails(doctored):
    path, figures, params = doctored
    png = next(figures.iterdir())
    png.write_bytes(png.read_bytes() + b"\0")
    assert any("is not the figure this run saved" in p for p in check_executed(path, figures, params))


def test_other_parameters_fail(doctored):
    path, figures, params = doctored
    changed = params | {"SEED": params.get("SEED", 0) + 1}
    assert any("are not the profile's" in p for p in check_executed(path, figures, changed))


def test_an_edited_embedded_image_and_a_missing_figure_fail(doctored):
    path, figures, params = doctored
    nb = json.loads(path.read_text())
    shown = [o for c in nb["cells"] for o in c.get("outputs", []) if "harp_figure" in o.get("metadata", {})]
    shown[0]["data"]["image/png"] = shown[1]["data"]["image/png"]  # another image under the first one's name
    path.write_text(json.dumps(nb))
    (figures / shown[1]["metadata"]["harp_figure"]["file"]).unlink()
    problems = check_executed(path, figures, params)
    assert any("is not the image that was saved" in p for p in problems)
    assert any("is not in" in p for p in problems)


def test_cleaning_strips_run_noise_and_is_stable():
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("print(1)")
    cell.metadata = {"papermill": {"duration": 1.5}, "execution": {"iopub.status.busy": "2026"}, "tags": []}
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="1\n"),
                    nbformat.v4.new_output("stream", name="stderr", text="100%|##| 3/3 [00:01<00:00, 2.9it/s]"),
                    nbformat.v4.new_output("display_data", data={
                        "application/vnd.jupyter.widget-view+json": {"model_id": "ab12"}, "text/plain": "bar"})]
    injected = nbformat.v4.new_code_cell("A = 1")
    injected.metadata = {"tags": ["injected-parameters"]}
    nb.cells = [cell, injected]
    nb.metadata.update(papermill={"parameters": {"A": 1}, "start_time": "2026", "duration": 9.0}, widgets={})
    clean = clean_executed(nb)
    assert clean.metadata.papermill == {"parameters": {"A": 1}} and "widgets" not in clean.metadata
    assert clean.cells[0].metadata == {"tags": []} and clean.cells[1].id == "injected-parameters"
    assert [o.get("name") for o in clean.cells[0].outputs] == ["stdout"]
    assert clean_executed(clean) == clean and nb.cells[0].outputs[1].name == "stderr"  # a copy; stable
    assert hashlib.sha256(nbformat.writes(clean).encode()).hexdigest() == hashlib.sha256(
        nbformat.writes(clean_executed(copy.deepcopy(nb))).encode()).hexdigest()


def test_long_injected_parameters_are_wrapped_to_the_same_values():
    limit = {"smollm2-135m": {f"task_{i}": 1000 + i for i in range(12)}, "gemma3-270m": {"arc_easy": 570}}
    params = {"SEED": 0, "LIMIT": limit, "TASKS": [f"t{i}" for i in range(30)], "REUSE": True}
    source = "# Parameters\n" + "\n".join(f"{k} = {json.dumps(v).replace('true', 'True')}" for k, v in params.items())
    source += "\n"
    assert max(map(len, source.splitlines())) > LINE_LENGTH
    wrapped = wrapped_parameters(source, params)
    assert max(map(len, wrapped.splitlines())) <= LINE_LENGTH and wrapped.endswith("\n")
    assert wrapped.splitlines()[:2] == ["# Parameters", "SEED = 0"]  # short lines stay as papermill wrote them
    namespace: dict = {}
    exec(wrapped, namespace)
    assert {k: namespace[k] for k in params} == params
    assert wrapped_parameters(wrapped, params) == wrapped


def test_the_readme_links_every_executed_copy():
    readme = (ROOT / "README.md").read_text()
    for path in COPIES:
        assert f"(figures/notebooks/{path.name})" in readme, f"README's notebook table does not link {path.name}"
