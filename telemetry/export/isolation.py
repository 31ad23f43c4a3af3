"""Exporter wrappers that keep export failures out of training and out of a flooded log.

An exporter runs on a batch processor's or periodic reader's thread, never on the training
step itself; these wrappers add the other half of the contract: an exporter that raises or
fails is reported once with ``logging.warning`` and otherwise ignored. While a wrapped
exporter runs, warnings that OpenTelemetry's own loggers emit from that thread are held
back and folded into that single report, so an unreachable collector does not log a retry
warning every few seconds for the rest of the run.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult, MetricsData
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

_logger = logging.getLogger(__name__)
_T = TypeVar("_T")

_capture = threading.local()


class _HoldBackInsideGuard(logging.Filter):
    """Drops WARNING+ records emitted inside a guarded export, remembering the first one."""

    def filter(self, record: logging.LogRecord) -> bool:
        held = getattr(_capture, "held", None)
        if held is None or record.levelno < logging.WARNING:
            return True
        if not held:
            held.append(record.getMessage())
        return False


_FILTER = _HoldBackInsideGuard()
_filter_lock = threading.Lock()
# Loggers we added a filter to, and the filter: what remove_log_filters() takes off again.
_filtered: list[tuple[logging.Logger, logging.Filter]] = []


def _add_filter(logger: logging.Logger, log_filter: logging.Filter) -> None:
    with _filter_lock:
        if log_filter not in logger.filters:
            logger.addFilter(log_filter)
            _filtered.append((logger, log_filter))


def _attach_filter() -> None:
    # Logger filters do not apply to records of child loggers, so every OpenTelemetry logger
    # gets the filter. It is inert outside a guarded export (the thread-local is unset).
    names = [n for n in list(logging.root.manager.loggerDict) if n.split(".", 1)[0] == "opentelemetry"]
    for name in names:
        _add_filter(logging.getLogger(name), _FILTER)


def remove_log_filters() -> None:
    """Take every logging filter this module added off its logger again. Idempotent."""
    with _filter_lock:
        while _filtered:
            logger, log_filter = _filtered.pop()
            logger.removeFilter(log_filter)


class _Guard:
    """Runs exporter calls, turning exceptions into a failure value and reporting the first failure."""

    def __init__(self, label: str) -> None:
        self.label = label
        self._reported = False
        self._lock = threading.Lock()
        _attach_filter()

    def call(self, what: str, fn: Callable[[], _T], failed: Callable[[_T], bool], fallback: _T) -> _T:
        outer = getattr(_capture, "held", None)
        held: list[str] = []
        _capture.held = held
        try:
            result = fn()
            reason = held[0] if held else None
            is_failure = failed(result)
        except Exception as exc:  # an exporter must never take training down
            result, is_failure = fallback, True
            reason = f"{type(exc).__name__}: {exc}"
        finally:
            _capture.held = outer
        if is_failure:
            self.report(what, reason)
        return result

    def report(self, what: str, reason: str | None) -> None:
        """Log the first failure of this exporter; later ones are silent."""
        with self._lock:
            if self._reported:
                return
            self._reported = True
        _logger.warning(
            "fsdp_patch telemetry: %s failed to %s (%s). Training is unaffected; this exporter's "
            "data may be incomplete and its further failures are not logged.",
            self.label,
            what,
            reason or "the exporter reported a failure",
        )


def _label(exporter: Any) -> str:
    return type(exporter).__name__


class GuardedSpanExporter(SpanExporter):
    """Wraps a span exporter so that it cannot raise and reports its first failure once.

    Args:
        inner: The exporter doing the work.
        label: Name used in the warning; the exporter's class name by default.
    """

    def __init__(self, inner: SpanExporter, label: str | None = None) -> None:
        self.inner = inner
        self._guard = _Guard(label or _label(inner))

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return self._guard.call(
            "export spans",
            lambda: self.inner.export(spans),
            lambda r: r is not SpanExportResult.SUCCESS,
            SpanExportResult.FAILURE,
        )

    def shutdown(self) -> None:
        self._guard.call("shut down", self.inner.shutdown, lambda _: False, None)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._guard.call("flush", lambda: self.inner.force_flush(timeout_millis), lambda r: r is False, False)


class GuardedMetricExporter(MetricExporter):
    """Wraps a push metric exporter so that it cannot raise and reports its first failure once.

    Args:
        inner: The exporter doing the work; its preferred temporality and aggregation are kept.
        label: Name used in the warning; the exporter's class name by default.
    """

    def __init__(self, inner: MetricExporter, label: str | None = None) -> None:
        super().__init__(
            preferred_temporality=inner._preferred_temporality,
            preferred_aggregation=inner._preferred_aggregation,
        )
        self.inner = inner
        self._guard = _Guard(label or _label(inner))

    def export(self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any) -> MetricExportResult:
        return self._guard.call(
            "export metrics",
            lambda: self.inner.export(metrics_data, timeout_millis=timeout_millis, **kwargs),
            lambda r: r is not MetricExportResult.SUCCESS,
            MetricExportResult.FAILURE,
        )

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return self._guard.call(
            "flush", lambda: self.inner.force_flush(timeout_millis=timeout_millis), lambda r: r is False, False
        )

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        self._guard.call(
            "shut down", lambda: self.inner.shutdown(timeout_millis=timeout_millis, **kwargs), lambda _: False, None
        )


_in_own_processor = threading.local()


class _OncePerMessage(logging.Filter):
    """Lets each distinct message template through once, for records our own processors log."""

    def __init__(self) -> None:
        super().__init__()
        self._seen: set[object] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(_in_own_processor, "active", False):
            return True  # another processor's warning: not ours to fold
        key = (record.name, record.msg)
        if key in self._seen:
            return False
        self._seen.add(key)
        return True


# The batch processor warns "Queue full, dropping Span." on the training thread, outside any
# export, whenever an exporter falls behind; the SDK repeats it every 20 s for a whole run. Which
# module logs it is the SDK's private business: every OpenTelemetry logger gets the filter, inert
# outside our processors' on_end.
_ONCE = _OncePerMessage()


class OwnBatchSpanProcessor(BatchSpanProcessor):
    """The SDK's batch processor, whose own warnings (queue full, ...) appear once per kind.

    Only records logged while one of these processors enqueues a span are folded; the same
    warnings of the application's processors are left as the SDK logs them.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for name in [n for n in list(logging.root.manager.loggerDict) if n.split(".", 1)[0] == "opentelemetry"]:
            _add_filter(logging.getLogger(name), _ONCE)

    def on_end(self, span: ReadableSpan) -> None:
        _in_own_processor.active = True
        try:
            super().on_end(span)
        finally:
            _in_own_processor.active = False


