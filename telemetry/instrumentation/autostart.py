"""What the start-up hook does once torch is imported with ``FSDP_PATCH_TELEMETRY`` set (``startup/``)."""

from __future__ import annotations

import sys

from ..env import telemetry_enabled

__all__ = ["instrument_from_environment"]

# Present while opentelemetry-instrument's sitecustomize runs: that command instruments every
# instrumentor of its entry point group itself, ours included, after configuring the SDK.
_AUTO_INSTRUMENTATION = "opentelemetry.instrumentation.auto_instrumentation"


def instrument_from_environment() -> None:
    """Instrument :class:`~.instrumentor.FSDPOptimizerInstrumentor`, unless already (or about to be) instrumented.

    Raises:
        ValueError: ``FSDP_PATCH_TELEMETRY`` has an unaccepted value.
    """
    if not telemetry_enabled() or _AUTO_INSTRUMENTATION in sys.modules:
        return
    from .instrumentor import FSDPOptimizerInstrumentor

    instrumentor = FSDPOptimizerInstrumentor()
    if not instrumentor.is_instrumented_by_opentelemetry:
        instrumentor.instrument()
