"""Which tracer and meter providers the package uses, and their life cycle.

On first use, per signal: if the application (or ``opentelemetry-instrument``) installed a
global provider, it is used. Otherwise this module builds the package's own SDK provider from
the ``OTEL_*`` variables (:mod:`~fsdp_patch.telemetry.export.selection` names the exporters,
:mod:`~fsdp_patch.telemetry.export.exporters` builds them), with the rank identity as
resource attributes: the embedded default. It is **not** installed as the global provider, so an
application that sets its own providers later is not refused by the API; spans still nest under
the caller's span, which comes from the context, not from the provider. With
``OTEL_SDK_DISABLED=true`` nothing is built and no-op providers are used.

Providers built here are flushed before ``torch.distributed.destroy_process_group`` tears the
default group down, and flushed, summarised and shut down at interpreter exit. Every exporter
flushes on its own helper thread, side by side, and the two waits together are bounded by
``FSDP_PATCH_FLUSH_TIMEOUT``: one budget for the end of a run, however many exporters are stuck.
Everything installed for that (the ``atexit`` hook and the ``destroy_process_group`` wrapper of
:mod:`~fsdp_patch.telemetry.export.exit_hooks`, logging filters) is removed again by
:func:`uninstall`, and the wrapper and filters by :func:`shutdown`.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Protocol

from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import AlwaysOffExemplarFilter
from opentelemetry.sdk.metrics import MeterProvider as SdkMeterProvider
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider as SdkTracerProvider

from .. import env, semconv
from . import exit_hooks, isolation, otel_env, selection
from .exporters import MetricSetup, build_metric_readers, build_span_exporters
from .isolation import BoundedCall, OwnBatchSpanProcessor, WarnOnce
from .prometheus_endpoint import wait_for_final_scrapes
from .ranks import RankInfo, current_rank_info, note_mesh_coordinate
from .resource import build_resource
from .trace_files import TraceFileExporter

_logger = logging.getLogger(__name__)
_warn = WarnOnce(_logger)

SCOPE_NAME = semconv.SCOPE_NAME


class _Flushable(Protocol):
    def flush_timers(self) -> None: ...


@dataclass
class _Embedded:
    """The providers built here (the embedded default), per signal ``None`` where the application's is used."""

    rank_info: RankInfo
    pid: int
    tracer_provider: SdkTracerProvider | None = None
    meter_provider: SdkMeterProvider | None = None
    metric_setup: MetricSetup = field(default_factory=MetricSetup)
    trace_files: list[TraceFileExporter] = field(default_factory=list)
    span_processors: list[_SpanProcessor] = field(default_factory=list)


@dataclass(frozen=True)
class _SpanProcessor:
    """One exporter's batch processor, flushed and shut down on its own (side by side with the others).

    Attributes:
        processor: The processor.
        label: The exporter's class name, for warnings.
        local: Whether it writes local files only (the trace files): waited for a little past
            the flush budget, since its data is the run's own record and costs no network wait.
    """

    processor: OwnBatchSpanProcessor
    label: str
    local: bool


_lock = threading.RLock()
_embedded: _Embedded | None = None
_shut_down = False
_observers: weakref.WeakSet[Any] = weakref.WeakSet()


def instrumentation_version() -> str:
    """The version of the instrumentation (this package), for the tracer and meter scope."""
    from fsdp_patch import __version__

    return __version__


def _tracer_provider_unset(provider: trace.TracerProvider) -> bool:
    return isinstance(provider, trace.ProxyTracerProvider)


def _meter_provider_unset(provider: metrics.MeterProvider) -> bool:
    # The API's default global is a proxy of a private class: anything but an SDK provider or an
    # explicit no-op one counts as unset (an application that disables metrics with a
    # NoOpMeterProvider keeps them off).
    return not isinstance(provider, (SdkMeterProvider, metrics.NoOpMeterProvider))