class WarnOnce:
    """Logs a warning the first time a given key is seen, then stays silent for that key."""

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, key: str, msg: str, *args: object) -> None:
        with self._lock:
            if key in self._seen:
                return
            self._seen.add(key)
        self._logger.warning(msg, *args)


class BoundedCall:
    """``fn`` running on a daemon helper thread, waited for by the caller only up to a deadline.

    The SDK's ``force_flush`` and ``shutdown`` export synchronously on the calling thread with no
    time limit, so a dead collector could otherwise hold ``destroy_process_group`` or interpreter
    exit hostage for the exporter's full retry budget. Several calls started together run side
    by side and are waited for against one deadline, so that waits do not add up: one exporter
    stuck on an unreachable collector costs the deadline once and holds no other exporter back.

    Args:
        what: What the call does, for the warnings (``"span flush (OTLPSpanExporter)"``).
        fn: The call.
    """

    def __init__(self, what: str, fn: Callable[[], object]) -> None:
        self.what = what
        self._outcome: list[BaseException | None] = []
        self._thread = threading.Thread(target=self._run, args=(fn,), name=f"fsdp-telemetry-{what}", daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], object]) -> None:
        try:
            fn()
            self._outcome.append(None)
        except BaseException as exc:  # reported by report(), on the caller's thread
            self._outcome.append(exc)

    def wait(self, until: float) -> bool:
        """Wait until ``until`` (a ``time.monotonic()`` value) at most; whether the call has finished."""
        self._thread.join(max(0.0, until - time.monotonic()))
        return not self._thread.is_alive()

    def report(self, timeout_s: float, warn: WarnOnce) -> bool:
        """Warn (once per ``what``) if the call is still running or raised; whether it succeeded."""
        if self._thread.is_alive():
            warn(
                f"timeout:{self.what}",
                "fsdp_patch telemetry: %s did not finish within %.1fs; continuing without "
                "waiting (raise FSDP_PATCH_FLUSH_TIMEOUT to wait longer).",
                self.what,
                timeout_s,
            )
            return False
        exc = self._outcome[0] if self._outcome else None
        if exc is not None:
            warn(
                f"error:{self.what}",
                "fsdp_patch telemetry: %s failed (%s: %s); continuing.",
                self.what,
                type(exc).__name__,
                exc,
            )
            return False
        return True


def run_bounded(fn: Callable[[], object], timeout_s: float, what: str, warn: WarnOnce) -> bool:
    """Run ``fn`` on a helper thread and wait at most ``timeout_s`` for it (see :class:`BoundedCall`).

    Returns:
        Whether ``fn`` finished in time without raising.
    """
    call = BoundedCall(what, fn)
    call.wait(time.monotonic() + timeout_s)
    return call.report(timeout_s, warn)


class _CollectorFailuresOnce(logging.Filter):
    """The application's OTLP exporters' export failures: the first as one line naming the fix, the rest dropped.

    Under ``opentelemetry-instrument`` with nothing set the distro exports OTLP to localhost:4317,
    and every batch then logs a retry warning and a failure, for the whole run. The first record
    is rewritten in place; a record logged inside one of our guarded exports is left to
    :class:`_HoldBackInsideGuard`.
    """

    def __init__(self) -> None:
        super().__init__()
        self._reported = False
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING or getattr(_capture, "held", None) is not None:
            return True
        first = record.getMessage().splitlines()[0] if record.getMessage() else ""
        if "export" not in first.lower():
            return True  # not an export failure: the exporter's other warnings stay as they are
        with self._lock:
            if self._reported:
                return False
            self._reported = True
        record.msg = (
            "fsdp_patch telemetry: an OTLP exporter cannot deliver (%s); its later failures are not logged. Start a "
            "collector (dashboards/README.md), or set OTEL_TRACES_EXPORTER=trace_file for the trace files that "
            "fsdp-patch report reads"
        )
        record.args = (first[:300],)
        record.exc_info, record.exc_text = None, None
        return True


# The OTLP exporter packages' loggers (gRPC and HTTP, traces and metrics).
OTLP_EXPORTER_LOGGERS = "opentelemetry.exporter.otlp"
_COLLECTOR_ONCE = _CollectorFailuresOnce()


def fold_collector_failures() -> None:
    """Fold the export failures of the application's OTLP exporters into one line (removed by :func:`remove_log_filters`)."""
    names = [n for n in list(logging.root.manager.loggerDict) if n.startswith(OTLP_EXPORTER_LOGGERS)]
    for name in names:
        _add_filter(logging.getLogger(name), _COLLECTOR_ONCE)
