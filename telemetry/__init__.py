"""OpenTelemetry instrumentation of fsdp_patch's optimizer adapter (opt-in: ``FSDP_PATCH_TELEMETRY=1``).

Importing this package, calling :func:`telemetry_enabled` or :func:`shutdown`, and naming
:class:`PrecisionView` import no OpenTelemetry module: with telemetry off, ``fsdp_patch``
must not pay for (or depend on) OpenTelemetry. :class:`OptimizerObserver` is imported on
first access. See ``telemetry/README.md`` for variables, exporters and the instrument table.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from .env import telemetry_enabled

if TYPE_CHECKING:
    from .observer import OptimizerObserver, StepScope
    from .precision import PrecisionSnapshot, PrecisionView

__all__ = ["OptimizerObserver", "PrecisionView", "shutdown", "telemetry_enabled"]

_LAZY = {
    "OptimizerObserver": f"{__name__}.observer",
    "StepScope": f"{__name__}.observer",
    "PrecisionView": f"{__name__}.precision",
    "PrecisionSnapshot": f"{__name__}.precision",
}


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value


def shutdown() -> None:
    """Flush and shut down the providers this package installed; idempotent, and free when none were."""
    providers = sys.modules.get(f"{__name__}.providers")
    if providers is not None:
        providers.shutdown()
