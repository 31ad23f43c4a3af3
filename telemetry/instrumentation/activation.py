"""Whether telemetry is active, and the observer an adapted optimizer gets while it is.

Light on purpose: the observer source asks :func:`telemetry_active` for every optimizer adapted
with telemetry off, so this imports nothing of OpenTelemetry and the observer only on first use.
The instrumentor sets :data:`instrumented`; the package facade re-exports the functions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .. import env
from ..env import telemetry_enabled

if TYPE_CHECKING:
    import torch

    from .observer import OptimizerObserver

# Set by FSDPOptimizerInstrumentor while instrumented: the providers it was given (either may be
# None: the global one, else the embedded default). Kept in this light module so that deciding
# "off" imports nothing of OpenTelemetry.
instrumented: dict[str, Any] | None = None


def telemetry_active() -> bool:
    """Whether optimizers adapted now get telemetry: instrumented, or ``FSDP_PATCH_TELEMETRY`` on.

    Raises:
        ValueError: ``FSDP_PATCH_TELEMETRY`` has an unaccepted value.
    """
    return telemetry_enabled() or instrumented is not None


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
        raise ModuleNotFoundError(
            f"fsdp_patch telemetry is on ({env.TELEMETRY}=1 or instrumented), but {missing}; "
            f"set {env.TELEMETRY}=0 to train without it"
        )
    from .observer import OptimizerObserver

    given = instrumented or {}
    return OptimizerObserver(
        optimizer,
        precision_aware=precision_aware,
        tracer_provider=given.get("tracer_provider"),
        meter_provider=given.get("meter_provider"),
        step_count=step_count,
    )
