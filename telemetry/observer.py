"""Spans and metrics around one adapted optimizer: what ``fsdp_patch.optimizer`` calls per step."""

from __future__ import annotations

import logging
import math
import threading
import weakref
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from opentelemetry import context as context_api
from opentelemetry import metrics, trace
from opentelemetry.trace import Span, Status, StatusCode
from opentelemetry.util.types import AttributeValue

from fsdp_patch.adapter.events import GroupCast, MismatchAction, Phase, StepPlanned

from . import env, instruments, precision, providers, semconv
from .isolation import WarnOnce
from .ranks import distributed_rank
from .timing import DurationRecorder, duration_recorder_for

_logger = logging.getLogger(__name__)

_PHASE_SPANS = {
    Phase.CAST_GRADS: semconv.SPAN_CAST_GRADS,
    Phase.INNER_STEP: semconv.SPAN_INNER_STEP,
    Phase.RESTORE_GRADS: semconv.SPAN_RESTORE_GRADS,
    Phase.REFRESH: semconv.SPAN_REFRESH,
    Phase.PRECISION: semconv.SPAN_PRECISION,
}
_MISMATCH_ACTIONS = {
    MismatchAction.CAST: semconv.MISMATCH_CAST,
    MismatchAction.PASSTHROUGH: semconv.MISMATCH_PASSTHROUGH,
    MismatchAction.REJECTED: semconv.MISMATCH_REJECTED,
}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: the form used in metric attributes."""
    return str(dtype).removeprefix("torch.")


def public_type_name(exc: BaseException) -> str:
    """The exception's class name, or that of its first public base class.

    Internal subclasses (``_MismatchError(TypeError)``) are reported as the public class a
    caller catches (``TypeError``): for ``error.type``, the status and the exception event.
    """
    for cls in type(exc).__mro__:
        if not cls.__name__.startswith("_"):
            return cls.__qualname__
    return type(exc).__qualname__  # pragma: no cover - object is always public


class StepScope:
    """Handle on the running ``fsdp.optimizer.step`` span, yielded by :meth:`OptimizerObserver.step`.

    Attributes:
        step_number: 1 for the optimizer's first step, then counting up.
    """

    __slots__ = ("step_number", "_span", "cast_bytes")

    def __init__(self, step_number: int, span: Span | None) -> None:
        self.step_number = step_number
        self._span = span
        self.cast_bytes = 0

    def set_attribute(self, key: str, value: AttributeValue) -> None:
        """Set an attribute on the step span (no-op on ranks that do not trace)."""
        if self._span is not None:
            self._span.set_attribute(key, value)


def _fail(span: Span, exc: BaseException) -> None:
    public = public_type_name(exc)
    span.record_exception(exc, attributes={semconv.ATTR_EXCEPTION_TYPE: public}, escaped=True)
    span.set_attribute(semconv.ATTR_ERROR_TYPE, public)
    span.set_status(Status(StatusCode.ERROR, f"{public}: {exc}"))


class OptimizerObserver:
    """Emits the design page's spans and metrics for one optimizer (a ``StepObserver``).

    Construction parses every ``FSDP_PATCH_*`` variable, so a malformed one fails when the
    optimizer is adapted. Providers, rank and device are resolved on first use, so an
    application may install its own providers (or initialize ``torch.distributed``) after
    adapting the optimizer, as long as it does so before the first step.

    Args:
        optimizer: The adapted optimizer; held weakly, read for its class and parameter device.
        precision_aware: Whether the adapter passes grads through uncast (span attribute).
        tracer_provider: Use this instead of the global provider (tests, the instrumentor's
            ``tracer_provider`` argument, applications that keep providers out of the global API).
        meter_provider: Same for metrics.
        step_count: Steps the optimizer already took (numbering continues from there).

    Raises:
        ValueError: A malformed ``FSDP_PATCH_*`` variable.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        precision_aware: bool,
        tracer_provider: trace.TracerProvider | None = None,
        meter_provider: metrics.MeterProvider | None = None,
        step_count: int = 0,
    ) -> None:
        env.validate_all()
        self._optimizer_ref = weakref.ref(optimizer)
        self._optimizer_class = type(optimizer).__qualname__
        self._precision_aware = bool(precision_aware)
        # Diagnostics run a collective: every rank must agree, so decide from the environment only.
        self._precision_every = 0 if env.sdk_disabled() else env.precision_every()
        compute_dtype = env.compute_dtype()
        self._default_compute_dtype = getattr(torch, compute_dtype) if compute_dtype else None
        self._trace_ranks = env.trace_ranks()
        self._given_tracer_provider = tracer_provider
        self._given_meter_provider = meter_provider
        self._warn = WarnOnce(_logger)
        self._lock = threading.Lock()
        self._ready = False
        self._kept_snapshot: precision.PrecisionSnapshot | None = None
        self._step_count = step_count
        self.rank = 0
        self.world_size = 1

    # -- lazy set-up -------------------------------------------------------------------

    def _ensure_ready(self) -> None:
        if self._ready:
            return
        with self._lock:
            if self._ready:
                return
            self.rank, self.world_size = distributed_rank()
            traced = self._trace_ranks is None or self.rank in self._trace_ranks
            tracer_provider = self._given_tracer_provider or providers.tracer_provider()
            meter_provider = self._given_meter_provider or providers.meter_provider()
            version = providers.instrumentation_version()
            # Untraced ranks skip span work entirely rather than paying for no-op spans.
            self._tracer = (
                tracer_provider.get_tracer(semconv.SCOPE_NAME, version, schema_url=semconv.SCHEMA_URL)
                if traced
                else None
            )
            meter = meter_provider.get_meter(semconv.SCOPE_NAME, version, schema_url=semconv.SCHEMA_URL)
            created = instruments.create_instruments(meter)
            self._cast_size = created[semconv.METRIC_CAST_SIZE]
            self._mismatches = created[semconv.METRIC_DTYPE_MISMATCHES]
            self._nonfinite = created[semconv.METRIC_NONFINITE]
            self._overflow = created[semconv.METRIC_REFRESH_OVERFLOW]
            self._underflow = created[semconv.METRIC_REFRESH_UNDERFLOW]
            self._refresh_error = created[semconv.METRIC_REFRESH_ERROR]
            self._lost_ratio = created[semconv.METRIC_LOST_RATIO]
            self._grad_amax = created[semconv.METRIC_GRAD_AMAX]
            self._precision_steps = created[semconv.METRIC_PRECISION_STEPS]
            self._nonfinite_steps = created[semconv.METRIC_NONFINITE_STEPS]
            self._rank_attrs = {semconv.ATTR_RANK: self.rank}
            self._attr_cache: dict[tuple[Any, ...], dict[str, AttributeValue]] = {}
            self._nonfinite_attrs = {
                (t, k): {**self._rank_attrs, semconv.ATTR_TENSOR: t, semconv.ATTR_NONFINITE_KIND: k}
                for t in semconv.TENSORS
                for k in semconv.NONFINITE_KINDS
            }
            self._base_step_attrs: dict[str, AttributeValue] = {
                semconv.ATTR_RANK: self.rank,
                semconv.ATTR_WORLD_SIZE: self.world_size,
                semconv.ATTR_OPTIMIZER_CLASS: self._optimizer_class,
                semconv.ATTR_PRECISION_AWARE: self._precision_aware,
                semconv.ATTR_CAST_BYTES: 0,
            }
            device = self._parameter_device()
            step_hist = created[semconv.METRIC_STEP_DURATION]
            refresh_hist = created[semconv.METRIC_REFRESH_DURATION]
            attrs = self._rank_attrs
            self._step_timer: DurationRecorder = duration_recorder_for(device, lambda s: step_hist.record(s, attrs))
            self._refresh_timer: DurationRecorder = duration_recorder_for(
                device, lambda s: refresh_hist.record(s, attrs)
            )
            self._scope: StepScope | None = None
            providers.register_observer(self)
            self._ready = True

    def _parameter_device(self) -> torch.device:
        optimizer = self._optimizer_ref()
        if optimizer is not None:
            for group in optimizer.param_groups:
                for param in group["params"]:
                    return param.device
        return torch.device("cpu")

    # -- spans -------------------------------------------------------------------------

    @contextmanager
    def _span(self, name: str, attributes: Mapping[str, AttributeValue] | None) -> Iterator[Span | None]:
        if self._tracer is None:
            yield None
            return
        span = self._tracer.start_span(name, attributes=attributes)
        # Made current so spans opened inside (optimizer hooks, the phases) nest under it.
        token = context_api.attach(trace.set_span_in_context(span))
        try:
            yield span
        except BaseException as exc:
            _fail(span, exc)
            raise
        finally:
            context_api.detach(token)
            span.end()

    @contextmanager
    def step(self) -> Iterator[StepScope]:
        """Span ``fsdp.optimizer.step`` around one ``optimizer.step()``, and its duration.

        Yields:
            The :class:`StepScope` of this step. An exception propagates unchanged after the
            span is marked ERROR with the exception recorded and ``error.type`` set.
        """
        self._ensure_ready()
        self._step_count += 1
        step_number = self._step_count
        # Read back device timings of earlier steps that have finished by now (non-blocking).
        self._step_timer.poll()
        self._refresh_timer.poll()
        span_attrs: dict[str, AttributeValue] | None = None
        if self._tracer is not None:
            span_attrs = {**self._base_step_attrs, semconv.ATTR_STEP: step_number}
        token = self._step_timer.start()
        try:
            with self._span(semconv.SPAN_STEP, span_attrs) as span:
                self._scope = scope = StepScope(step_number, span)
                yield scope
        finally:
            self._scope = None
            # Recorded for failed steps too: one duration per optimizer.step() call.
            self._step_timer.stop(token)

    def step_planned(self, event: StepPlanned) -> None:
        """The step's plan: parameter and FSDP-group counts on the span, its dtype mismatches counted."""
        scope = self._scope
        if scope is not None:
            scope.set_attribute(semconv.ATTR_PARAMS_COUNT, event.params_count)
            scope.set_attribute(semconv.ATTR_GROUPS_COUNT, event.groups_count)
        for mismatch in event.mismatches:
            self._record_mismatches(mismatch.param_dtype, mismatch.grad_dtype, mismatch.action, mismatch.count)

    def grads_cast(self, event: GroupCast) -> None:
        """One group's grad cast: bytes into ``fsdp.optimizer.cast.size`` and the step's ``fsdp.cast.bytes``."""
        self._record_cast(semconv.CAST_KIND_GRAD, event)
        scope = self._scope
        if scope is not None:
            scope.cast_bytes += event.nbytes
            scope.set_attribute(semconv.ATTR_CAST_BYTES, scope.cast_bytes)

    def weights_refreshed(self, event: GroupCast) -> None:
        """One group's compute-weight refresh: bytes into ``fsdp.optimizer.cast.size``."""
        self._record_cast(semconv.CAST_KIND_WEIGHT_REFRESH, event)

    @contextmanager
    def phase(self, phase: Phase) -> Iterator[None]:
        """Child span of the step for ``phase``; ``REFRESH`` is also timed into its histogram."""
        self._ensure_ready()
        span_name = _PHASE_SPANS[phase]
        if phase is not Phase.REFRESH:
            with self._span(span_name, None):
                yield
            return
        token = self._refresh_timer.start()
        try:
            with self._span(span_name, None):
                yield
        finally:
            self._refresh_timer.stop(token)

    @contextmanager
    def zero_grad(self, set_to_none: bool) -> Iterator[None]:
        """Span ``fsdp.optimizer.zero_grad`` around one ``optimizer.zero_grad()``."""
        self._ensure_ready()
        attrs = {semconv.ATTR_RANK: self.rank, semconv.ATTR_ZERO_GRAD_SET_TO_NONE: bool(set_to_none)}
        with self._span(semconv.SPAN_ZERO_GRAD, attrs):
            yield

    # -- metrics -----------------------------------------------------------------------

    def _cached(self, key: tuple[Any, ...], build: Any) -> dict[str, AttributeValue]:
        attrs = self._attr_cache.get(key)
        if attrs is None:
            attrs = self._attr_cache[key] = {**self._rank_attrs, **build()}
        return attrs

    def _record_cast(self, kind: str, event: GroupCast) -> None:
        self._ensure_ready()
        attrs = self._cached(
            ("cast", kind, event.source, event.target),
            lambda: {
                semconv.ATTR_CAST_KIND: kind,
                semconv.ATTR_DTYPE_SOURCE: dtype_name(event.source),
                semconv.ATTR_DTYPE_TARGET: dtype_name(event.target),
            },
        )
        self._cast_size.add(event.nbytes, attrs)

    def _record_mismatches(
        self, param_dtype: torch.dtype, grad_dtype: torch.dtype, action: MismatchAction, count: int
    ) -> None:
        self._ensure_ready()
        attrs = self._cached(
            ("mismatch", param_dtype, grad_dtype, action),
            lambda: {
                semconv.ATTR_DTYPE_PARAM: dtype_name(param_dtype),
                semconv.ATTR_DTYPE_GRAD: dtype_name(grad_dtype),
                semconv.ATTR_MISMATCH_ACTION: _MISMATCH_ACTIONS[action],
            },
        )
        self._mismatches.add(count, attrs)

    # -- precision diagnostics ---------------------------------------------------------

    @property
    def precision_every(self) -> int:
        """Diagnostics interval from ``FSDP_PATCH_PRECISION_EVERY``; 0 when off (or when the SDK is disabled)."""
        return self._precision_every

    @property
    def collective_settings(self) -> tuple[bool, int]:
        """``(True, diagnostics interval)``: what every rank's adapted optimizer must agree on."""
        return (True, self._precision_every)

    def precision_due(self, step_number: int) -> bool:
        """Whether step ``step_number`` runs the diagnostics: step 1, then every N-th step.

        Step 1 is included so that short runs report once and the snapshot's memory peak shows
        at the start of a run rather than hours in. Depends only on the environment and the
        step number, so every rank agrees (the diagnostics run a collective).
        """
        every = self._precision_every
        return every > 0 and (step_number == 1 or step_number % every == 0)

    def precision_begin(self, groups: Sequence[Any]) -> precision.PrecisionSnapshot:
        """Copy the weights before the inner step; call after the grad cast, before ``INNER_STEP``.

        With diagnostics on every step the copy's buffers are kept and reused from step to step
        (memory the diagnostics need on each step anyway); with a longer interval they are
        released after each diagnostic step.
        """
        snapshot = precision.take_snapshot(groups, self._default_compute_dtype, reuse=self._kept_snapshot)
        self._kept_snapshot = snapshot if self._precision_every == 1 else None
        return snapshot

    def precision_end(self, snapshot: precision.PrecisionSnapshot, groups: Sequence[Any]) -> None:
        """Compute, reduce across ranks and record the diagnostics; call after the refresh.

        Reads the buffers and writes none. A local failure is logged once and this rank's
        contribution becomes unknown (NaN), but the rank still joins the collective so the
        others do not hang; nothing is recorded for that step.
        """
        self._ensure_ready()
        try:
            local = precision.local_stats(snapshot, groups)
        except Exception as exc:
            self._warn("precision", "fsdp_patch telemetry: precision diagnostics failed on rank %d (%s: %s); "
                       "their metrics are skipped.", self.rank, type(exc).__name__, exc)  # fmt: skip
            local = precision.nan_stats(self._parameter_device())
        stats = precision.stats_from_vector(precision.reduce_stats(local, precision.first_process_group(groups)))
        if not stats.complete:
            return
        self._record_precision(stats)

    def _record_precision(self, stats: precision.PrecisionStats) -> None:
        for key, count in stats.nonfinite.items():
            self._nonfinite.add(count, self._nonfinite_attrs[key])
        # Every diagnosed step adds to both (0 for a clean step), so the series exist from step 1.
        self._precision_steps.add(1, self._rank_attrs)
        self._nonfinite_steps.add(1 if any(stats.nonfinite.values()) else 0, self._rank_attrs)
        self._overflow.add(stats.overflow, self._rank_attrs)
        self._underflow.add(stats.underflow, self._rank_attrs)
        for gauge, value in (
            (self._refresh_error, stats.refresh_error),
            (self._lost_ratio, stats.lost_ratio),
            (self._grad_amax, stats.grad_amax),
        ):
            # Gauges reject NaN/Inf with a warning per call; only fp32 overflow of the norms gets here.
            if math.isfinite(value):
                gauge.set(value, self._rank_attrs)
        span = trace.get_current_span()
        if span.is_recording():
            # On the precision span, so a trace shows the numbers of the step it belongs to.
            span.set_attributes(
                {
                    semconv.METRIC_REFRESH_OVERFLOW: stats.overflow,
                    semconv.METRIC_REFRESH_UNDERFLOW: stats.underflow,
                    semconv.METRIC_REFRESH_ERROR: stats.refresh_error,
                    semconv.METRIC_LOST_RATIO: stats.lost_ratio,
                    semconv.METRIC_GRAD_AMAX: stats.grad_amax,
                    semconv.METRIC_NONFINITE: sum(stats.nonfinite.values()),
                }
            )

    # -- life cycle --------------------------------------------------------------------

    def flush_timers(self) -> None:
        """Record every pending device timing; may wait for the device, so only at flush or exit."""
        if self._ready:
            self._step_timer.flush()
            self._refresh_timer.flush()

    @property
    def step_count(self) -> int:
        """Steps observed so far."""
        return self._step_count