def _build() -> _Embedded:
    info = current_rank_info()
    state = _Embedded(info, os.getpid())
    otel_env.check_sdk_disabled()
    if env.sdk_disabled():
        return state
    resource: Resource | None = None
    if _tracer_provider_unset(trace.get_tracer_provider()):
        resource = build_resource(info)
        exporters, files = build_span_exporters(info, resource)
        provider = SdkTracerProvider(resource=resource, span_limits=otel_env.span_limits(), shutdown_on_exit=False)
        batch_args = otel_env.batch_processor_arguments()
        for exporter in exporters:
            # Batch processing keeps exporting off the training thread; on_end only enqueues.
            processor = OwnBatchSpanProcessor(exporter, **batch_args)
            provider.add_span_processor(processor)
            local = any(exporter.inner is trace_file for trace_file in files)
            state.span_processors.append(_SpanProcessor(processor, type(exporter.inner).__name__, local))
        state.tracer_provider, state.trace_files = provider, files
    else:
        _announce_application_sdk(info)
    if _meter_provider_unset(metrics.get_meter_provider()):
        resource = resource or build_resource(info)
        service = resource.attributes.get(SERVICE_NAME)
        header = f"fsdp_patch telemetry summary: rank {info.rank} of {info.world_size} (service {service})"
        setup = build_metric_readers(info, header)
        # No exemplars unless OTEL_METRICS_EXEMPLAR_FILTER asks: the SDK's default samples one
        # for each measurement made inside a span (every one of a step's), which none of the
        # embedded exporters reads.
        exemplars = None if os.environ.get("OTEL_METRICS_EXEMPLAR_FILTER") else AlwaysOffExemplarFilter()
        state.meter_provider = SdkMeterProvider(
            resource=resource, metric_readers=setup.readers, exemplar_filter=exemplars, shutdown_on_exit=False
        )
        state.metric_setup = setup
    return state


def _announce_application_sdk(info: RankInfo) -> None:
    """Say where spans go when the application's SDK (``opentelemetry-instrument``'s) has them, and
    fold its OTLP exporters' failures into one line: with nothing set that SDK exports to a
    collector at localhost:4317 and writes nothing a user could read."""
    isolation.fold_collector_failures()
    if info.rank != 0:
        return
    traces = os.environ.get("OTEL_TRACES_EXPORTER", "").strip() or "otlp"
    where = f"OTEL_TRACES_EXPORTER={traces}"
    if "otlp" in traces.split(","):
        setting = selection.protocol_setting("traces")
        port = 4318 if setting is not None and setting[1].strip() == selection.DEFAULT_OTLP_PROTOCOL else 4317
        endpoint = (
            os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
            or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
            or f"localhost:{port}, the default"
        )
        where += f", to {endpoint}"
    files = (
        ""
        if "trace_file" in traces.split(",")
        else "; no trace files are written. For the trace files fsdp-patch report reads, add trace_file to OTEL_TRACES_EXPORTER (or set OTEL_PYTHON_DISTRO=fsdp_patch, or use FSDP_PATCH_TELEMETRY=1 without opentelemetry-instrument)"
    )
    _say(f"fsdp_patch telemetry: spans go to the application's OpenTelemetry SDK ({where}){files}")


def _ensure_built() -> _Embedded | None:
    global _embedded
    with _lock:
        if _embedded is None and not _shut_down:
            _embedded = _build()
            if _embedded.tracer_provider or _embedded.meter_provider:
                exit_hooks.install(shutdown, functools.partial(flush, at_exit=True))
        return _embedded


def tracer_provider() -> trace.TracerProvider:
    """The tracer provider to use: the application's global one, else the embedded default (built now if needed)."""
    state = _ensure_built()
    if state is not None and state.tracer_provider is not None:
        return state.tracer_provider
    provider = trace.get_tracer_provider()
    if _tracer_provider_unset(provider):
        # Only when disabled (or after shutdown): a proxy would silently start recording if
        # someone installed a provider later; the decision was made now.
        return trace.NoOpTracerProvider()
    return provider


def meter_provider() -> metrics.MeterProvider:
    """The meter provider to use: the application's global one, else the embedded default (built now if needed)."""
    state = _ensure_built()
    if state is not None and state.meter_provider is not None:
        return state.meter_provider
    provider = metrics.get_meter_provider()
    if _meter_provider_unset(provider):
        return metrics.NoOpMeterProvider()
    return provider


