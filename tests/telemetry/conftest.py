"""Fixtures: a clean environment, reset OpenTelemetry globals, and in-memory providers.

Injection: tests hand ``otel.tracer_provider`` / ``otel.meter_provider`` to
``OptimizerObserver(..., tracer_provider=..., meter_provider=...)`` (the ``observer``
fixture does), or install providers globally after ``reset_otel_globals`` ran, to
exercise the package's own provider resolution.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from telemetry_testing import InMemoryTelemetry, fake_optimizer, in_memory_telemetry, reset_otel_globals


@pytest.fixture(autouse=True)
def clean_telemetry_state(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> Iterator[None]:
    """No inherited FSDP_PATCH_*/OTEL_*/torchrun variables, trace files under tmp_path, fresh globals."""
    for name in list(os.environ):
        if name.startswith(("FSDP_PATCH_", "OTEL_")) or name in (
            "RANK",
            "LOCAL_RANK",
            "WORLD_SIZE",
            "TORCHELASTIC_RUN_ID",
        ):
            monkeypatch.delenv(name)
    monkeypatch.setenv("FSDP_PATCH_TRACE_DIR", str(tmp_path / "traces"))
    from fsdp_patch.telemetry.export import providers

    providers.reset()
    reset_otel_globals()
    yield
    providers.reset()
    reset_otel_globals()


@pytest.fixture
def otel() -> Iterator[InMemoryTelemetry]:
    """Tracer and meter providers backed by InMemorySpanExporter and InMemoryMetricReader."""
    telemetry = in_memory_telemetry()
    yield telemetry
    telemetry.tracer_provider.shutdown()
    telemetry.meter_provider.shutdown()


@pytest.fixture
def make_observer(otel: InMemoryTelemetry) -> Callable[..., Any]:
    """Factory of observers wired to the ``otel`` providers."""
    from fsdp_patch.telemetry import OptimizerObserver

    def make(optimizer: Any = None, precision_aware: bool = False) -> Any:
        return OptimizerObserver(
            optimizer if optimizer is not None else fake_optimizer(),
            precision_aware=precision_aware,
            tracer_provider=otel.tracer_provider,
            meter_provider=otel.meter_provider,
        )

    return make
