"""What the export tests share (``test_telemetry_export.py``, ``test_exporter_selection.py``,
``test_export_isolation.py``): fake steps through an observer, the trace a run wrote, the warnings
telemetry logged.
"""

from __future__ import annotations

import json
import logging

import torch
from fsdp_patch.telemetry import OptimizerObserver, semconv
from telemetry_testing import Group, run_fake_step

STEP_NAMES = {semconv.SPAN_STEP, *semconv.STEP_PHASE_SPANS} - {semconv.SPAN_PRECISION}


def group() -> Group:
    main = torch.linspace(0.5, 1.5, 32)
    return Group(main, main.to(torch.bfloat16), torch.ones(32, dtype=torch.bfloat16))


def run_steps(observer: OptimizerObserver, steps: int = 3) -> None:
    g = group()
    for _ in range(steps):
        run_fake_step(observer, [g], [g.main_weight + 0.25], cast_bytes=64)


def telemetry_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def load_trace(path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return json.load(f)["traceEvents"]
