"""Which tracer and meter providers the package uses, and their life cycle.

On first use, per signal: if the application (or ``opentelemetry-instrument``) already
installed a global provider, it is used and nothing is installed. Otherwise this module
builds an SDK provider from the ``OTEL_*`` variables (:mod:`fsdp_patch.telemetry.exporters`), with the
rank identity as resource attributes, and installs it globally. With
``OTEL_SDK_DISABLED=true`` nothing is installed and no-op providers are used.

Providers this module installed are flushed before ``torch.distributed.destroy_process_group``
tears the default group down, and flushed, summarised and shut down at interpreter exit.
Both waits are bounded by ``FSDP_PATCH_FLUSH_TIMEOUT``.
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Protocol

from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider as SdkMeterProvider
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider as SdkTracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from . import env
from .exporters import MetricSetup, build_metric_readers, build_span_exporters
from .isolation import WarnOnce, report_batch_processor_warnings_once, run_bounded
from .ranks import RankInfo, current_rank_info
from .trace_files import TraceFileExporter

_logger = logging.getLogger(__name__)
_warn = WarnOnce(_logger)

SCOPE_NAME = "fsdp_patch.telemetry"
DEFAULT_SERVICE_NAME = "fsdp_patch"

try:
    from opentelemetry.metrics._internal import _ProxyMeterProvider
except ImportError:  # pragma: no cover - private name; fall back to "anything but the SDK is unset"
    _ProxyMeterProvider = None  # type: ignore[assignment,misc]


class _Flushable(Protocol):
    def flush_timers(self) -> None: ...


@dataclass
class _Installed:
    rank_info: RankInfo
    tracer_provider: SdkTracerProvider | None = None
    meter_provider: SdkMeterProvider | None = None
    metric_setup: MetricSetup = field(default_factory=MetricSetup)
    trace_files: list[TraceFileExporter] = field(default_factory=list)


_lock = threading.RLock()
_installed: _Installed | None = None
_shut_down = False
_exit_hooks_registered = False
_observers: weakref.WeakSet[Any] = weakref.WeakSet()


def _tracer_provider_unset(provider: trace.TracerProvider) -> bool:
    return isinstance(provider, trace.ProxyTracerProvider)


def _meter_provider_unset(provider: metrics.MeterProvider) -> bool:
    if _ProxyMeterProvider is not None:
        return isinstance(provider, _ProxyMeterProvider)
    return not isinstance(provider, SdkMeterProvider)  # pragma: no cover


def build_resource(rank_info: RankInfo) -> Resource:
    """Resource of our providers: the ``OTEL_*`` resource plus the rank identity.

    ``OTEL_SERVICE_NAME`` and ``OTEL_RESOURCE_ATTRIBUTES`` are honoured; without a service
    name the service is ``fsdp_patch`` instead of the SDK's ``unknown_service``.
    """
    detected = Resource.create()
    ours: dict[str, Any] = {
        "fsdp.rank": rank_info.rank,
        "fsdp.world_size": rank_info.world_size,
        "fsdp.local_rank": rank_info.local_rank,
    }
    if rank_info.run_id:
        ours["fsdp.run_id"] = rank_info.run_id
    if str(detected.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        ours[SERVICE_NAME] = DEFAULT_SERVICE_NAME
    return detected.merge(Resource(ours))


def _install() -> _Installed:
    info = current_rank_info()
    state = _Installed(info)
    if env.sdk_disabled():
        return state
    resource: Resource | None = None
    if _tracer_provider_unset(trace.get_tracer_provider()):
        resource = build_resource(info)
        exporters, files = build_span_exporters(info, resource)
        provider = SdkTracerProvider(resource=resource, shutdown_on_exit=False)
        report_batch_processor_warnings_once()
        for exporter in exporters:
            # Batch processing keeps exporting off the training thread; on_end only enqueues.
            provider.add_span_processor(BatchSpanProcessor(exporter))
        trace.set_tracer_provider(provider)
        if trace.get_tracer_provider() is provider:
            state.tracer_provider, state.trace_files = provider, files
        else:  # the application won a race to install its own
            provider.shutdown()
    if _meter_provider_unset(metrics.get_meter_provider()):
        resource = resource or build_resource(info)
        service = resource.attributes.get(SERVICE_NAME)
        header = f"fsdp_patch telemetry summary: rank {info.rank} of {info.world_size} (service {service})"
        setup = build_metric_readers(info, header)
        provider = SdkMeterProvider(resource=resource, metric_readers=setup.readers, shutdown_on_exit=False)
        metrics.set_meter_provider(provider)
        if metrics.get_meter_provider() is provider:
            state.meter_provider, state.metric_setup = provider, setup
        else:
            provider.shutdown()
            _stop_servers(setup)
    return state


def _ensure_installed() -> _Installed | None:
    global _installed
    with _lock:
        if _installed is None and not _shut_down:
            _installed = _install()
            if _installed.tracer_provider or _installed.meter_provider:
                _register_exit_hooks()
        return _installed


def tracer_provider() -> trace.TracerProvider:
    """The tracer provider to use: the application's, else ours (installed now if needed)."""
    _ensure_installed()
    provider = trace.get_tracer_provider()
    if _tracer_provider_unset(provider):
        # Only when disabled (or after shutdown): a proxy would silently start recording if
        # someone installed a provider later; the decision was made now.
        return trace.NoOpTracerProvider()
    return provider


