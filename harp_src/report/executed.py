"""Executed notebooks for reading: a full-profile papermill output, cleaned so that a rerun with the same results
gives the same file, kept in figures/notebooks/ beside the figures it made.

Kept: every cell, its outputs (tables, text, the figures `plots.show_saved` embedded with their hashes), execution
counts and the parameters papermill injected. Stripped: run times and papermill's per-cell timestamps, progress bars
and warnings (the stderr stream), widget views (their ids are random each run); the injected cell gets a fixed id, and
its lines longer than the project's line length are wrapped (same values), so the copy stays `ruff` clean.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import pprint
from pathlib import Path

import nbformat

from .files import ROOT, atomic_path
from .plots import FIGURE_KEY

EXECUTED = ROOT / "figures" / "notebooks"
WIDGET = "application/vnd.jupyter.widget-view+json"
CELL_NOISE = ("papermill", "execution")  # cell metadata that records when and how long a cell ran
LINE_LENGTH = 120  # pyproject's ruff line-length


def _keep(output: dict) -> bool:
    if output.get("output_type") == "stream":
        return output.get("name") != "stderr"
    return WIDGET not in output.get("data", {})


def wrapped_parameters(source: str, parameters: dict) -> str:
    """The injected cell's `source` with each `NAME = value` line longer than LINE_LENGTH rewritten as the same value
    of `parameters[NAME]` spread over lines (papermill writes each parameter on one line, however long)."""
    lines = []
    for line in source.splitlines():
        name = line.split(" = ", 1)[0]
        if len(line) > LINE_LENGTH and name in parameters:
            head = f"{name} = "
            body = pprint.pformat(parameters[name], width=LINE_LENGTH - len(head), sort_dicts=False)
            line = head + body.replace("\n", "\n" + " " * len(head))
        lines.append(line)
    return "\n".join(lines) + ("\n" if source.endswith("\n") else "")


def clean_executed(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """A copy of an executed notebook without its run-to-run noise (see the module docstring)."""
    nb = copy.deepcopy(nb)
    nb.metadata.pop("widgets", None)
    papermill = nb.metadata.get("papermill", {})
    nb.metadata["papermill"] = {"parameters": papermill.get("parameters", {})}
    for cell in nb.cells:
        for key in CELL_NOISE:
            cell.metadata.pop(key, None)
        if "injected-parameters" in cell.metadata.get("tags", []):
            cell.id = "injected-parameters"  # papermill gives the cell it adds a random id
            cell.source = wrapped_parameters(cell.source, nb.metadata.papermill["parameters"])
        if cell.cell_type == "code":
            cell.outputs = [o for o in cell.outputs if _keep(o)]
    return nb


def write_executed(source: str | Path, folder: str | Path = EXECUTED) -> Path:
    """Clean the executed notebook at `source` and write it, atomically, as folder/<its name>."""
    nb = nbformat.read(source, as_version=4)
    path = Path(folder) / Path(source).name
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        nbformat.write(clean_executed(nb), tmp)
    return path


def embedded_figures(nb: nbformat.NotebookNode) -> list[dict]:
    """Every figure `show_saved` embedded: file name, the hash recorded when it was saved, the hash of the embedded
    bytes."""
    found = []
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            meta = output.get("metadata", {}).get(FIGURE_KEY)
            if meta and "image/png" in output.get("data", {}):
                data = base64.b64decode(output["data"]["image/png"])
                found.append(meta | {"embedded_sha256": hashlib.sha256(data).hexdigest()})
    return found


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def check_executed(path: str | Path, figures: str | Path = ROOT / "figures", parameters: dict | None = None
                   ) -> list[str]:
    """What is wrong with an executed notebook against the committed results, in words (empty: nothing).

    It must carry `parameters` (the profile's, when given) as the ones papermill injected, embed at least one
    figure, and each embedded figure must be the bytes it saved (the hash recorded at save time) and the file now
    in `figures` byte for byte. No output may be an error.
    """
    nb = nbformat.read(path, as_version=4)
    problems = []
    recorded = nb.metadata.get("papermill", {}).get("parameters")
    if parameters is not None and recorded != parameters:
        problems.append(f"its parameters {recorded} are not the profile's {parameters}")
    shown = embedded_figures(nb)
    if not shown:
        problems.append("it embeds no figure")
    for fig in shown:
        file = Path(figures) / fig["file"]
        if fig["embedded_sha256"] != fig["sha256"]:
            problems.append(f"the embedded {fig['file']} is not the image that was saved")
        elif not file.exists():
            problems.append(f"{fig['file']} is not in {figures}")
        elif _sha256(file) != fig["sha256"]:
            problems.append(f"{file} is not the figure this run saved (rerun the notebook or restore the figure)")
    if any(o.get("output_type") == "error" for c in nb.cells for o in c.get("outputs", [])):
        problems.append("an output is an error")
    return problems
