"""The package's layout rules (issues 11 and 26), checked on the source so they cannot quietly erode.

- only the adapter (model/adapter.py) names a layer's modules;
- no module imports another module's private names, and none imports the package's own modules inside a function;
- every notebook's study lives in harp_src/studies/ and the notebook imports it from there;
- subpackages by capability (at least 4 besides studies/, at most 6 modules at the top), each module under 400 code
  lines, each function under 60 lines; a study function takes at most 6 parameters, any other at most 6 that can
  be passed by position (more only as keywords, which cannot be swapped silently);
- imports between subpackages follow the order of the README's code map, one way.
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
    assert rel(path) == "harp_src/model/adapter.py" or not hits, \
        f"{rel(path)} names layer modules at lines {hits}: ask the Adapter"


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
    # no cache: a cached verdict misses what a new top-level module changes (import sorting of `conftest`)
    out = subprocess.run([str(ruff), "check", "--no-cache", "harp_src", "tests", "notebooks"], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


# ---------------------------------------------------------------------------------------------- size and shape (26)
MAX_CODE_LINES, MAX_FUNCTION_LINES, MAX_PARAMETERS = 400, 60, 6


def code_lines(path: Path) -> int:
    """Lines that are neither blank nor only a comment (docstrings count)."""
    return sum(1 for line in path.read_text().splitlines() if line.strip() and not line.strip().startswith("#"))


def functions(path: Path) -> list[ast.FunctionDef]:
    return [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def parameters(fn: ast.FunctionDef) -> tuple[int, int]:
    """(parameters that can be passed by position, all parameters), self / cls left out."""
    positional = [a.arg for a in fn.args.posonlyargs + fn.args.args if a.arg not in ("self", "cls")]
    return len(positional), len(positional) + len(fn.args.kwonlyargs)


def test_capability_subpackages_and_few_top_level_modules():
    subpackages = [p.parent.name for p in PACKAGE.glob("*/__init__.py") if p.parent.name != "studies"]
    top = [p.name for p in PACKAGE.glob("*.py")]
    assert len(subpackages) >= 4 and len(top) <= 6, (subpackages, top)


@pytest.mark.parametrize("path", SOURCES, ids=rel)
def test_modules_and_functions_stay_small(path):
    assert code_lines(path) <= MAX_CODE_LINES, f"{rel(path)} has {code_lines(path)} code lines"
    for fn in functions(path):
        lines = fn.end_lineno - min([fn.lineno] + [d.lineno for d in fn.decorator_list]) + 1
        assert lines <= MAX_FUNCTION_LINES, f"{rel(path)}:{fn.lineno} {fn.name} has {lines} lines"
        positional, total = parameters(fn)
        limit = total if "studies" in path.parts else positional
        assert limit <= MAX_PARAMETERS, f"{rel(path)}:{fn.lineno} {fn.name} takes {limit} parameters"


def code_map_order() -> list[str]:
    """The subpackages in the order of the README's code map (the fenced tree under "## The library"), lowest
    first."""
    readme = (ROOT / "README.md").read_text()
    block = readme[readme.index("## The library"):].split("```")[1]
    return [m.group(1) for m in re.finditer(r"^[├└]──\s*(\w+)/", block, re.M)]


def imported_subpackages(path: Path) -> set[str]:
    """The other top-level parts of harp_src (subpackages, or top modules as "name.py") this module imports."""
    here = path.relative_to(PACKAGE).parts
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = list(here[:-1])[: len(here) - node.level]
            target = base + (node.module.split(".") if node.module else [])
            if target:
                name = target[0]
                out.add(f"{name}.py" if (PACKAGE / f"{name}.py").exists() else name)
    return out - {here[0] if len(here) > 1 else here[0]}


def test_subpackage_imports_follow_the_code_map():
    order = code_map_order()
    found = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert set(order) == found, f"README code map lists {order}; the package has {sorted(found)}"
    rank = {name: k for k, name in enumerate(order)}
    for path in SOURCES:
        here = path.relative_to(PACKAGE).parts
        if len(here) == 1:
            continue  # the top modules (__init__, __main__, runner, checkpoints) sit above every subpackage
        for other in imported_subpackages(path):
            if other.endswith(".py"):
                assert other == "checkpoints.py" and here[0] == "studies", f"{rel(path)} imports {other}"
            else:
                assert rank[other] < rank[here[0]], f"{rel(path)} ({here[0]}) imports {other}, which comes later"
    assert order[-1] == "studies"
