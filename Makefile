# TRACE developer entry points. Every target creates/updates the local virtual
# environment by itself, so a fresh clone needs only `make demo` / `make test`.
#
# CPU (default): torch is constrained to the CPU wheel (constraints/cpu.txt).
# GPU: `make GPU=1 test` builds the venv on top of the system's own CUDA torch
#      (--system-site-packages, no torch constraint) and never replaces it.

PYTHON ?= python3
VENV   ?= .venv
GPU    ?= 0
PY      = $(VENV)/bin/python

ifeq ($(GPU),1)
VENV_FLAGS  = --system-site-packages
CONSTRAINTS =
else
VENV_FLAGS  =
CONSTRAINTS = -c constraints/cpu.txt
endif

STAMP = $(VENV)/.trace-installed

.PHONY: venv test test-unit demo lint fmt protos clean

venv: $(STAMP)

$(STAMP): pyproject.toml constraints/cpu.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV_FLAGS) $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(CONSTRAINTS) -e '.[dev]'
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

test-unit: $(STAMP)
	$(PY) -m pytest -q tests/unit

demo: $(STAMP)
	$(VENV)/bin/trace-rl demo

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

fmt: $(STAMP)
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

protos: $(STAMP)
	$(PY) protos/generate.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
