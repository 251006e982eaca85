"""The conclusion cells' numbers come from the run: each is found, at its printed precision, in that notebook's
results in figures/ (or is one of its parameters, a fact of its models or of the paper). A stale number fails."""

import json

import pytest
import transformers

from harp_src.model.adapter import fingerprint
from harp_src.model.loading import resolve_source
from harp_src.model.paper import paper_numbers
from harp_src.report.claims import claims_in, conclusion_cells, numbers_of, unmatched_claims
from harp_src.report.params import NOTEBOOKS
from harp_src.runner import profile_parameters

SOURCES = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))


def model_facts(names: list[str]) -> list[float]:
    """Depth, widths, head counts and vocabulary of the models a notebook ran (those installed here)."""
    out = []
    for name in names:
        try:
            config = transformers.AutoConfig.from_pretrained(resolve_source(name)[0])
        except (OSError, ValueError, ImportError):
            continue  # e.g. Qwen2.5-1.5B without `make setup-full`: its facts cannot back a claim here
        text = config.get_text_config()
        out += numbers_of(fingerprint(config)) + [text.intermediate_size, text.vocab_size, text.vocab_size / 1e3]
    return out


def known_numbers(stem: str) -> list[float]:
    params = profile_parameters("full", stem)
    return numbers_of(params) + model_facts(params.get("MODELS", [])) + paper_numbers()


@pytest.mark.parametrize("path", SOURCES, ids=[p.stem for p in SOURCES])
def test_every_number_in_the_conclusion_comes_from_the_run(path):
    cells = conclusion_cells(json.loads(path.read_text()))
    assert len(cells) == 1, f"{path.name} needs one markdown cell tagged 'conclusion', has {len(cells)}"
    assert unmatched_claims(cells[0], path.stem[:2], known_numbers(path.stem)) == []


def test_a_stale_number_fails():
    path = NOTEBOOKS / "08_evaluation.ipynb"
    text = conclusion_cells(json.loads(path.read_text()))[0]
    claim = next(c for c in claims_in(text) if c.decimals >= 2)
    doctored = text.replace(claim.text, "0.98765", 1)
    assert unmatched_claims(doctored, "08", known_numbers(path.stem)) == ["0.98765"]


def test_what_counts_as_a_number():
    found = [c.text for c in claims_in("SmolLM2-135M top-8 at 2k: −0.107 [−0.142, −0.074], 14/24, 1,327,104 and "
                                       "`top:8`, 3.5 %")]
    assert found == ["−0.107", "−0.142", "−0.074", "14", "24", "1,327,104", "3.5"]
    assert [c.percent for c in claims_in("a 3.5 % drop, 2 layers")] == [True, False]
