PYTHON ?= python3

.PHONY: setup demo test bench

setup:
	PYTHON=$(PYTHON) bash scripts/setup.sh

# Sets up, then runs the main job on its embedded default (2 ranks on CPU, no server needed).
demo: setup
	$(PYTHON) -m examples.main_job

# Sets up (with promtool, which the dashboard tests run), then runs the whole test suite.
test: setup
	bash dashboards/install_promtool.sh
	$(PYTHON) -m pytest

bench: setup
	$(PYTHON) -m benchmarks.telemetry_overhead
