# Every target runs from the project's virtual environment: the active one ($VIRTUAL_ENV), else
# .venv here, made by scripts/setup.sh with $(PYTHON) (python3 by default). Afterwards:
# `. .venv/bin/activate` puts `fsdp-patch` and `python` with fsdp_patch on PATH.
PYTHON ?= python3
VENV := $(if $(VIRTUAL_ENV),$(VIRTUAL_ENV),.venv)
VENV_PYTHON := $(VENV)/bin/python
# Re-installed when the package's metadata or the set-up changes (sources are installed editable).
SETUP_STAMP := $(VENV)/.fsdp_patch-setup

.PHONY: setup demo test bench gpu-check

setup: $(SETUP_STAMP)

$(SETUP_STAMP): pyproject.toml scripts/setup.sh
	PYTHON=$(PYTHON) bash scripts/setup.sh
	touch $@

# Sets up, then runs the main job on its embedded default (2 ranks on CPU, no server needed).
demo: setup
	$(VENV)/bin/fsdp-patch demo

# Sets up (with promtool, which the dashboard tests run), then runs the whole test suite.
test: setup
	bash dashboards/install_promtool.sh
	$(VENV_PYTHON) -m pytest

# The benchmark suite: every case's table of side-by-side ratios; JSON into benchmarks/results/.
bench: setup
	$(VENV_PYTHON) -m benchmarks

# The prepared GPU check (CUDA tests, demo under torchrun on NCCL, GPU benchmarks); on a machine
# without CUDA it runs what it can and says what it skipped.
gpu-check: setup
	PYTHON=$(VENV_PYTHON) bash scripts/gpu_check.sh