def register_observer(observer: _Flushable) -> None:
    """Have ``observer.flush_timers()`` called before flushes and at shutdown (weakly referenced)."""
    _observers.add(observer)


def _flush_observers() -> None:
    for observer in list(_observers):
        try:
            observer.flush_timers()
        except Exception as exc:  # e.g. a CUDA context already torn down at exit
            _warn(
                "observer-flush",
                "fsdp_patch telemetry: reading pending step timings failed (%s: %s).",
                type(exc).__name__,
                exc,
            )


def _timeout_s() -> float:
    try:
        return env.flush_timeout_s()
    except ValueError as exc:  # already reported when the observer was created; do not fail at exit
        _warn("flush-timeout", "%s; using %.0fs.", exc, env.DEFAULT_FLUSH_TIMEOUT_S)
        return env.DEFAULT_FLUSH_TIMEOUT_S


def _own(state: _Embedded | None) -> _Embedded | None:
    # A forked child inherits the parent's providers (and their open files): flushing,
    # summarising or closing them there would print a second summary and write into the
    # parent's trace file, so only the process that built them does.
    return state if state is not None and state.pid == os.getpid() else None


# Local work (the trace files, the summary) may run this much past the flush budget when the
# budget is spent (a flush before destroy_process_group that waited for a dead collector):
# it needs no network, and losing it would lose the run's own record.
LOCAL_GRACE_S = 0.5

# The end of a run waits for exporters at most FSDP_PATCH_FLUSH_TIMEOUT in all: the flush before
# destroy_process_group and the shutdown at exit share it. (steps observed, seconds waited) of
# that flush; a step after it means training went on, and the budget starts afresh.
_exit_waited: tuple[int, float] | None = None


def _steps_observed() -> int:
    return sum(getattr(observer, "step_count", 0) for observer in list(_observers))


def _exit_budget_s() -> float:
    """Seconds the end of the run may still wait for exporters."""
    global _exit_waited
    timeout = _timeout_s()
    if _exit_waited is None:
        return timeout
    steps, waited = _exit_waited
    if steps != _steps_observed():
        _exit_waited = None
        return timeout
    return max(0.0, timeout - waited)


def _spend_exit_budget(seconds: float) -> None:
    global _exit_waited
    earlier = _exit_waited[1] if _exit_waited is not None and _exit_waited[0] == _steps_observed() else 0.0
    _exit_waited = (_steps_observed(), earlier + seconds)


def _wait(calls: list[tuple[BoundedCall, bool]], started: float, budget_s: float) -> None:
    """Wait for ``(call, local)`` pairs against one deadline (local ones up to the grace past it), then report."""
    for call, local in calls:
        call.wait(started + budget_s + (LOCAL_GRACE_S if local else 0.0))
    for call, _ in calls:
        call.report(budget_s, _warn)


def flush(*, at_exit: bool = False) -> None:
    """Push out pending step timings, spans and metrics of the providers we built.

    Every exporter flushes side by side, and all together wait at most ``FSDP_PATCH_FLUSH_TIMEOUT``.

    Args:
        at_exit: The flush before ``destroy_process_group``: it spends the run's one exit budget,
            which :func:`shutdown` then gets what is left of.
    """
    _flush_observers()
    with _lock:
        state = None if _shut_down else _own(_embedded)
    if state is None:
        return
    budget = _exit_budget_s() if at_exit else _timeout_s()
    started = time.monotonic()
    millis = int(budget * 1000)
    calls = [
        (BoundedCall(f"span flush ({p.label})", functools.partial(p.processor.force_flush, millis)), p.local)
        for p in state.span_processors
    ]
    if state.meter_provider is not None:
        calls.append((BoundedCall("metric flush", functools.partial(state.meter_provider.force_flush, millis)), False))
    _wait(calls, started, budget)
    if at_exit:
        _spend_exit_budget(time.monotonic() - started)


def _stop_servers(setup: MetricSetup) -> None:
    for endpoint in setup.prometheus_endpoints:
        try:
            endpoint.stop()
        except Exception:  # pragma: no cover - best effort at exit
            pass


