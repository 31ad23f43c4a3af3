"""Spans and metrics around one adapted optimizer: what ``fsdp_patch.optimizer`` calls per step.

The step's spans, its casts and dtype mismatches, and its timings are here; the precision
diagnostics of the steps that run them, and the dtype-contract audit, are the
:class:`~.precision_recorder.PrecisionRecorder` the observer owns.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from opentelemetry import context as context_api
from opentelemetry import metrics, trace
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Span
from opentelemetry.util.types import AttributeValue

from fsdp_patch.adapter.events import GroupCast, MismatchAction, Phase, StepPlanned

from .. import env, semconv
from ..diagnostics.groups import PrecisionSnapshot
from ..export import providers
from ..export.isolation import WarnOnce
from ..export.ranks import distributed_rank, note_mesh_coordinate
from . import instruments
from .instruments import AttributeCache, dtype_name
from .iterations import IterationWatch
from .precision_recorder import PrecisionRecorder
from .recorded_spans import SpanMaker
from .step_spans import StepScope, emit_phases, fail_span
from .timing import DurationRecorder, duration_recorder_for

_logger = logging.getLogger(__name__)

_PHASE_SPANS = {
    Phase.CAST_GRADS: semconv.SPAN_CAST_GRADS,
    Phase.INNER_STEP: semconv.SPAN_INNER_STEP,
    Phase.RESTORE_GRADS: semconv.SPAN_RESTORE_GRADS,
    Phase.REFRESH: semconv.SPAN_REFRESH,
    Phase.PRECISION: semconv.SPAN_PRECISION,
}
# Phases whose spans are current while they run (see :mod:`.step_spans`).
_LIVE_PHASES = frozenset({Phase.INNER_STEP, Phase.PRECISION})
_MISMATCH_ACTIONS = {
    MismatchAction.CAST: semconv.MISMATCH_CAST,
    MismatchAction.PASSTHROUGH: semconv.MISMATCH_PASSTHROUGH,
    MismatchAction.REJECTED: semconv.MISMATCH_REJECTED,
}


class OptimizerObserver:
    """Emits the spans and metrics of docs/conventions.md for one optimizer (a ``StepObserver``).

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
        self._trace_ranks = env.trace_ranks()
        self._given_tracer_provider = tracer_provider
        self._given_meter_provider = meter_provider
        self._warn = WarnOnce(_logger)
        self._lock = threading.Lock()
        self._ready = False
        self._precision = PrecisionRecorder(optimizer, sdk_disabled=env.sdk_disabled(), warn=self._warn)
        self._step_count = step_count
        self.rank = 0
        self.world_size = 1
        self._iterations = IterationWatch(optimizer, self, sdk_disabled=env.sdk_disabled())

    # -- lazy set-up -------------------------------------------------------------------

    def ensure_ready(self) -> None:
        """Resolve providers, rank and instruments now (a model's backward pass may come first)."""
        self._ensure_ready()

    def _ensure_ready(self) -> None:
        if self._ready:
            return
        with self._lock:
            if self._ready:
                return
            self.rank, self.world_size = distributed_rank()
            # Before the providers are resolved: the embedded default builds them now, and puts
            # the mesh coordinate of the model it finds sharded into their resource (the step
            # spans carry it too, for an application's providers built before any mesh).
            coordinate = self._iterations.mesh_coordinate()
            if coordinate is not None:
                note_mesh_coordinate(coordinate)
            traced = self._trace_ranks is None or self.rank in self._trace_ranks
            tracer_provider = self._given_tracer_provider or providers.tracer_provider()
            meter_provider = self._given_meter_provider or providers.meter_provider()
            version = providers.instrumentation_version()
            # Untraced ranks skip span work entirely rather than paying for no-op spans.
            self._tracer = (
                SpanMaker(
                    tracer_provider.get_tracer(semconv.SCOPE_NAME, version, schema_url=semconv.SCHEMA_URL),
                    InstrumentationScope(semconv.SCOPE_NAME, version, semconv.SCHEMA_URL),
                )
                if traced
                else None
            )
            meter = meter_provider.get_meter(semconv.SCOPE_NAME, version, schema_url=semconv.SCHEMA_URL)
            created = instruments.create_instruments(meter)
            self._cast_size = created[semconv.METRIC_CAST_SIZE]
            self._skipped_steps = created[semconv.METRIC_OPTIMIZER_SKIPPED_STEPS]
            self._mismatches = created[semconv.METRIC_DTYPE_MISMATCHES]
            self._rank_attrs: dict[str, AttributeValue] = {semconv.ATTR_RANK: self.rank}
            self._attrs = AttributeCache(self._rank_attrs)
            self._precision.bind(created, self.rank, self._parameter_device)
            self._base_step_attrs: dict[str, AttributeValue] = {
                semconv.ATTR_RANK: self.rank,
                semconv.ATTR_WORLD_SIZE: self.world_size,
                semconv.ATTR_OPTIMIZER_CLASS: self._optimizer_class,
                semconv.ATTR_PRECISION_AWARE: self._precision_aware,
                semconv.ATTR_CAST_BYTES: 0,
            }
            if coordinate is not None:
                self._base_step_attrs[semconv.ATTR_MESH_COORDINATE] = coordinate
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
            fail_span(span, exc)
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
                self._iterations.begin_step(step_number, span, self.rank)
                completed = False
                try:
                    yield scope
                    completed = True
                finally:
                    if self._tracer is not None:
                        emit_phases(self._tracer, scope)
                    self._end_casts(scope)
                    self._iterations.end_step(span, completed, scope.set_attribute)
                    scope.end_attributes()
                self._precision.audit_if_due(step_number, span)
        finally:
            self._scope = None
            # Recorded for failed steps too: one duration per optimizer.step() call.
            self._step_timer.stop(token)

    def name_violation(self, *args: Any, **kwargs: Any) -> None:
        """A tensor in a dtype its role does not take (:meth:`PrecisionRecorder.name_violation`)."""
        self._ensure_ready()
        self._precision.name_violation(*args, **kwargs)

    def loss_scaled(self) -> None:
        """A ``torch.amp.GradScaler`` steps this optimizer: its grads were computed scaled (their
        small values are no float16 underflow)."""
        self._precision.loss_scaled = True

    def step_skipped(self, scale: float) -> None:
        """A ``torch.amp.GradScaler`` ended an iteration without stepping the optimizer: span
        ``fsdp.optimizer.skipped_step``, counted, with the iteration's checks."""
        self._ensure_ready()
        attrs: dict[str, AttributeValue] = {
            semconv.ATTR_STEP: self._step_count + 1,
            semconv.ATTR_RANK: self.rank,
            semconv.ATTR_GRAD_SCALER_SCALE: scale,
        }
        self._skipped_steps.add(1, self._rank_attrs)
        with self._span(semconv.SPAN_SKIPPED_STEP, attrs) as span:
            self._iterations.skipped(self._step_count + 1, span, self.rank)

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

    def weights_refreshed(self, event: GroupCast) -> None:
        """One group's compute-weight refresh: bytes into ``fsdp.optimizer.cast.size``."""
        self._record_cast(semconv.CAST_KIND_WEIGHT_REFRESH, event)

    @contextmanager
    def phase(self, phase: Phase) -> Iterator[None]:
        """Child span of the step for ``phase``; ``REFRESH`` is also timed into its histogram.
        The inner step and the diagnostics run in their span; the other phases' spans are made
        as the step ends, from the times noted here (:mod:`.step_spans`)."""
        self._ensure_ready()
        span_name = _PHASE_SPANS[phase]
        scope = self._scope
        token = self._refresh_timer.start() if phase is Phase.REFRESH else None
        try:
            if phase in _LIVE_PHASES or scope is None:
                if scope is not None and self._tracer is not None:
                    emit_phases(self._tracer, scope)  # the phases before it end first, as they ran
                with self._span(span_name, None):
                    yield
            elif self._tracer is None:
                yield
            else:
                start = time.time_ns()
                try:
                    yield
                except BaseException as exc:
                    scope.phases.append((span_name, start, time.time_ns(), exc))
                    raise
                scope.phases.append((span_name, start, time.time_ns(), None))
        finally:
            if token is not None:
                self._refresh_timer.stop(token)

    @contextmanager
    def zero_grad(self, set_to_none: bool) -> Iterator[None]:
        """Span ``fsdp.optimizer.zero_grad`` around one ``optimizer.zero_grad()``."""
        self._ensure_ready()
        attrs = {semconv.ATTR_RANK: self.rank, semconv.ATTR_ZERO_GRAD_SET_TO_NONE: bool(set_to_none)}
        with self._span(semconv.SPAN_ZERO_GRAD, attrs):
            yield

    # -- metrics -----------------------------------------------------------------------

    def _record_cast(self, kind: str, event: GroupCast) -> None:
        self._ensure_ready()
        key = ("cast", kind, event.source, event.target)
        attrs = self._attrs.get(
            key,
            lambda: {
                semconv.ATTR_CAST_KIND: kind,
                semconv.ATTR_DTYPE_SOURCE: dtype_name(event.source),
                semconv.ATTR_DTYPE_TARGET: dtype_name(event.target),
            },
        )
        scope = self._scope
        if scope is None:
            self._cast_size.add(event.nbytes, attrs)
            return
        held = scope.casts.get(key)
        scope.casts[key] = (attrs, event.nbytes + (held[1] if held is not None else 0))

    def _end_casts(self, scope: StepScope) -> None:
        """The step's casts into ``fsdp.optimizer.cast.size`` and its span's ``fsdp.cast.bytes``,
        once each (also for a step that raised: what was cast before it raised)."""
        for attrs, nbytes in scope.casts.values():
            self._cast_size.add(nbytes, attrs)
        scope.casts.clear()
        if scope.cast_bytes:
            scope.set_attribute(semconv.ATTR_CAST_BYTES, scope.cast_bytes)

    def _record_mismatches(
        self, param_dtype: torch.dtype, grad_dtype: torch.dtype, action: MismatchAction, count: int
    ) -> None:
        self._ensure_ready()
        attrs = self._attrs.get(
            ("mismatch", param_dtype, grad_dtype, action),
            lambda: {
                semconv.ATTR_DTYPE_PARAM: dtype_name(param_dtype),
                semconv.ATTR_DTYPE_GRAD: dtype_name(grad_dtype),
                semconv.ATTR_MISMATCH_ACTION: _MISMATCH_ACTIONS[action],
            },
        )
        self._mismatches.add(count, attrs)

    # -- precision diagnostics (PrecisionRecorder) -------------------------------------

    @property
    def precision_every(self) -> int:
        """Diagnostics interval from ``FSDP_PATCH_PRECISION_EVERY``; 0 when off (or when the SDK is disabled)."""
        return self._precision.every

    @property
    def collective_settings(self) -> tuple[bool, int, bool, int, bool]:
        """``(True, diagnostics interval, per-parameter detail, escalation, per-iteration checks)``:
        what every rank's adapted optimizer must agree on (the detail changes the size of the
        diagnostics' collective, escalation the steps that run it, the checks add one per step)."""
        return (
            True,
            self._precision.every,
            self._precision.per_parameter,
            self._iterations.escalation,
            self._iterations.checking,
        )

    def precision_due(self, step_number: int) -> bool:
        """Whether step ``step_number`` runs the diagnostics (:meth:`PrecisionRecorder.due`), or
        escalation asks for them."""
        return self._precision.due(step_number) or self._iterations.escalated

    def precision_begin(self, groups: Sequence[Any]) -> PrecisionSnapshot:
        """Copy the weights before the inner step; call after the grad cast, before ``INNER_STEP``."""
        return self._precision.begin(groups)

    def precision_end(self, snapshot: PrecisionSnapshot, groups: Sequence[Any]) -> None:
        """Compute, reduce across ranks and record the diagnostics; call after the refresh
        (:meth:`PrecisionRecorder.end`)."""
        self._ensure_ready()
        step = self._scope.step_number if self._scope is not None else self._step_count
        self._precision.end(snapshot, groups, step)

    # -- life cycle --------------------------------------------------------------------

    def flush_timers(self) -> None:
        """Record every pending device timing and the last iteration's checks; may wait for the
        device, so only at flush or exit. An audited iteration a flush comes in the middle of is
        abandoned: a flush is the end of a run (``destroy_process_group``, exit), and an audit
        left running would measure whatever the process does after training."""
        self._iterations.audits.close()
        self._iterations.shadows.close()
        if self._ready:
            self._step_timer.flush()
            self._refresh_timer.flush()
            unstepped = self._iterations.backward_since_step()
            if self._iterations.pending() or unstepped:
                attrs: dict[str, AttributeValue] = {
                    semconv.ATTR_STEP: self._step_count,
                    semconv.ATTR_RANK: self.rank,
                    semconv.ATTR_BACKWARD_COUNT: unstepped,
                }
                with self._span(semconv.SPAN_CHECKS, attrs) as span:
                    self._iterations.flush(self.rank, span)

    def close(self) -> None:
        """Remove the model checks, the process-wide wrappers and the optimizer's load hook this
        observer registered."""
        self._iterations.close()
        self._precision.close()

    @property
    def state_loaded_at(self) -> str | None:
        """Where the script last loaded the optimizer's state (``file:line in function``), if it did."""
        return self._precision.loaded_at

    @property
    def step_count(self) -> int:
        """Steps observed so far."""
        return self._step_count
