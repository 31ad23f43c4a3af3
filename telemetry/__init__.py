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
the names and settings (:mod:`.semconv`, :mod:`.env`, :mod:`.precision_thresholds`,
:mod:`.trace_limits`); :mod:`.offline` (trace files read back and the reports: no OpenTelemetry,
no torch); :mod:`.diagnostics` (the precision statistics: torch, no OpenTelemetry);
:mod:`.export` (the embedded SDK defaults); :mod:`.instrumentation` (the instrumentor, the
observer, the instruments, the adapter's observer source). This facade holds the instrumented
state, which only the top layer reads.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from fsdp_patch.adapter.observer_source import register_observer_source

from . import env
from .env import telemetry_enabled
from .instrumentation.source import TelemetrySource

if TYPE_CHECKING:
    import torch

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

# Set by FSDPOptimizerInstrumentor while instrumented: the providers it was given (either may be
# None: the global one, else the embedded default). Kept here so that deciding "off" needs no import.
_instrumented: dict[str, Any] | None = None


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value


def telemetry_active() -> bool:
    """Whether optimizers adapted now get telemetry: instrumented, or ``FSDP_PATCH_TELEMETRY`` on.

    Raises:
        ValueError: ``FSDP_PATCH_TELEMETRY`` has an unaccepted value.
    """
    return telemetry_enabled() or _instrumented is not None


# What telemetry imports of OpenTelemetry: the API it records through and the SDK of its defaults.
_OPENTELEMETRY_MODULES = {"opentelemetry.trace": "opentelemetry-api", "opentelemetry.sdk.trace": "opentelemetry-sdk"}


def opentelemetry_missing() -> str | None:
    """Why telemetry cannot run in this interpreter (an OpenTelemetry package it needs is not installed), or ``None``."""
    import importlib.util

    missing = []
    for module, package in _OPENTELEMETRY_MODULES.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except ImportError:  # a parent package is missing
            found = False
        if not found:
            missing.append(package)
    if not missing:
        return None
    return f"OpenTelemetry is not installed ({' and '.join(missing)} missing; installing fsdp-patch with its dependencies brings them)"


def observer_for(optimizer: torch.optim.Optimizer, precision_aware: bool, step_count: int = 0) -> OptimizerObserver:
    """The observer of a newly adapted (or re-instrumented) optimizer, with the instrumentor's providers if any.

    Raises:
        ModuleNotFoundError: OpenTelemetry is not installed.
    """
    missing = opentelemetry_missing()
    if missing is not None:
        raise ModuleNotFoundError(f"fsdp_patch telemetry is on ({env.TELEMETRY}=1 or instrumented), but {missing}; "
                                  f"set {env.TELEMETRY}=0 to train without it")  # fmt: skip
    from .instrumentation.observer import OptimizerObserver

    given = _instrumented or {}
    return OptimizerObserver(
        optimizer,
        precision_aware=precision_aware,
        tracer_provider=given.get("tracer_provider"),
        meter_provider=given.get("meter_provider"),
        step_count=step_count,
    )


# The adapter asks it whether each newly adapted optimizer gets an observer.
SOURCE = TelemetrySource()
register_observer_source(SOURCE)


def shutdown() -> None:
    """Flush and shut down the providers this package built; idempotent, and free when none were."""
    providers = sys.modules.get(f"{__name__}.export.providers")
    if providers is not None:
        providers.shutdown()
