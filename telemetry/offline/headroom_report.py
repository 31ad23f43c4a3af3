"""The headroom forecasts of a run's trace files: units whose output nears its dtype's largest value.

Reads ``fsdp.precision.headroom_forecast`` events (:mod:`fsdp_patch.telemetry.diagnostics.headroom`)
of every rank, merged: one :class:`ForecastSeen` per unit and dtype, the earliest step any rank
forecast it, with every rank that did. No torch and no OpenTelemetry here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .. import semconv
from .rank_merge import merge

__all__ = ["ForecastSeen", "HeadroomTrace", "forecast_json", "forecast_text"]


@dataclass
class ForecastSeen:
    """One unit's forecast, with every rank that made it."""

    unit: str
    dtype: str
    step: int
    amax: float
    limit: float
    steps_left: int
    first_step: int
    first_amax: float
    ranks: set[int] = field(default_factory=set)


@dataclass
class HeadroomTrace:
    """Every unit forecast to reach its dtype's largest value, by (unit, dtype)."""

    seen: dict[tuple[str, str], ForecastSeen] = field(default_factory=dict)

    def feed_instant(self, args: Mapping[str, Any], name: str) -> None:
        """Take an instant event of a trace file (``name`` its event name)."""
        if name != semconv.EVENT_HEADROOM_FORECAST:
            return
        values = [
            args.get(key)
            for key in (semconv.ATTR_STEP, semconv.ATTR_HEADROOM_STEPS_LEFT, semconv.ATTR_HEADROOM_FROM_STEP)
        ]
        numbers = [
            args.get(key)
            for key in (semconv.ATTR_HEADROOM_AMAX, semconv.ATTR_HEADROOM_LIMIT, semconv.ATTR_HEADROOM_FROM_AMAX)
        ]
        if not all(isinstance(v, int) for v in values) or not all(isinstance(v, int | float) for v in numbers):
            return
        step, left, first_step = (int(v) for v in values)  # type: ignore[arg-type]
        amax, limit, first_amax = (float(v) for v in numbers)  # type: ignore[arg-type]
        seen = ForecastSeen(
            str(args.get(semconv.ATTR_UNIT, "")),
            str(args.get(semconv.ATTR_HEADROOM_DTYPE, "")),
            step,
            amax,
            limit,
            left,
            first_step,
            first_amax,
        )
        key = (seen.unit, seen.dtype)
        merge(self.seen, key, seen, lambda new, held: new.step < held.step, args.get(semconv.ATTR_RANK))

    def forecasts(self) -> list[ForecastSeen]:
        """Earliest first, then nearest overflow first."""
        return sorted(self.seen.values(), key=lambda f: (f.step, f.steps_left))


def forecast_text(seen: ForecastSeen, step_offset: int = 0) -> str:
    """One line: the unit, its growth over the fit, and when it overflows at that rate."""
    unit = f"unit '{seen.unit}'" if seen.unit else "the root unit"
    ranks = ", ".join(str(r) for r in sorted(seen.ranks)) or "?"
    return (
        f"{unit} output ({seen.dtype}): |x| {seen.first_amax:.4g} at step {seen.first_step + step_offset}, "
        f"{seen.amax:.4g} at step {seen.step + step_offset}: reaches {seen.dtype}'s largest value "
        f"{seen.limit:.6g} in about {seen.steps_left} steps at this rate; rank{'s' if len(seen.ranks) != 1 else ''} "
        f"{ranks}"
    )


def forecast_json(seen: ForecastSeen, step_offset: int = 0) -> dict[str, Any]:
    return {
        "unit": seen.unit,
        "dtype": seen.dtype,
        "step": seen.step + step_offset,
        "amax": seen.amax,
        "limit": seen.limit,
        "steps_left": seen.steps_left,
        "from_step": seen.first_step + step_offset,
        "from_amax": seen.first_amax,
        "ranks": sorted(seen.ranks),
    }
