"""Verdicts: the severities a check gives, and :class:`Threshold`, one check of a diagnostic value.

The rows themselves are :mod:`.precision_thresholds` (each diagnosed step's values, the one table
the Prometheus alerts share) and :mod:`.event_thresholds` (the report's checks of events and
spans). No torch and no OpenTelemetry here.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ALERT_SEVERITY", "HEALTHY", "PROBLEM", "SEVERITY_ORDER", "WARNING", "Threshold", "worst"]

HEALTHY = "healthy"
WARNING = "warning"
PROBLEM = "problem"
SEVERITY_ORDER = (HEALTHY, WARNING, PROBLEM)
# Prometheus alert severity label -> verdict.
ALERT_SEVERITY = {"critical": PROBLEM, "warning": WARNING}


@dataclass(frozen=True)
class Threshold:
    """One check of a diagnostic value.

    Attributes:
        check: Short name of the check.
        metric: The instrument (docs/conventions.md) the value comes from.
        above: The check fires when the value is strictly greater than this...
        at_most: ...or, when set instead, when the value is at most this.
        severity: :data:`WARNING` or :data:`PROBLEM` when it fires.
        finding: What went wrong, naming the bug, for the report line.
        advice: Where to look next.
        alert: The Prometheus alert in ``dashboards/prometheus/rules.yml`` with the same
            threshold and severity, if any.
        unless: Another check whose firing makes this one meaningless for the same sample.
        marker: Values at or above this are a marker, not a measurement (the grad amax of a
            step whose grads hold NaN/Inf): the check never fires on them.
    """

    check: str
    metric: str
    severity: str
    finding: str
    advice: str
    above: float | None = None
    at_most: float | None = None
    alert: str | None = None
    unless: str | None = None
    marker: float | None = None

    def fires(self, value: float) -> bool:
        """Whether ``value`` crosses this threshold (NaN never does: it is counted as non-finite)."""
        if self.marker is not None and value >= self.marker:
            return False
        if self.above is not None:
            return value > self.above
        return self.at_most is not None and value <= self.at_most


def worst(severities: list[str]) -> str:
    """The most severe of ``severities``; healthy when empty."""
    return max(severities, key=SEVERITY_ORDER.index, default=HEALTHY)