def meter_provider() -> metrics.MeterProvider:
    """The meter provider to use: the application's, else ours (installed now if needed)."""
    _ensure_installed()
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
            _warn("observer-flush", "fsdp_patch telemetry: reading pending step timings failed (%s: %s).",
                  type(exc).__name__, exc)  # fmt: skip


def _timeout_s() -> float:
    try:
        return env.flush_timeout_s()
    except ValueError as exc:  # already reported when the observer was created; do not fail at exit
        _warn("flush-timeout", "%s; using %.0fs.", exc, env.DEFAULT_FLUSH_TIMEOUT_S)
        return env.DEFAULT_FLUSH_TIMEOUT_S


def flush() -> None:
    """Push out pending step timings, spans and metrics of the providers we installed (bounded wait)."""
    _flush_observers()
    with _lock:
        state = None if _shut_down else _installed
    if state is None:
        return
    timeout = _timeout_s()
    if state.tracer_provider is not None:
        run_bounded(state.tracer_provider.force_flush, timeout, "span flush", _warn)
    if state.meter_provider is not None:
        run_bounded(state.meter_provider.force_flush, timeout, "metric flush", _warn)


def _stop_servers(setup: MetricSetup) -> None:
    for server in setup.prometheus_servers:
        try:
            server.shutdown()
            server.server_close()
        except Exception:  # pragma: no cover - best effort at exit
            pass


def shutdown() -> None:
    """Flush and shut down the providers this package installed, and print the summary. Idempotent.

    Providers the application installed are left to the application.
    """
    global _shut_down
    with _lock:
        if _shut_down:
            return
        _shut_down = True
        state = _installed
    _flush_observers()
    if state is None:
        return
    timeout = _timeout_s()
    if state.tracer_provider is not None:
        # Shutdown drains the batch queue and closes the trace files.
        run_bounded(state.tracer_provider.shutdown, timeout, "span export at shutdown", _warn)
    summary = state.metric_setup.summary
    if summary is not None:
        written = [path for exporter in state.trace_files for path in exporter.written_paths()]
        if written:
            summary.footer.append("  traces: " + ", ".join(written))
            summary.footer.append("      open *.trace.json in https://ui.perfetto.dev; upload *.jaeger.json in the Jaeger UI")
        summary.footer.extend(f"  metrics also sent to {e}" for e in state.metric_setup.endpoints)
        run_bounded(summary.emit, timeout, "metric summary", _warn)
    if state.meter_provider is not None:
        run_bounded(state.meter_provider.shutdown, timeout, "metric export at shutdown", _warn)
    _stop_servers(state.metric_setup)


def written_trace_files() -> list[str]:
    """Trace files our tracer provider has written so far (none when the application's provider is used)."""
    with _lock:
        exporters = list(_installed.trace_files) if _installed else []
    return [path for exporter in exporters for path in exporter.written_paths()]


def reset() -> None:
    """Shut down what we installed and forget it, so the next use installs afresh.

    For tests, together with resetting OpenTelemetry's global providers.
    """
    global _installed, _shut_down
    shutdown()
    with _lock:
        _installed = None
        _shut_down = False
        _observers.clear()


def _register_exit_hooks() -> None:
    global _exit_hooks_registered
    if _exit_hooks_registered:
        return
    _exit_hooks_registered = True
    atexit.register(shutdown)
    _wrap_destroy_process_group()


def _wrap_destroy_process_group() -> None:
    """Flush before ``destroy_process_group()`` tears down the default group.

    Only the module attributes are patched, so code that imported the function by name
    before telemetry started calls the original; the atexit flush still covers it.
    """
    try:
        import torch.distributed as dist
        import wrapt
        from torch.distributed import distributed_c10d as c10d
    except ImportError:  # pragma: no cover - torch built without distributed
        return
    original = c10d.destroy_process_group
    if getattr(original, "_self_fsdp_telemetry_flush", False):
        return

    def flush_first(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        group = args[0] if args else kwargs.get("group")
        if group is None or group is c10d.GroupMember.WORLD:
            flush()
        return wrapped(*args, **kwargs)

    wrapper = wrapt.FunctionWrapper(original, flush_first)
    wrapper._self_fsdp_telemetry_flush = True
    for module in (c10d, dist):
        if getattr(module, "destroy_process_group", None) is original:
            module.destroy_process_group = wrapper
