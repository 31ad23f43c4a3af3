"""Exporters and metric readers chosen by the standard ``OTEL_*`` variables.

``OTEL_TRACES_EXPORTER`` and ``OTEL_METRICS_EXPORTER`` take comma-separated names. When a
variable is unset or empty its signal gets this package's embedded default, which needs no
server: trace files for spans (``trace_file``) and an exit summary for metrics
(``summary``). Every exporter is wrapped by :mod:`fsdp_patch.telemetry.export.isolation`.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any

from opentelemetry.sdk.metrics.export import (
    ConsoleMetricExporter,
    MetricExporter,
    MetricReader,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SpanExporter

from .. import env, trace_limits
from . import otel_env
from .isolation import GuardedMetricExporter, GuardedSpanExporter
from .ranks import RankInfo, current_rank_info
from .resource import build_resource
from .summary import MetricSummary
from .trace_files import TraceFileExporter

_logger = logging.getLogger(__name__)

TRACES_EXPORTER = "OTEL_TRACES_EXPORTER"
METRICS_EXPORTER = "OTEL_METRICS_EXPORTER"
TRACE_FILE = "trace_file"
SUMMARY = "summary"
SPAN_EXPORTERS = (TRACE_FILE, "console", "otlp", "none")
METRIC_EXPORTERS = (SUMMARY, "console", "otlp", "prometheus", "none")
OTLP_PROTOCOLS = ("http/protobuf", "grpc")
DEFAULT_OTLP_PROTOCOL = "http/protobuf"  # the specification's default; opentelemetry-python's is grpc
DEFAULT_PROMETHEUS_HOST = "localhost"
DEFAULT_PROMETHEUS_PORT = 9464

_OTLP_CLASSES = {
    ("traces", "http/protobuf"): ("opentelemetry.exporter.otlp.proto.http.trace_exporter", "OTLPSpanExporter"),
    ("traces", "grpc"): ("opentelemetry.exporter.otlp.proto.grpc.trace_exporter", "OTLPSpanExporter"),
    ("metrics", "http/protobuf"): ("opentelemetry.exporter.otlp.proto.http.metric_exporter", "OTLPMetricExporter"),
    ("metrics", "grpc"): ("opentelemetry.exporter.otlp.proto.grpc.metric_exporter", "OTLPMetricExporter"),
}


def exporter_names(variable: str, default: str) -> list[str]:
    """The de-duplicated, lower-cased names listed in ``variable``; ``[default]`` when it is unset or empty."""
    names: list[str] = []
    for name in os.environ.get(variable, "").split(","):
        name = name.strip().lower()
        if name and name not in names:
            names.append(name)
    return names or [default]


def trace_files_off_reason(world_size: int = 1) -> str | None:
    """Why this job's ranks write no trace files, or ``None`` when they do (the precision report reads them).

    Args:
        world_size: Ranks of the job, to tell whether ``FSDP_PATCH_TRACE_RANKS`` leaves any traced.
    """
    if env.sdk_disabled():
        return "OTEL_SDK_DISABLED=true turns telemetry off, so no trace files were written"
    names = exporter_names(TRACES_EXPORTER, TRACE_FILE)
    if TRACE_FILE not in names:
        listed = os.environ.get(TRACES_EXPORTER, "").strip()
        keep = ",".join([name for name in names if name != "none"] + [TRACE_FILE])
        return (
            f"{TRACES_EXPORTER}={listed} does not list {TRACE_FILE}, so no trace files were written; to keep them "
            f"(and this report) beside any other exporter, set {TRACES_EXPORTER}={keep}"
        )
    try:
        ranks = env.trace_ranks()
    except ValueError:
        return None  # reported when the optimizer was adapted
    if ranks is not None and not ranks & set(range(world_size)):
        return (
            f"{env.TRACE_RANKS}={os.environ.get(env.TRACE_RANKS, '').strip()} traces none of ranks 0-{world_size - 1}"
        )
    return None


def otlp_protocol(signal: str) -> str:
    """OTLP protocol for ``signal`` (``traces``/``metrics``): the per-signal variable, else the general one."""
    variable = f"OTEL_EXPORTER_OTLP_{signal.upper()}_PROTOCOL"
    if not os.environ.get(variable, "").strip():
        variable = "OTEL_EXPORTER_OTLP_PROTOCOL"
    value = os.environ.get(variable, "").strip().lower() or DEFAULT_OTLP_PROTOCOL
    if value not in OTLP_PROTOCOLS:
        _logger.warning(
            "%s=%r is not supported by fsdp_patch telemetry; accepted values: %s. Using %s.",
            variable, value, ", ".join(OTLP_PROTOCOLS), DEFAULT_OTLP_PROTOCOL,
        )  # fmt: skip
        value = DEFAULT_OTLP_PROTOCOL
    return value


def _otlp_exporter(signal: str) -> Any | None:
    protocol = otlp_protocol(signal)
    module_name, class_name = _OTLP_CLASSES[(signal, protocol)]
    try:
        module = __import__(module_name, fromlist=[class_name])
    except ImportError as exc:
        _logger.warning(
            "OTLP %s export over %s needs %s, which is not installed (%s); install it with "
            "`pip install 'fsdp-patch[otlp]'`. Continuing without OTLP %s.",
            signal, protocol, module_name.rsplit(".", 2)[0], exc, signal,
        )  # fmt: skip
        return None
    return getattr(module, class_name)()


def _from_entry_point(group: str, name: str, variable: str, accepted: tuple[str, ...]) -> Any | None:
    # Names we do not know may still be installed exporters (zipkin, ...), as with opentelemetry-instrument.
    for entry_point in entry_points(group=group, name=name):
        return entry_point.load()()
    _logger.warning(
        "%s lists %r, which is neither built in (%s) nor an installed %s entry point; ignoring it.",
        variable, name, ", ".join(accepted), group,
    )  # fmt: skip
    return None


def _guarded_call(what: str, factory: Callable[[], Any]) -> Any | None:
    # Building an exporter (bad endpoint URL, missing certificate) must not stop training either.
    try:
        return factory()
    except Exception as exc:
        _logger.warning("fsdp_patch telemetry: could not create %s (%s: %s); continuing without it.",
                        what, type(exc).__name__, exc)  # fmt: skip
        return None


def _trace_max_bytes() -> int:
    try:
        return trace_limits.trace_max_bytes()
    except ValueError as exc:  # a size typo must not stop training: say so once, keep the default
        _logger.warning("%s; using %d.", exc, trace_limits.DEFAULT_TRACE_MAX_BYTES)
        return trace_limits.DEFAULT_TRACE_MAX_BYTES


def _trace_file_exporter(rank_info: RankInfo, resource: Resource) -> TraceFileExporter:
    directory, max_bytes = env.trace_dir(), _trace_max_bytes()
    if rank_info.rank == 0:
        # One line at start, so nobody is surprised by the files or left wondering how to use a collector.
        cap = f"newest steps kept, at most {trace_limits.size_text(max_bytes)} per rank" if max_bytes else "no size cap"
        print(
            f"fsdp_patch telemetry: traces go to {os.path.join(directory, 'rank*.trace.json')} "
            f"({cap}: {trace_limits.TRACE_MAX_BYTES}); to send them to a collector instead, set "
            f"{TRACES_EXPORTER}=otlp and OTEL_EXPORTER_OTLP_ENDPOINT=http://HOST:4318",
            file=sys.stderr,
            flush=True,
        )
    return TraceFileExporter(directory, rank_info.rank, dict(resource.attributes), max_bytes=max_bytes)


class TraceFileSpanExporter(TraceFileExporter):
    """The trace files as the SDK's own exporter: ``trace_file`` of ``opentelemetry_traces_exporter``.

    The SDK's configurator (``opentelemetry-instrument`` with ``OTEL_TRACES_EXPORTER=trace_file``)
    constructs it without arguments, before the script runs: the directory, the cap, the rank
    (torchrun's ``RANK``) and the resource come from the environment, as the embedded default
    reads them.
    """

    def __init__(self) -> None:
        info = current_rank_info()
        resource = build_resource(info)
        super().__init__(env.trace_dir(), info.rank, dict(resource.attributes), max_bytes=_trace_max_bytes())


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
    for name in exporter_names(TRACES_EXPORTER, TRACE_FILE):
        exporter: SpanExporter | None
        if name == "none":
            continue
        if name == TRACE_FILE:
            trace_file = _trace_file_exporter(rank_info, resource)
            files.append(trace_file)
            exporter = trace_file
        elif name == "console":
            exporter = ConsoleSpanExporter()
        elif name == "otlp":
            exporter = _guarded_call("the OTLP span exporter", lambda: _otlp_exporter("traces"))
        else:
            exporter = _guarded_call(
                f"span exporter {name!r}",
                lambda: _from_entry_point("opentelemetry_traces_exporter", name, TRACES_EXPORTER, SPAN_EXPORTERS),
            )
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
            raw, DEFAULT_PROMETHEUS_PORT,
        )  # fmt: skip
        port = DEFAULT_PROMETHEUS_PORT
    # Ranks on one host would collide on one port; port 0 (any free port) needs no offset.
    return port + local_rank if port else 0


@dataclass
class MetricSetup:
    """Metric readers built from the environment.

    Attributes:
        readers: Readers to register on the meter provider.
        summary: The exit summary when ``summary`` is selected.
        prometheus_servers: HTTP servers serving ``/metrics``, shut down with the providers.
        endpoints: Human-readable descriptions of where metrics go.
    """

    readers: list[MetricReader] = field(default_factory=list)
    summary: MetricSummary | None = None
    prometheus_servers: list[Any] = field(default_factory=list)
    endpoints: list[str] = field(default_factory=list)


def _start_prometheus(rank_info: RankInfo, setup: MetricSetup, registry: Any | None) -> None:
    try:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from prometheus_client import REGISTRY, start_http_server
    except ImportError as exc:
        _logger.warning(
            "OTEL_METRICS_EXPORTER=prometheus needs opentelemetry-exporter-prometheus (%s); install it with "
            "`pip install 'fsdp-patch[prometheus]'`. Continuing without Prometheus.", exc,
        )  # fmt: skip
        return
    host = os.environ.get("OTEL_EXPORTER_PROMETHEUS_HOST", "").strip() or DEFAULT_PROMETHEUS_HOST
    port = _prometheus_port(rank_info.local_rank)
    registry = registry if registry is not None else REGISTRY
    try:
        server, _thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        _logger.warning(
            "fsdp_patch telemetry: cannot serve Prometheus metrics on %s:%d (%s); continuing without them. "
            "Set OTEL_EXPORTER_PROMETHEUS_PORT (local rank r uses port + r).", host, port, exc,
        )  # fmt: skip
        return
    setup.readers.append(PrometheusMetricReader(registry=registry))
    setup.prometheus_servers.append(server)
    url = f"http://{host}:{server.server_address[1]}/metrics"
    setup.endpoints.append(f"Prometheus: {url}")
    # Every rank serves its own endpoint: each names it when it starts, where the job's output is read.
    # One write per line: ranks share the job's stderr, and print() writes the text and its newline
    # separately, which lets another rank's line land between them.
    sys.stderr.write(f"fsdp_patch telemetry: rank {rank_info.rank} serves Prometheus metrics at {url}\n")
    sys.stderr.flush()


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
    for name in exporter_names(METRICS_EXPORTER, SUMMARY):
        exporter: MetricExporter | None = None
        if name == "none":
            continue
        if name == SUMMARY:
            mode = env.summary_mode()
            prints = mode == "all" or (mode == "rank0" and rank_info.rank == 0)
            setup.summary = MetricSummary(summary_header, enabled=prints)
            setup.readers.append(setup.summary.reader)
            continue
        if name == "prometheus":
            _start_prometheus(rank_info, setup, prometheus_registry)
            continue
        if name == "console":
            exporter = ConsoleMetricExporter()
        elif name == "otlp":
            exporter = _guarded_call("the OTLP metric exporter", lambda: _otlp_exporter("metrics"))
        else:
            exporter = _guarded_call(
                f"metric exporter {name!r}",
                lambda: _from_entry_point("opentelemetry_metrics_exporter", name, METRICS_EXPORTER, METRIC_EXPORTERS),
            )
            if isinstance(exporter, MetricReader):  # some entry points hand out pull readers
                setup.readers.append(exporter)
                continue
        if exporter is not None:
            setup.readers.append(PeriodicExportingMetricReader(GuardedMetricExporter(exporter), **reader_arguments))
            setup.endpoints.append(f"{name} ({type(exporter).__name__})")
    return setup
