"""The embedded default for metrics: a human-readable summary printed at exit."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any, TextIO

from opentelemetry.sdk.metrics.export import (
    Gauge,
    HistogramDataPoint,
    InMemoryMetricReader,
    MetricsData,
    NumberDataPoint,
    Sum,
)

from ..semconv import ATTR_RANK as RANK_ATTRIBUTE


def _number(value: float) -> str:
    return f"{value:.6g}"


def _bytes(value: float) -> str:
    text, size = f"{int(value)}", float(value)
    if abs(size) < 1024:
        return text
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        size /= 1024
        if abs(size) < 1024 or unit == "TiB":
            break
    return f"{text} ({size:.1f} {unit})"


def _labels(attributes: Any) -> str:
    # The rank is in the header; repeating it on every line is noise.
    items = [f"{k}={v}" for k, v in sorted((attributes or {}).items()) if k != RANK_ATTRIBUTE]
    return " ".join(items) or "(all)"


def render(metrics_data: MetricsData | None, header: str, footer: Iterable[str] = ()) -> str:
    """Format collected metrics as indented text.

    Args:
        metrics_data: A collection from an :class:`InMemoryMetricReader`; ``None`` means nothing was recorded.
        header: First line.
        footer: Lines appended at the end (for example where the trace files are).

    Returns:
        The summary text, ending with a newline.
    """
    lines = [header]
    metrics = [
        metric
        for resource_metrics in (metrics_data.resource_metrics if metrics_data else ())
        for scope_metrics in resource_metrics.scope_metrics
        for metric in scope_metrics.metrics
    ]
    if not metrics:
        lines.append("  no metrics were recorded")
    for metric in sorted(metrics, key=lambda m: m.name):
        lines.append(f"  {metric.name} [{metric.unit}]")
        for point in metric.data.data_points:
            text: str
            if isinstance(point, HistogramDataPoint):
                mean = point.sum / point.count if point.count else 0.0
                text = (
                    f"count {point.count}, mean {_number(mean)}, min {_number(point.min)}, "
                    f"max {_number(point.max)}, total {_number(point.sum)}"
                )
            elif isinstance(point, NumberDataPoint) and isinstance(metric.data, Sum):
                text = _bytes(point.value) if metric.unit == "By" else _number(point.value)
            elif isinstance(point, NumberDataPoint) and isinstance(metric.data, Gauge):
                text = f"last {_number(point.value)}"
            else:  # pragma: no cover - exponential histograms are not used here
                text = str(point)
            lines.append(f"      {_labels(point.attributes)}: {text}")
    lines.extend(footer)
    return "\n".join(lines) + "\n"


class SummaryMetricReader(InMemoryMetricReader):
    """The exit summary as the SDK's own metric reader: ``summary`` of ``opentelemetry_metrics_exporter``.

    The SDK's configurator (``opentelemetry-instrument`` with ``OTEL_METRICS_EXPORTER=summary``)
    constructs it without arguments; it collects in memory and prints the summary when the meter
    provider shuts down, on the ranks ``FSDP_PATCH_SUMMARY`` names. The configurator builds one in
    every process it starts in, a launcher such as ``torchrun`` too: a process that recorded no
    metric at all prints nothing.
    """

    def __init__(self) -> None:
        from .. import env
        from .ranks import current_rank_info

        super().__init__()
        info = current_rank_info()
        mode = env.summary_mode()
        self.enabled = mode == "all" or (mode == "rank0" and info.rank == 0)
        self.header = f"fsdp_patch telemetry summary: rank {info.rank} of {info.world_size}"

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        if self.enabled:
            data = self.get_metrics_data()
            if data is not None and any(sm.metrics for rm in data.resource_metrics for sm in rm.scope_metrics):
                sys.stderr.write(render(data, self.header))
                sys.stderr.flush()
            self.enabled = False
        super().shutdown(timeout_millis=timeout_millis, **kwargs)


class MetricSummary:
    """Collects metrics in memory and prints them once, at shutdown.

    Args:
        header: First line of the summary.
        enabled: Whether this rank prints (see ``FSDP_PATCH_SUMMARY``); a disabled summary
            still collects, which is free until collection.
        stream: Where to print; ``sys.stderr`` at print time by default.
    """

    def __init__(self, header: str, enabled: bool = True, stream: TextIO | None = None) -> None:
        self.reader = InMemoryMetricReader()
        self.header = header
        self.enabled = enabled
        self.footer: list[str] = []
        self._stream = stream
        self._printed = False

    def emit(self) -> str | None:
        """Print the summary (once); returns the text, or ``None`` if this rank does not print."""
        if self._printed or not self.enabled:
            return None
        self._printed = True
        text = render(self.reader.get_metrics_data(), self.header, self.footer)
        stream = self._stream or sys.stderr
        stream.write(text)
        stream.flush()
        return text
