# Two commands: `make train` and `make test`. Both build .venv when it is
# missing, older than the requirements files, or made by a Python older than 3.12.
VENV := .venv
PY := $(VENV)/bin/python

# moe_jax needs Python 3.12+. Every candidate is run, not just looked up: `python3`
# may be older, and pyenv's `python3.12` shim exists but fails unless pyenv selects it.
PY_CHECK := -c 'import sys; assert sys.version_info >= (3, 12); print(sys.executable)'
# The first candidate that works, else stop with one line.
find_python = $(or $(shell for p in $(PY_CANDIDATES); do "$$p" $(PY_CHECK) 2>/dev/null && break; \
  done),$(error $(PY_MISSING)))
ifneq ($(filter command line environment,$(origin PYTHON)),)
  # Given by the user: the only candidate, checked on every run.
  PY_CANDIDATES = $(PYTHON)
  PY_MISSING = PYTHON=$(PYTHON) is not a working Python 3.12 or newer, which moe_jax needs
  BASE_PYTHON := $(find_python)
else
  # Searched only when .venv is (re)built; 3.12 first (what the GPU machines run), then
  # newer ones, then pyenv's installed interpreters in the same order.
  PY_CANDIDATES = python3.12 python3.13 python3 $$(for root in "$$(pyenv root 2>/dev/null)" \
    "$$HOME/.pyenv"; do ls -d "$$root"/versions/3.1[2-9]*/bin/python 2>/dev/null | sort -V; done)
  PY_MISSING = moe_jax needs Python 3.12 or newer; install it (e.g. apt-get install python3.12 \
    python3.12-venv, or pyenv install 3.12) or pass PYTHON=/path/to/python3.12
  BASE_PYTHON = $(find_python)
endif
# A .venv of an older (or vanished) Python is rebuilt, even when its stamps are newer.
VENV_OK := $(shell $(PY) $(PY_CHECK) >/dev/null 2>&1 && echo yes)
# pip does not precompile every installed module: Python compiles the ones imported, once
# (it halves the install time; transformers alone ships thousands of unused modules).
PIP_INSTALL := -m pip install --quiet --no-compile
# "Once" needs Python to keep what it compiled: an environment that sets
# PYTHONDONTWRITEBYTECODE (some CI images do) would make every process compile jax, flax
# and the rest again, 3.4 s each (moe_jax.trainer's imports: 6.2 s -> 2.8 s; torch and
# transformers 8.8 s -> 3.9 s), and the tests start a few hundred processes.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: train test lint format bench gpu-wheels clean FORCE

$(VENV)/.runtime: requirements.txt pyproject.toml $(if $(VENV_OK),,FORCE)
	$(if $(VENV_OK),,rm -rf $(VENV) && $(BASE_PYTHON) -m venv $(VENV))
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) $(PIP_INSTALL) -r requirements.txt
	$(PY) $(PIP_INSTALL) --no-deps -e .
	touch $@

$(VENV)/.dev: $(VENV)/.runtime requirements-dev.txt
	$(PY) $(PIP_INSTALL) -r requirements-dev.txt
	touch $@

# The transformers side of the parity tests: Python 3.11, where torch's CPU wheel is a
# small download (requirements-hf.txt says why). The first working candidate is used.
HF_VENV := .venv-hf
HF_PY_CHECK := -c 'import sys; assert sys.version_info[:2] == (3, 11)'
HF_CANDIDATES = python3.11 python3 $$(for root in "$$(pyenv root 2>/dev/null)" "$$HOME/.pyenv"; \
  do ls -d "$$root"/versions/3.11*/bin/python 2>/dev/null; done)
$(HF_VENV)/.ready: requirements-hf.txt
	rm -rf $(HF_VENV)
	@for p in $(HF_CANDIDATES); do "$$p" $(HF_PY_CHECK) 2>/dev/null && exec "$$p" -m venv $(HF_VENV); \
	  done; echo "the parity tests need Python 3.11 (e.g. pyenv install 3.11)"; exit 1
	$(HF_VENV)/bin/python $(PIP_INSTALL) -r requirements-hf.txt
	touch $@

train: $(VENV)/.runtime
	$(PY) -m moe_jax.train

# The tests run under jemalloc where it is installed (Debian's libjemalloc2; .ci/run
# installs it): XLA's compiles, most of the tests' time, take a fifth less than under
# glibc's malloc (four layout tests' programs: 14.7 s -> 11.6 s).
JEMALLOC := $(firstword $(wildcard /usr/lib/*/libjemalloc.so.2 /usr/lib64/libjemalloc.so.2))

# The two environments are built side by side: each is one pip, which uses one core.
test:
	@$(MAKE) --no-print-directory -j2 $(VENV)/.dev $(HF_VENV)/.ready
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(if $(JEMALLOC),LD_PRELOAD=$(JEMALLOC)) $(PY) -m pytest -n 2 --dist loadfile \
	  --no-loadscope-reorder --durations=25

lint: $(VENV)/.dev
	$(VENV)/bin/ruff check .

format: $(VENV)/.dev
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

bench: $(VENV)/.runtime
	$(PY) bench/moe_layer.py

# The wheels an offline GPU machine lacks, into .whl/ (git-ignored); how to install them
# there: docs/kernels-and-benchmarks.md#gpu-checks.
gpu-wheels:
	sh bench/gpu_wheels.sh .whl

clean:
	rm -rf $(VENV) $(HF_VENV) .pytest_cache .ruff_cache
