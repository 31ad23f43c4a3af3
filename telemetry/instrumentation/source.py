"""Telemetry's observer source: what the adapter asks when it adapts an optimizer.

Registered into ``fsdp_patch.adapter.observer_source`` when this package is imported. It gives
an optimizer an :class:`~.observer.OptimizerObserver` while telemetry is active
(``FSDP_PATCH_TELEMETRY`` on, or instrumented) and none otherwise, and words the cross-rank
settings error, since the settings it checks are this package's variables.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from .. import env, semconv
from .activation import observer_for, telemetry_active

if TYPE_CHECKING:
    import torch

    from fsdp_patch.adapter.events import StepObserver

__all__ = ["TelemetrySource", "describe_settings"]


def describe_settings(values: Sequence[Sequence[int]]) -> str:
    """The message of ``CollectiveSettingsError``: each rank's ``(telemetry on, interval, detail, escalation)``."""
    telemetry = ", ".join(f"rank {r} {'on' if v[0] else 'off'}" for r, v in enumerate(values))
    every = ", ".join(f"rank {r} {v[1]}" + (" (off)" if not v[1] else "") for r, v in enumerate(values))
    detail = ", ".join(f"rank {r} {'on' if v[2] else 'off'}" for r, v in enumerate(values))
    escalation = ", ".join(f"rank {r} {v[3] if len(v) > 3 else 0}" for r, v in enumerate(values))
    checks = ", ".join(f"rank {r} {'on' if len(v) > 4 and v[4] else 'off'}" for r, v in enumerate(values))
    return (
        "fsdp_patch: ranks of this optimizer's process group disagree on settings that change "
        f"collectives. Telemetry ({env.TELEMETRY}, or running under opentelemetry-instrument): {telemetry}. "
        f"Precision diagnostics every N steps ({env.PRECISION_EVERY}; 0 when telemetry is off or "
        f"OTEL_SDK_DISABLED=true): {every}. Per-parameter detail ({semconv.SETTING_PRECISION_TOP_K} "
        f"above 0): {detail}. Escalation ({semconv.SETTING_PRECISION_ESCALATION}; 0 when telemetry is off): "
        f"{escalation}. Per-iteration checks ({semconv.SETTING_PRECISION_ORIGIN}; off when telemetry or the "
        f"diagnostics are): {checks}. Expected the same values on every rank: set these variables (and "
        "opentelemetry-instrument) alike for all ranks."
    )


class TelemetrySource:
    """The :class:`fsdp_patch.adapter.observer_source.ObserverSource` of this package."""

    def observer_factory(
        self, optimizer: torch.optim.Optimizer, precision_aware: bool
    ) -> Callable[[], StepObserver] | None:
        if not telemetry_active():
            return None

        def factory() -> StepObserver:
            return observer_for(optimizer, precision_aware)

        return factory

    def describe_settings(self, values: Sequence[Sequence[int]]) -> str:
        return describe_settings(values)
