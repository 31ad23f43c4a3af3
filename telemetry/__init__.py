"""OpenTelemetry instrumentation of fsdp_patch's optimizer adapter.

On with ``FSDP_PATCH_TELEMETRY=1`` (embedded default exporters, no configuration), or when
:class:`FSDPOptimizerInstrumentor` is instrumented, which ``opentelemetry-instrument`` does
through the ``opentelemetry_instrumentor`` entry point ``fsdp_patch``.

Importing this package registers its observer source into the adapter
(``fsdp_patch.adapter.observer_source``); it and calling :func:`telemetry_active`,
:func:`telemetry_enabled` or :func:`shutdown` import nothing of OpenTelemetry: with telemetry
off, ``fsdp_patch`` must not pay for (or depend on) it. With ``FSDP_PATCH_TELEMETRY`` unset the
adapter does not import this package at all. Everything else is imported on
first access. See ``telemetry/README.md`` for variables, exporters and the instrument table;
the names of spans, metrics and attributes are in :mod:`.semconv`.

Layers, each importing only those below it (``tests/test_telemetry_layers.py``), from the bottom:
the names and settings (:mod:`.semconv`, :mod:`.env`, :mod:`.precision_thresholds` with
:mod:`.verdicts` and :mod:`.event_thresholds`, :mod:`.trace_limits`); :mod:`.offline` (trace
files read back and the reports: no OpenTelemetry, no torch); :mod:`.diagnostics` (the precision
statistics: torch, no OpenTelemetry); :mod:`.export` (the embedded SDK defaults);
:mod:`.instrumentation` (the instrumentor, the observer, the instruments, the adapter's observer
source, whether telemetry is active). This facade re-exports; no module of the package imports
it back.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from fsdp_patch.adapter.observer_source import register_observer_source

from .env import telemetry_enabled
from .instrumentation.activation import observer_for, opentelemetry_missing, telemetry_active
from .instrumentation.source import TelemetrySource

if TYPE_CHECKING:
    from .diagnostics.groups import PrecisionSnapshot as PrecisionSnapshot
    from .diagnostics.groups import PrecisionView
    from .instrumentation.instrumentor import FSDPOptimizerInstrumentor
    from .instrumentation.observer import OptimizerObserver
    from .instrumentation.observer import StepScope as StepScope

__all__ = [
    "FSDPOptimizerInstrumentor",
    "OptimizerObserver",
    "PrecisionView",
    "observer_for",
    "opentelemetry_missing",
    "shutdown",
    "telemetry_active",
    "telemetry_enabled",
]

_LAZY = {
    "FSDPOptimizerInstrumentor": f"{__name__}.instrumentation.instrumentor",
    "OptimizerObserver": f"{__name__}.instrumentation.observer",
    "StepScope": f"{__name__}.instrumentation.observer",
    "PrecisionView": f"{__name__}.diagnostics.groups",
    "PrecisionSnapshot": f"{__name__}.diagnostics.groups",
}


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value


# The adapter asks it whether each newly adapted optimizer gets an observer.
SOURCE = TelemetrySource()
register_observer_source(SOURCE)


def shutdown() -> None:
    """Flush and shut down the providers this package built; idempotent, and free when none were."""
    providers = sys.modules.get(f"{__name__}.export.providers")
    if providers is not None:
        providers.shutdown()