def _serve_final_metrics(state: _Embedded) -> None:
    # Before the meter provider shuts down: its Prometheus reader collects nothing after that.
    endpoints = state.metric_setup.prometheus_endpoints
    if not endpoints:
        return
    try:
        wanted, timeout_s = env.prometheus_final_scrapes(), env.prometheus_final_scrape_timeout_s()
    except ValueError as exc:  # already reported when the observer was created; do not fail at exit
        _warn("final-scrapes", "%s; not waiting for Prometheus.", exc)
        return
    wait_for_final_scrapes(endpoints, wanted, timeout_s, state.rank_info.rank, _logger.warning, _say)


def _say(line: str) -> None:
    # One write per line: ranks share the job's stderr.
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def shutdown() -> None:
    """Flush and shut down the providers we built, print the summary, remove the wrapper and
    logging filters. Idempotent; providers of the application are left to the application.

    Waits at most what is left of the exit budget (``FSDP_PATCH_FLUSH_TIMEOUT``, shared with the
    flush before ``destroy_process_group``), for every exporter side by side; the trace files
    and the summary get :data:`LOCAL_GRACE_S` more should the budget be spent.
    """
    global _shut_down
    with _lock:
        if _shut_down:
            return
        _shut_down = True
        state = _own(_embedded)
    if state is None:
        return
    _flush_observers()
    _serve_final_metrics(state)
    budget = _exit_budget_s()
    started = time.monotonic()
    millis = int(budget * 1000)
    # Shutdown drains each batch queue; the trace files' also closes them and writes the Jaeger files.
    spans = [
        (BoundedCall(f"span export at shutdown ({p.label})", p.processor.shutdown), p.local)
        for p in state.span_processors
    ]
    for call, local in spans:
        if local:
            call.wait(started + budget + LOCAL_GRACE_S)
    calls = list(spans)
    summary = state.metric_setup.summary
    if summary is not None:
        # After the trace files are closed, so that the footer names the Jaeger files too.
        written = [path for exporter in state.trace_files for path in exporter.written_paths()]
        if written:
            summary.footer.append("  traces: " + ", ".join(written))
            summary.footer.append(
                "      open *.trace.json in https://ui.perfetto.dev; upload *.jaeger.json in the Jaeger UI"
            )
        summary.footer.extend(f"  metrics also sent to {e}" for e in state.metric_setup.endpoints)
        emitted = BoundedCall("metric summary", summary.emit)
        emitted.wait(started + budget + LOCAL_GRACE_S)
        calls.append((emitted, True))
    if state.meter_provider is not None:
        meter_provider = state.meter_provider
        calls.append(
            (BoundedCall("metric export at shutdown", lambda: meter_provider.shutdown(timeout_millis=millis)), False)
        )
    _wait(calls, started, budget)
    if state.tracer_provider is not None and all(call.wait(0.0) for call, _ in spans):
        # Its processors are shut down above (a stuck one is abandoned, and must not be waited
        # for again): this only marks the provider itself shut down.
        state.tracer_provider.shutdown()
    _spend_exit_budget(time.monotonic() - started)
    _stop_servers(state.metric_setup)
    exit_hooks.unwrap_destroy_process_group()
    isolation.remove_log_filters()


def written_trace_files() -> list[str]:
    """Trace files our tracer provider has written so far (none when the application's provider is used)."""
    with _lock:
        exporters = list(_embedded.trace_files) if _embedded else []
    return [path for exporter in exporters for path in exporter.written_paths()]


def uninstall() -> None:
    """Shut down what we built and remove every global hook, so the next use builds afresh.

    The telemetry instrumentor's ``uninstrument()`` calls it; tests call it (as :func:`reset`)
    together with resetting OpenTelemetry's global providers.
    """
    global _embedded, _shut_down, _exit_waited
    shutdown()
    with _lock:
        exit_hooks.remove()
        _embedded = None
        _shut_down = False
        _exit_waited = None
        _observers.clear()
        note_mesh_coordinate(None)


reset = uninstall
