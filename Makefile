# Two commands: `make train` and `make test`. Both build .venv when it is
# missing or older than the requirements files.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: train test lint format bench clean

$(VENV)/.runtime: requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps -e .
	touch $@

$(VENV)/.dev: $(VENV)/.runtime requirements-dev.txt
	$(PY) -m pip install --quiet -r requirements-dev.txt
	touch $@

train: $(VENV)/.runtime
	$(PY) -m moe_jax.train

test: $(VENV)/.dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest --durations=15

lint: $(VENV)/.dev
	$(VENV)/bin/ruff check .

format: $(VENV)/.dev
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

bench: $(VENV)/.runtime
	$(PY) bench/moe_layer.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
