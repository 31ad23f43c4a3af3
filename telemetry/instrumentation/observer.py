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

from .. import env, semconv
from ..diagnostics import attribution, dtype_contract, optimizer_state, param_stats, precision
from ..diagnostics import rows as row_spec
from ..diagnostics.groups import PrecisionSnapshot, first_process_group, take_snapshot
from ..export import providers
from ..export.isolation import WarnOnce
from ..export.ranks import distributed_rank
from . import instruments
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
        self._kept_snapshot: PrecisionSnapshot | None = None
        top_k = env.precision_top_k()
        self._attribution = attribution.Attribution(top_k, env.precision_window()) if top_k else None
        self._state_tensors = optimizer_state.StateTensors()
        self._unit_detail = env.precision_detail() == semconv.DETAIL_UNIT
        # The optimizer.state object the last dtype audit read (a load replaces it), and what it named.
        self._audited_state: Any = None
        self._named_violations: set[tuple[Any, ...]] = set()
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
            self._dtype_contract = created[semconv.METRIC_DTYPE_CONTRACT]
            self._skipped_steps = created[semconv.METRIC_SKIPPED_STEPS]
            self._precision_steps = created[semconv.METRIC_PRECISION_STEPS]
            self._nonfinite_steps = created[semconv.METRIC_NONFINITE_STEPS]
            self._rank_attrs: dict[str, AttributeValue] = {semconv.ATTR_RANK: self.rank}
            self._attr_cache: dict[tuple[Any, ...], dict[str, AttributeValue]] = {}
            self._nonfinite_attrs: dict[tuple[str, str], dict[str, AttributeValue]] = {
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
                self._audit_if_due(step_number, span)
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
    def collective_settings(self) -> tuple[bool, int, bool]:
        """``(True, diagnostics interval, per-parameter detail)``: what every rank's adapted
        optimizer must agree on (the detail changes the size of the diagnostics' collective)."""
        return (True, self._precision_every, self._attribution is not None and self._precision_every > 0)

    def precision_due(self, step_number: int) -> bool:
        """Whether step ``step_number`` runs the diagnostics: step 1, then every N-th step.

        Step 1 is included so that short runs report once and the snapshot's memory peak shows
        at the start of a run rather than hours in. Depends only on the environment and the
        step number, so every rank agrees (the diagnostics run a collective).
        """
        every = self._precision_every
        return every > 0 and (step_number == 1 or step_number % every == 0)

    def precision_begin(self, groups: Sequence[Any]) -> PrecisionSnapshot:
        """Copy the weights before the inner step; call after the grad cast, before ``INNER_STEP``.

        With diagnostics on every step the copy's buffers are kept and reused from step to step
        (memory the diagnostics need on each step anyway); with a longer interval they are
        released after each diagnostic step.
        """
        snapshot = take_snapshot(groups, self._default_compute_dtype, reuse=self._kept_snapshot)
        self._kept_snapshot = snapshot if self._precision_every == 1 else None
        return snapshot

    def precision_end(self, snapshot: PrecisionSnapshot, groups: Sequence[Any]) -> None:
        """Compute, reduce across ranks and record the diagnostics; call after the refresh.

        One row of numbers per parameter (:mod:`param_stats`), every rank's rows combined by one
        all-gather; the whole-model metrics are their sums, the per-parameter findings
        (:mod:`attribution`) go on the precision span. Reads the buffers and writes none. A local
        failure is logged once and this rank's contribution becomes unknown (NaN), but the rank
        still joins the collective so the others do not hang; nothing is recorded for that step.
        """
        self._ensure_ready()
        detail = self._attribution is not None
        optimizer = self._optimizer_ref()
        table: list[row_spec.ParamSlot] | None = None
        keys: list[tuple[str, ...]] = []
        try:
            table = row_spec.param_table(groups, self._default_compute_dtype, per_parameter=detail)
            states, update_slots = None, None
            if self._attribution is not None:
                update_slots = self._attribution.update_slots(table)
                if optimizer is not None:
                    states, keys = self._state_tensors.read(optimizer, table)
            local = row_spec.payload(
                param_stats.local_rows(snapshot, groups, table, states, detail=detail, update_slots=update_slots)
            )
        except Exception as exc:
            self._warn("precision", "fsdp_patch telemetry: precision diagnostics failed on rank %d (%s: %s); "
                       "their metrics are skipped.", self.rank, type(exc).__name__, exc)  # fmt: skip
            count = len(table) if table is not None else row_spec.slot_count(groups, per_parameter=detail)
            local = row_spec.failed_payload(count, self._parameter_device())
        gathered = row_spec.gather_rows(local, first_process_group(groups))
        reduced, complete = row_spec.split_status(row_spec.reduce_gathered(gathered))
        stats = precision.stats_from_vector(row_spec.totals(reduced))
        if not (complete and stats.complete) or table is None:
            return
        rows = reduced.tolist()
        self._record_precision(stats, table, rows)
        if self._attribution is None or optimizer is None:
            return
        if not keys:
            keys = [()] * len(table)
        contexts = optimizer_state.contexts_for(optimizer, table, keys)

        def ranks_of(slot: int, slots: Sequence[int]) -> tuple[int, ...]:
            counts = gathered[:, slot, list(slots)].sum(dim=1).tolist()
            return tuple(rank for rank, count in enumerate(counts) if count)

        step = self._scope.step_number if self._scope is not None else self._step_count
        findings = self._attribution.analyze(step, table, rows, contexts, ranks_of)
        if findings.skipped:
            self._skipped_steps.add(1, self._rank_attrs)
        span = trace.get_current_span()
        if span.is_recording():
            self._record_findings(span, step, table, findings, self._attribution.top_k)

    def _record_findings(self, span: Span, step: int, table: Sequence[row_spec.ParamSlot],
                         findings: attribution.StepFindings, top_k: int) -> None:  # fmt: skip
        span.set_attributes({
            semconv.ATTR_STUCK_PARAMS: findings.stuck,
            semconv.ATTR_UNSTEPPED_PARAMS: findings.unstepped,
            semconv.ATTR_STATE_NONFINITE: findings.state_nonfinite,
            semconv.ATTR_STATE_FLUSHED: findings.state_flushed,
            semconv.ATTR_STEP_SKIPPED: int(findings.skipped),
        })  # fmt: skip
        first = findings.first_nonfinite
        if first is not None:
            slot = table[first.slots[0]]
            attrs: dict[str, AttributeValue] = {
                semconv.ATTR_STEP: step,
                semconv.ATTR_PARAM: slot.name,
                semconv.ATTR_UNIT: slot.unit,
                semconv.ATTR_TENSOR: first.tensor,
                semconv.ATTR_RANKS: list(first.ranks),
                semconv.ATTR_NONFINITE_KIND: semconv.NONFINITE_NAN if first.nan else semconv.NONFINITE_INF,
                semconv.ATTR_PRECISION_ELEMENTS: first.nan + first.inf,
                semconv.ATTR_PRECISION_PARAMS: [table[i].name for i in first.slots[:top_k]],
                semconv.ATTR_PRECISION_PARAMS_COUNT: len(first.slots),
            }
            if first.state_key is not None:
                attrs[semconv.ATTR_OPTIMIZER_STATE] = first.state_key
            span.add_event(semconv.EVENT_FIRST_NONFINITE, attrs)
        for offender in findings.offenders:
            slot = table[offender.slot]
            attrs = {
                semconv.ATTR_DIAGNOSTIC: offender.diagnostic,
                semconv.ATTR_PARAM: slot.name,
                semconv.ATTR_UNIT: slot.unit,
                semconv.ATTR_VALUE: offender.value,
            }
            if offender.state_key is not None:
                attrs[semconv.ATTR_OPTIMIZER_STATE] = offender.state_key
            if offender.cause is not None:
                attrs[semconv.ATTR_CAUSE] = offender.cause
            span.add_event(semconv.EVENT_OFFENDER, attrs)

    def _record_precision(self, stats: precision.PrecisionStats, table: Sequence[row_spec.ParamSlot],
                          rows: Sequence[Sequence[float]]) -> None:  # fmt: skip
        # Every diagnosed step adds to both (0 for a clean step), so the series exist from step 1.
        self._precision_steps.add(1, self._rank_attrs)
        self._nonfinite_steps.add(1 if any(stats.nonfinite.values()) else 0, self._rank_attrs)
        if self._unit_detail:
            for unit, row in attribution.unit_rows(table, rows).items():
                self._record_metrics(attribution.stats_of_row(row), {**self._rank_attrs, semconv.ATTR_UNIT: unit})
        else:
            self._record_metrics(stats, self._rank_attrs)
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

    def _record_metrics(self, stats: precision.PrecisionStats, attrs: dict[str, AttributeValue]) -> None:
        nonfinite_attrs = self._nonfinite_attrs if attrs is self._rank_attrs else None
        for key, count in stats.nonfinite.items():
            if nonfinite_attrs is not None:
                point = nonfinite_attrs[key]
            else:
                point = self._cached(("nonfinite", attrs.get(semconv.ATTR_UNIT), *key),
                                     lambda key=key: {**attrs, semconv.ATTR_TENSOR: key[0], semconv.ATTR_NONFINITE_KIND: key[1]})  # fmt: skip
            self._nonfinite.add(count, point)
        self._overflow.add(stats.overflow, attrs)
        self._underflow.add(stats.underflow, attrs)
        for gauge, value in (
            (self._refresh_error, stats.refresh_error),
            (self._lost_ratio, stats.lost_ratio),
            (self._grad_amax, stats.grad_amax),
        ):
            # Gauges reject NaN/Inf with a warning per call; only fp32 overflow of the norms gets here.
            if math.isfinite(value):
                gauge.set(value, attrs)

    # -- dtype contract ----------------------------------------------------------------

    def _audit_if_due(self, step_number: int, span: Span | None) -> None:
        """The dtype-contract audit: at the first step, after the optimizer's state was loaded
        (``load_state_dict`` replaces ``optimizer.state``) and on every diagnosed step; each
        violation is named once (span event on the step, counter)."""
        optimizer = self._optimizer_ref()
        if optimizer is None:
            return
        if optimizer.state is self._audited_state and not self.precision_due(step_number):
            return
        self._audited_state = optimizer.state
        try:
            violations = dtype_contract.audit_dtypes(optimizer)
        except Exception as exc:
            self._warn("audit", "fsdp_patch telemetry: the dtype-contract audit failed on rank %d (%s: %s).",
                       self.rank, type(exc).__name__, exc)  # fmt: skip
            return
        for violation in violations:
            if violation.key in self._named_violations:
                continue
            self._named_violations.add(violation.key)
            expected, actual = dtype_name(violation.expected), dtype_name(violation.actual)
            self._dtype_contract.add(1, self._cached(
                ("contract", violation.tensor, expected, actual),
                lambda v=violation, e=expected, a=actual: {semconv.ATTR_TENSOR: v.tensor, semconv.ATTR_DTYPE_EXPECTED: e,
                                                           semconv.ATTR_DTYPE_ACTUAL: a},
            ))  # fmt: skip
            if span is not None:
                attrs: dict[str, AttributeValue] = {
                    semconv.ATTR_STEP: step_number,
                    semconv.ATTR_RANK: self.rank,
                    semconv.ATTR_PARAM: violation.param,
                    semconv.ATTR_UNIT: violation.unit,
                    semconv.ATTR_TENSOR: violation.tensor,
                    semconv.ATTR_DTYPE_EXPECTED: expected,
                    semconv.ATTR_DTYPE_ACTUAL: actual,
                }
                if violation.state_key is not None:
                    attrs[semconv.ATTR_OPTIMIZER_STATE] = violation.state_key
                span.add_event(semconv.EVENT_DTYPE_CONTRACT, attrs)

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
