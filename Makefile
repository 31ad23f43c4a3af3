# Every target runs from the project's virtual environment: the active one ($VIRTUAL_ENV), else
# .venv here, made by scripts/setup.sh with $(PYTHON) (python3 by default). Afterwards:
# `. .venv/bin/activate` puts `fsdp-patch` and `python` with fsdp_patch on PATH.
PYTHON ?= python3
VENV := $(if $(VIRTUAL_ENV),$(VIRTUAL_ENV),.venv)
VENV_PYTHON := $(VENV)/bin/python
# Re-installed when the package's metadata or the set-up changes (sources are installed editable).
SETUP_STAMP := $(VENV)/.fsdp_patch-setup

# The oldest releases fsdp_patch supports: torch OLDEST_TORCH and the OpenTelemetry releases pinned
# in OLDEST_OPENTELEMETRY (pyproject.toml's floors). `make test-oldest` runs, in the environment
# .venv-oldest of its own (a CUDA build of torch, a few GB to download once), TORCH_RANGE_TESTS and
# OPENTELEMETRY_SEAM_TESTS on them; CI (.ci/run) runs it after `make test`. The main environment
# has the newest releases the package index offers at set-up.
# TORCH_RANGE_TESTS: the tests of what reads torch's internals or depends on how a torch release
# behaves (torch_compat's features; fully_shard's collectives, DTensors, hooks, meta init, DCP and
# torch.compile; the adapter's foreach ops; telemetry's hooks into FSDP2's parameter groups and
# root state, through the per-iteration checks and the step accounting). OPENTELEMETRY_SEAM_TESTS:
# what uses the OpenTelemetry API and SDK (the observer's spans and metrics on in-memory readers,
# the exporters, exporter selection against the SDK's configurator, the embedded default's life
# cycle, the instrumentor, the distro and `opentelemetry-instrument`). Left out there, so that CI
# stays within its time: what uses neither torch internals nor OpenTelemetry (reports, settings,
# dashboards, the demo's command line, the set-up script, the conventions page), the attribution
# over FSDP2 (whose FSDP2 side is the parameter-group reading tested above), the installed-package
# test (it builds its own environment), the end-to-end runs of the benchmark suite and the GPU
# check, the `long` and `slow` tests (inductor's compile among them: torch.compile stays, through
# aot_eager), and the 4-rank variants (uneven shards are the same on any torch; 2 ranks exercise
# the collectives). `make test-torch TORCH=X.Y.Z` runs TORCH_RANGE_TESTS on any other torch
# release, with the newest OpenTelemetry, in .venv-torchX.Y.Z.
OLDEST_TORCH ?= 2.11.0
OLDEST_OPENTELEMETRY := scripts/oldest-opentelemetry.txt
TORCH_RANGE_TESTS := tests/fsdp tests/optimizer tests/test_torch_compat.py \
	tests/integration/test_fsdp2_telemetry.py tests/integration/test_origin.py \
	tests/integration/test_step_accounting.py tests/test_fsdp2_api_coverage.py
OPENTELEMETRY_SEAM_TESTS := tests/telemetry tests/test_sdk_exporter_entry_points.py \
	tests/integration/test_opentelemetry_instrument.py
OLDEST_STAMP := .venv-oldest/.fsdp_patch-setup-torch$(OLDEST_TORCH)

.PHONY: setup demo test test-torch test-oldest test-long lint typecheck docs bench gpu-check

setup: $(SETUP_STAMP)

$(SETUP_STAMP): pyproject.toml scripts/setup.sh
	PYTHON=$(PYTHON) bash scripts/setup.sh --venv $(VENV)
	touch $@

$(OLDEST_STAMP): pyproject.toml scripts/setup.sh $(OLDEST_OPENTELEMETRY)
	PYTHON=$(PYTHON) bash scripts/setup.sh --venv .venv-oldest --torch $(OLDEST_TORCH) --constraints $(OLDEST_OPENTELEMETRY)
	touch $@

.venv-torch%/.fsdp_patch-setup: pyproject.toml scripts/setup.sh
	PYTHON=$(PYTHON) bash scripts/setup.sh --venv .venv-torch$* --torch $*
	touch $@

# Sets up, then runs the main job on its embedded default (2 ranks on CPU, no server needed).
demo: setup
	$(VENV)/bin/fsdp-patch demo

# Sets up (with promtool, which the dashboard tests run, and Chromium, which opens the HTML report),
# checks lint, formatting, types and the documentation's build, then runs the test suite but its
# `long` tests: a few minutes on 2 cores. CI (.ci/run) then runs `make test-oldest` and `make test-long`.
test: setup lint typecheck docs
	bash dashboards/install_promtool.sh
	bash scripts/install_chromium.sh
	$(VENV_PYTHON) -m pytest -m "not long"

# ruff's rules and formatting (`make lint`) and mypy over fsdp_patch/ and telemetry/ (`make
# typecheck`), both part of `make test`, configured in pyproject.toml; the tools come with the dev
# extras.
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: setup
	$(VENV)/bin/mypy

# The documentation (mkdocs.yml, docs/) built in strict mode: a broken link or anchor, a page left
# out of the navigation, or a results table whose JSON is missing fails it. The site goes to site/.
docs: setup
	$(VENV)/bin/mkdocs build --strict --site-dir site

test-oldest:
	$(MAKE) --no-print-directory $(OLDEST_STAMP)
	@echo "== the torch-range and OpenTelemetry-seam tests on torch $(OLDEST_TORCH) and $(OLDEST_OPENTELEMETRY) (.venv-oldest)"
	.venv-oldest/bin/python -m pytest -m "not long and not slow" -k "not ws4" $(TORCH_RANGE_TESTS) $(OPENTELEMETRY_SEAM_TESTS)

test-torch:
	@[ -n "$(TORCH)" ] || { echo "make test-torch: say which torch release, e.g. make test-torch TORCH=2.15.0" >&2; exit 2; }
	$(MAKE) --no-print-directory .venv-torch$(TORCH)/.fsdp_patch-setup
	@echo "== the torch-range tests on torch $(TORCH) (.venv-torch$(TORCH))"
	.venv-torch$(TORCH)/bin/python -m pytest -m "not long and not slow" -k "not ws4" $(TORCH_RANGE_TESTS)

# The tests marked `long`, past `make test`'s budget: what runs another program end to end (the
# installed package in a fresh environment, the demo against Prometheus and against a collector that
# stops answering, HF Accelerate/Trainer and Lightning with the variable alone, torchrun as two
# nodes, the benchmark suite's every case, the GPU check script), every demo scenario through the
# command, the healthy controls diagnosed every step, and the determinism soak at a small size.
# CI (.ci/run) runs it after `make test`.
test-long: setup
	bash dashboards/install_promtool.sh promtool prometheus
	$(VENV_PYTHON) -m pytest -m long

# The benchmark suite: every case's table of side-by-side ratios; JSON into benchmarks/results/.
bench: setup
	$(VENV_PYTHON) -m benchmarks

# The GPU check (CUDA tests, demo under torchrun on NCCL, GPU benchmarks); on a machine without
# CUDA it runs what it can and says what it skipped. Its summary, logs and JSON go to GPU_CHECK_OUT.
GPU_CHECK_OUT ?= benchmarks/results/gpu-check
gpu-check: setup
	bash scripts/gpu_check.sh --python $(VENV_PYTHON) --out $(GPU_CHECK_OUT)
