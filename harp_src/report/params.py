"""Notebook parameters: the parameters cell read from the notebook itself, its values checked against the types of
its defaults, and the frozen parameter object each study takes."""

from __future__ import annotations

import ast
import json
import types
import typing
from dataclasses import dataclass, fields
from pathlib import Path
from typing import ClassVar, Self

from .files import ROOT

# ---------------------------------------------------------------------------------------------- notebook parameters
NOTEBOOKS = ROOT / "notebooks"


def profile_names(notebooks: Path = NOTEBOOKS) -> list[str]:
    """The profiles a notebook may be run with: the files notebooks/profiles/NAME.yaml (quick, full, paper, ...)."""
    return sorted(p.stem for p in (notebooks / "profiles").glob("*.yaml"))


def parameters_source(notebook: str) -> str:
    """The source of the cell tagged `parameters` in notebooks/<notebook>.ipynb."""
    path = NOTEBOOKS / f"{notebook}.ipynb"
    if not path.exists():
        raise FileNotFoundError(f"no notebook {path}: pass the name of a notebook in notebooks/, without .ipynb")
    cells = json.loads(path.read_text())["cells"]
    tagged = [c for c in cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    if len(tagged) != 1:
        raise ValueError(f"{path.name} must have exactly one cell tagged 'parameters', found {len(tagged)}")
    source = tagged[0]["source"]
    return "".join(source) if isinstance(source, list) else source


def kinds_of_type(tp) -> tuple:
    """A type expression (`int`, `int | dict | None`, `list[str]`) -> accepted kinds; a kind is a type or
    ("list", element kinds)."""
    if isinstance(tp, types.UnionType):
        return tuple(k for arg in typing.get_args(tp) for k in kinds_of_type(arg))
    if typing.get_origin(tp) is list:
        return (("list", kinds_of_type(typing.get_args(tp)[0])),)
    if tp is None:
        return (type(None),)
    if isinstance(tp, type):
        return (tp,)
    raise TypeError(f"{tp!r} is not a type: use e.g. int, int | dict | None or list[str]")


def _kinds_of_default(value) -> tuple:
    """The kinds a default admits: its own type (an int where the default is a float), a list of its elements'."""
    if isinstance(value, bool):
        return (bool,)
    if isinstance(value, float):
        return (float, int)
    if isinstance(value, (list, tuple)):
        elements = tuple(dict.fromkeys(k for v in value for k in _kinds_of_default(v)))
        return (("list", elements),)
    return (type(value),)


def parameter_spec(source: str, **types_: object) -> dict[str, tuple]:
    """{NAME: accepted kinds} for each assignment of a parameters cell: the type of its default, or the type given
    for it in `types_` where the default alone does not say (`LIMIT=int | dict`, `EXTRA_CSV=list[str]`)."""
    spec = {}
    for stmt in ast.parse(source).body:
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            spec[stmt.targets[0].id] = _kinds_of_default(ast.literal_eval(stmt.value))
    unknown = set(types_) - set(spec)
    if unknown:
        raise ValueError(f"types given for {sorted(unknown)}, which the parameters cell does not set")
    return spec | {name: kinds_of_type(tp) for name, tp in types_.items()}


def _matches(value, kind) -> bool:
    if isinstance(kind, tuple):  # ("list", element kinds); no element kinds: any elements
        return isinstance(value, (list, tuple)) and (not kind[1] or all(
            any(_matches(v, k) for k in kind[1]) for v in value))
    if kind in (int, float) and isinstance(value, bool):
        return False
    return isinstance(value, kind)


def _describe(kinds: tuple) -> str:
    names = [f"a list of {' or '.join(_describe((e,)) for e in k[1]) or 'values'}" if isinstance(k, tuple)
             else "None" if k is type(None) else k.__name__ for k in kinds]
    return " or ".join(names)


def check_values(values: dict, spec: dict[str, tuple]) -> None:
    """Raise one clear error naming every value whose type `spec` (from parameter_spec) does not admit."""
    problems = [f"{name}={values[name]!r} must be {_describe(kinds)}" for name, kinds in spec.items()
                if name in values and not any(_matches(values[name], k) for k in kinds)]
    if problems:
        raise TypeError("bad notebook parameter: " + "; ".join(problems))
    if "PROFILE" in values and values["PROFILE"] not in profile_names():
        raise ValueError(f"PROFILE={values['PROFILE']!r}: choose one of {profile_names()} (notebooks/profiles/)")


def check_parameters(notebook: str, namespace: dict, **types_: object) -> None:
    """Fail a notebook's first code cell with one clear message when a (papermill) parameter has the wrong type.

    Args:
        notebook: the notebook's name in notebooks/ (e.g. "01_over_smoothing"); its parameters cell's defaults give
            the expected types.
        namespace: the notebook's `globals()`, holding the parameters' current values.
        types_: the type of a parameter whose default does not say it all, e.g. `LIMIT=int | dict`.
    """
    spec = parameter_spec(parameters_source(notebook), **types_)
    check_values({name: namespace[name] for name in spec if name in namespace}, spec)


# ---------------------------------------------------------------------------------------------- the study's object
NOTEBOOK_ONLY = ("PROFILE", "OUT_DIR")  # where results go: the notebook's business, not the study's


@dataclass(frozen=True)
class StudyParams:
    """Base of every study's parameter object: one frozen object instead of a long positional signature, so no two
    values can be swapped silently. Its fields are the notebook's parameters in lower case (MODELS → models); the
    notebook's parameters cell holds their defaults and, with `TYPES`, their types."""

    NOTEBOOK: ClassVar[str] = ""  # e.g. "06_baselines"
    TYPES: ClassVar[dict] = {}  # types a default does not say, e.g. {"LIMIT": int | dict}

    @classmethod
    def spec(cls) -> dict[str, tuple]:
        """{NAME: accepted kinds} of the notebook's parameters (see `parameter_spec`)."""
        return parameter_spec(parameters_source(cls.NOTEBOOK), **cls.TYPES)

    @classmethod
    def from_values(cls, values: dict) -> Self:
        """Build from {NAME: value} as the notebook names them; an unknown (mistyped) or missing name, or a value of
        the wrong type, is one clear error naming it."""
        names = {f.name.upper(): f.name for f in fields(cls)}
        unknown = [k for k in values if k not in names and k not in NOTEBOOK_ONLY]
        if unknown:
            raise ValueError(f"{cls.__name__} has no parameter {unknown[0]!r} (mistyped?); its parameters are "
                             f"{sorted(names)}")
        missing = [k for k in names if k not in values]
        if missing:
            raise ValueError(f"{cls.__name__} needs the parameter {missing[0]!r}; set it in notebook "
                             f"{cls.NOTEBOOK}'s parameters cell or the profile")
        check_values(values, cls.spec())
        return cls(**{names[k]: v for k, v in values.items() if k in names})

    @classmethod
    def from_notebook(cls, namespace: dict) -> Self:
        """The notebook's parameters, read from its `globals()` by the names its parameters cell sets, checked."""
        return cls.from_values({name: namespace[name] for name in cls.spec() if name in namespace})

    @classmethod
    def defaults(cls, **overrides) -> Self:
        """The parameters cell's own values (the quick profile), with `overrides` given by NAME."""
        namespace: dict = {}
        exec(parameters_source(cls.NOTEBOOK), {}, namespace)  # the cell is literal assignments (parameter_spec)
        return cls.from_values({**namespace, **overrides})


class OneWindowLength:
    """For a study whose windows are all SEQ_LEN tokens long and whose test windows number N_TEST: its windows under
    the names every step's setup uses (`compare.points.setup_of`: calib_len, n_eval, eval_len), so they keep one name
    from the study to the pruner. Mixed in before `StudyParams`; a study with another test count overrides n_eval."""

    @property
    def calib_len(self) -> int:
        return self.seq_len

    @property
    def n_eval(self) -> int:
        return self.n_test

    @property
    def eval_len(self) -> int:
        return self.seq_len
