"""The package's layout rules (issue 11), checked on the source so they cannot quietly erode.

- only the adapter (models.py) names a layer's modules;
- no module imports another module's private names, and none imports the package's own modules inside a function;
- every notebook's study lives in harp_src/studies/ and the notebook imports it from there.
"""

import ast
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "harp_src"
SOURCES = sorted(p for p in PACKAGE.rglob("*.py") if "lm_tasks" not in p.parts)
LAYOUT_NAMES = re.compile(r"self_attn|post_attention_layernorm|input_layernorm|pre_feedforward_layernorm")


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


@pytest.mark.parametrize("path", SOURCES, ids=rel)
def test_only_the_adapter_names_layer_modules(path):
    hits = [n for n, line in enumerate(path.read_text().splitlines(), 1) if LAYOUT_NAMES.search(line)]
    assert path.name == "models.py" or not hits, f"{rel(path)} names layer modules at lines {hits}: ask the Adapter"


@pytest.mark.parametrize("path", SOURCES, ids=rel)
def test_no_private_or_function_local_package_imports(path):
    tree = ast.parse(path.read_text())
    private = [(node.lineno, a.name) for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level
               for a in node.names if a.name.startswith("_")]
    assert not private, f"{rel(path)} imports private names {private}"
    local = [inner.lineno for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
             for inner in ast.walk(fn) if isinstance(inner, ast.ImportFrom) and inner.level]
    assert not local, f"{rel(path)} imports package modules inside functions at lines {local}"


def test_each_notebook_imports_its_study_from_harp_src_studies():
    studies = {p.stem for p in (PACKAGE / "studies").glob("*.py")} - {"__init__"}
    used = set()
    for notebook in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        code = "".join("".join(c["source"]) for c in json.loads(notebook.read_text())["cells"]
                       if c["cell_type"] == "code")
        found = set(re.findall(r"from harp_src\.studies\.(\w+) import", code))
        assert len(found) == 1 and found <= studies, f"{notebook.name} imports studies {found}"
        used |= found
    assert used == studies, f"study modules no notebook uses: {studies - used}"


def test_ruff_is_clean_on_code_tests_and_notebooks():
    """`make lint` in CI: the same ruff check over the library, the tests and the notebooks."""
    ruff = Path(sys.executable).with_name("ruff")  # the environment's own ruff (requirements/base.txt)
    ruff = ruff if ruff.exists() else Path(shutil.which("ruff") or "ruff")
    out = subprocess.run([str(ruff), "check", "harp_src", "tests", "notebooks"], cwd=ROOT, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stdout + out.stderr
