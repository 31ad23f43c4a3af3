"""The exporters and metric readers built from what :mod:`~fsdp_patch.telemetry.export.selection` resolves.

Each resolved class is constructed on its own, and one whose construction fails (a bad endpoint
URL, a missing certificate) is a warning naming it, while the others are kept. Every exporter is
wrapped by :mod:`fsdp_patch.telemetry.export.isolation`. What construction adds per class:

- The trace-file exporter gets the rank and resource of the providers, rank 0 says where the
  traces go, and it is remembered (for the summary's footer and the files written); it is also the
  SDK's own ``trace_file`` entry point (:class:`TraceFileSpanExporter`, registered in
  ``pyproject.toml``), constructed there without arguments.
- ``summary`` becomes a :class:`~fsdp_patch.telemetry.export.summary.MetricSummary`, printed on
  the ranks ``FSDP_PATCH_SUMMARY`` names within the exit budget, with the trace files and metric
  endpoints as its footer.
- Push metric exporters get a periodic reader whose ``OTEL_METRIC_EXPORT_*`` values are read
  leniently (:mod:`~fsdp_patch.telemetry.export.otel_env`); pull readers are constructed as the
  SDK's configurator constructs them.
- ``prometheus`` is resolved through its entry point (so a missing package is reported like any
  other), but the server is started here. The entry point's reader
  (``opentelemetry-exporter-prometheus``) starts its HTTP server in its constructor on
  ``OTEL_EXPORTER_PROMETHEUS_PORT`` as given and keeps no handle to it: every rank of a host would
  bind the same port (all but one failing with ``OSError``), a malformed port raises
  ``ValueError``, and the server outlives the providers. Here local rank r serves on the port
  plus r, a busy or malformed port is a warning, each rank names its endpoint in one write, and
  the endpoint (:mod:`~fsdp_patch.telemetry.export.prometheus_endpoint`) serves the final values
  until they are scraped, then stops with the providers.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.sdk.metrics.export import MetricExporter, MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource

from .. import env, trace_limits
from . import otel_env
from .isolation import GuardedMetricExporter, GuardedSpanExporter
from .prometheus_endpoint import PrometheusEndpoint
from .ranks import RankInfo, current_rank_info
from .resource import build_resource
from .selection import TRACES_EXPORTER, Resolved, resolve
from .summary import MetricSummary, SummaryMetricReader
from .trace_files import TraceFileExporter

_logger = logging.getLogger(__name__)

DEFAULT_PROMETHEUS_HOST = "localhost"
DEFAULT_PROMETHEUS_PORT = 9464


def _guarded_call(what: str, factory: Callable[[], Any]) -> Any | None:
    # Building an exporter (bad endpoint URL, missing certificate) must not stop training either.
    try:
        return factory()
    except Exception as exc:
        _logger.warning(
            "fsdp_patch telemetry: could not create %s (%s: %s); continuing without it.", what, type(exc).__name__, exc
        )
        return None


def _trace_max_bytes() -> int:
    try:
        return trace_limits.trace_max_bytes()
    except ValueError as exc:  # a size typo must not stop training: say so once, keep the default
        _logger.warning("%s; using %d.", exc, trace_limits.DEFAULT_TRACE_MAX_BYTES)
        return trace_limits.DEFAULT_TRACE_MAX_BYTES


class TraceFileSpanExporter(TraceFileExporter):
    """The trace files as the SDK's own exporter: ``trace_file`` of ``opentelemetry_traces_exporter``.

    The SDK's configurator (``opentelemetry-instrument`` with ``OTEL_TRACES_EXPORTER=trace_file``)
    constructs it without arguments, before the script runs: the directory, the cap, the rank
    (torchrun's ``RANK``) and the resource come from the environment, as the embedded default
    reads them. The embedded default passes the rank and the resource its providers have.

    Args:
        rank_info: This process; read from the environment when not given.
        resource: Resource named in the files; built from the environment when not given.
    """

    def __init__(self, rank_info: RankInfo | None = None, resource: Resource | None = None) -> None:
        info = rank_info or current_rank_info()
        resource = resource or build_resource(info)
        super().__init__(env.trace_dir(), info.rank, dict(resource.attributes), max_bytes=_trace_max_bytes())


def _announce_trace_files(exporter: TraceFileExporter) -> None:
    # One line at start, so nobody is surprised by the files or left wondering how to use a collector.
    max_bytes = exporter.max_bytes
    cap = f"newest steps kept, at most {trace_limits.size_text(max_bytes)} per rank" if max_bytes else "no size cap"
    print(
        f"fsdp_patch telemetry: traces go to {os.path.join(exporter.directory, 'rank*.trace.json')} "
        f"({cap}: {trace_limits.TRACE_MAX_BYTES}); to send them to a collector instead, set "
        f"{TRACES_EXPORTER}=otlp and OTEL_EXPORTER_OTLP_ENDPOINT=http://HOST:4318",
        file=sys.stderr,
        flush=True,
    )


def build_span_exporters(
    rank_info: RankInfo, resource: Resource
) -> tuple[list[GuardedSpanExporter], list[TraceFileExporter]]:
    """Span exporters named by ``OTEL_TRACES_EXPORTER``, each guarded.

    Returns:
        The exporters, and the trace-file exporter among them (unguarded) if selected, to
        ask later which files it wrote.
    """
    exporters: list[GuardedSpanExporter] = []
    files: list[TraceFileExporter] = []
    for resolved in resolve("traces"):
        cls = resolved.exporter_class
        what = f"span exporter {resolved.name!r} ({cls.__name__})"
        if issubclass(cls, TraceFileSpanExporter):
            trace_file = _guarded_call(what, lambda: cls(rank_info, resource))
            if trace_file is None:
                continue
            if rank_info.rank == 0:
                _announce_trace_files(trace_file)
            files.append(trace_file)
            exporters.append(GuardedSpanExporter(trace_file))
            continue
        exporter = _guarded_call(what, cls)
        if exporter is not None:
            exporters.append(GuardedSpanExporter(exporter))
    return exporters, files


def _prometheus_port(local_rank: int) -> int:
    raw = os.environ.get("OTEL_EXPORTER_PROMETHEUS_PORT", "").strip()
    try:
        port = int(raw) if raw else DEFAULT_PROMETHEUS_PORT
        if not 0 <= port <= 65535:
            raise ValueError(raw)
    except ValueError:
        _logger.warning(
            "OTEL_EXPORTER_PROMETHEUS_PORT=%r is not valid; accepted values: a port number 0-65535. Using %d.",
            raw,
            DEFAULT_PROMETHEUS_PORT,
        )
        port = DEFAULT_PROMETHEUS_PORT
    # Ranks on one host would collide on one port; port 0 (any free port) needs no offset.
    return port + local_rank if port else 0


@dataclass
class MetricSetup:
    """Metric readers built from the environment.

    Attributes:
        readers: Readers to register on the meter provider.
        summary: The exit summary when ``summary`` is selected.
        prometheus_endpoints: HTTP endpoints serving ``/metrics``, stopped with the providers.
        endpoints: Human-readable descriptions of where metrics go.
    """

    readers: list[MetricReader] = field(default_factory=list)
    summary: MetricSummary | None = None
    prometheus_endpoints: list[PrometheusEndpoint] = field(default_factory=list)
    endpoints: list[str] = field(default_factory=list)


def _start_prometheus(rank_info: RankInfo, setup: MetricSetup, registry: Any | None) -> None:
    try:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from prometheus_client import REGISTRY
    except ImportError as exc:
        _logger.warning(
            "OTEL_METRICS_EXPORTER=prometheus needs opentelemetry-exporter-prometheus (%s); install it with "
            "`pip install 'fsdp-patch[prometheus]'`. Continuing without Prometheus.",
            exc,
        )
        return
    host = os.environ.get("OTEL_EXPORTER_PROMETHEUS_HOST", "").strip() or DEFAULT_PROMETHEUS_HOST
    port = _prometheus_port(rank_info.local_rank)
    registry = registry if registry is not None else REGISTRY
    try:
        endpoint = PrometheusEndpoint(host, port, registry)
    except OSError as exc:
        _logger.warning(
            "fsdp_patch telemetry: cannot serve Prometheus metrics on %s:%d (%s); continuing without them. "
            "Set OTEL_EXPORTER_PROMETHEUS_PORT (local rank r uses port + r).",
            host,
            port,
            exc,
        )
        return
    setup.readers.append(PrometheusMetricReader(registry=registry))
    setup.prometheus_endpoints.append(endpoint)
    url = f"http://{host}:{endpoint.port}/metrics"
    setup.endpoints.append(f"Prometheus: {url}")
    # Every rank serves its own endpoint: each names it when it starts, where the job's output is read.
    # One write per line: ranks share the job's stderr, and print() writes the text and its newline
    # separately, which lets another rank's line land between them.
    sys.stderr.write(f"fsdp_patch telemetry: rank {rank_info.rank} serves Prometheus metrics at {url}\n")
    sys.stderr.flush()


def _is_prometheus(resolved: Resolved) -> bool:
    if resolved.entry_point != "prometheus":
        return False
    # Loaded by the resolution, so the package is there.
    from opentelemetry.exporter.prometheus import PrometheusMetricReader

    return issubclass(resolved.exporter_class, PrometheusMetricReader)


def build_metric_readers(
    rank_info: RankInfo, summary_header: str, prometheus_registry: Any | None = None
) -> MetricSetup:
    """Metric readers named by ``OTEL_METRICS_EXPORTER``.

    Args:
        rank_info: This process; picks the Prometheus port and whether the summary prints.
        summary_header: First line of the exit summary.
        prometheus_registry: Registry for the Prometheus reader (tests); the global one by default.
    """
    setup = MetricSetup()
    # Read (and a malformed value named) whichever readers are chosen: a bad interval is the
    # user's mistake even where the summary alone, which has no interval, makes it moot.
    reader_arguments = otel_env.metric_reader_arguments()
    for resolved in resolve("metrics"):
        cls = resolved.exporter_class
        what = f"metric exporter {resolved.name!r} ({cls.__name__})"
        if issubclass(cls, SummaryMetricReader):
            mode = env.summary_mode()
            prints = mode == "all" or (mode == "rank0" and rank_info.rank == 0)
            setup.summary = MetricSummary(summary_header, enabled=prints)
            setup.readers.append(setup.summary.reader)
        elif _is_prometheus(resolved):
            _start_prometheus(rank_info, setup, prometheus_registry)
        elif issubclass(cls, MetricReader):  # a pull reader, constructed as the SDK's configurator does
            reader = _guarded_call(what, cls)
            if reader is not None:
                setup.readers.append(reader)
                setup.endpoints.append(f"{resolved.name} ({cls.__name__})")
        else:
            exporter: MetricExporter | None = _guarded_call(what, cls)
            if exporter is not None:
                setup.readers.append(PeriodicExportingMetricReader(GuardedMetricExporter(exporter), **reader_arguments))
                setup.endpoints.append(f"{resolved.name} ({cls.__name__})")
    return setup
