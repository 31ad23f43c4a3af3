"""The precision diagnostics of one adapted optimizer, and what they record.

:class:`~.observer.OptimizerObserver` owns one :class:`PrecisionRecorder` and hands it the steps
the adapter diagnoses: when they run (:meth:`PrecisionRecorder.due`), the copy of the weights
before the step, the rows computed after the refresh and combined over the ranks with one
all-gather, and what comes of them: the whole-model metrics, their values on the
``fsdp.optimizer.precision`` span, the attribution's findings as span events, and the
dtype-contract audit's violations (each named once).
"""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from opentelemetry import trace
from opentelemetry.trace import Span
from opentelemetry.util.types import AttributeValue

from .. import env, semconv
from ..diagnostics import attribution, dtype_contract, optimizer_state, param_stats, precision, replicas
from ..diagnostics import rows as row_spec
from ..diagnostics.groups import PrecisionSnapshot, take_snapshot
from ..diagnostics.op_sites import site_here
from ..diagnostics.reduced_rows import reduce_on_host
from ..export.isolation import WarnOnce
from .instruments import AttributeCache, CounterAdds, dtype_name

_logger = logging.getLogger(__name__)


def _in_one_two_five_series(step_number: int) -> bool:
    """Whether ``step_number`` is 1, 2 or 5 times a power of ten."""
    while step_number % 10 == 0:
        step_number //= 10
    return step_number in (1, 2, 5)


class PrecisionRecorder:
    """When the diagnostics run for one optimizer, their computation and their record.

    Construction parses the diagnostics' ``FSDP_PATCH_*`` variables (a malformed one fails when
    the optimizer is adapted); :meth:`bind` hands over the instruments and the rank once the
    observer's providers are resolved.

    Args:
        optimizer: The adapted optimizer, held weakly.
        sdk_disabled: ``OTEL_SDK_DISABLED``: no diagnostics at all.
        warn: The observer's once-per-kind warning.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, sdk_disabled: bool, warn: WarnOnce) -> None:
        self._optimizer_ref = weakref.ref(optimizer)
        # Diagnostics run a collective: every rank must agree, so decide from the environment only.
        self.every = 0 if sdk_disabled else env.precision_every()
        compute_dtype = env.compute_dtype()
        self._default_compute_dtype = getattr(torch, compute_dtype) if compute_dtype else None
        top_k = env.precision_top_k()
        window = env.precision_window()
        self._attribution = attribution.Attribution(top_k, window) if top_k else None
        self._named_per_finding = max(top_k, 1)
        self._early_steps = window
        self._state_tensors = optimizer_state.StateTensors()
        self._unit_detail = env.precision_detail() == semconv.DETAIL_UNIT
        self._warn = warn
        self._kept_snapshot: PrecisionSnapshot | None = None
        # The optimizer.state object the last dtype audit read (a load replaces it), and what it named.
        self._audited_state: Any = None
        self._named_violations: set[tuple[Any, ...]] = set()
        # Where the script last called optimizer.load_state_dict (file:line in function), and
        # whether it did since the last diagnosed step: a post hook on this optimizer, which
        # close() removes, sets both.
        self.loaded_at: str | None = None
        self._loaded_since = False
        self._load_hook: Any = None
        try:
            self._load_hook = optimizer.register_load_state_dict_post_hook(self._state_loaded)
        except AttributeError:  # an optimizer that skipped Optimizer.__init__: no load is placed
            pass
        self.rank = 0
        # Set once a torch.amp.GradScaler steps this optimizer: its grads were computed scaled.
        self.loss_scaled = False

    def _state_loaded(self, optimizer: torch.optim.Optimizer) -> None:
        self._loaded_since = True
        site = site_here(1)
        if site is not None and (site.caller or site.file):
            self.loaded_at = site.caller or site.where

    def close(self) -> None:
        """Remove the load hook from the optimizer (telemetry turned off for it)."""
        if self._load_hook is not None:
            self._load_hook.remove()
            self._load_hook = None

    @property
    def per_parameter(self) -> bool:
        """Whether the diagnosed steps compute a row per parameter (the attribution is on)."""
        return self._attribution is not None and self.every > 0

    def bind(self, created: dict[str, Any], rank: int, device: Callable[[], torch.device]) -> None:
        """The instruments (``instruments.create_instruments``), this rank, and where a failed
        rank's placeholder rows go."""
        self.rank = rank
        self._device = device
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
        self._counts = CounterAdds()
        self._rank_attrs: dict[str, AttributeValue] = {semconv.ATTR_RANK: rank}
        self._attrs = AttributeCache(self._rank_attrs)
        self._nonfinite_attrs: dict[tuple[str, str], dict[str, AttributeValue]] = {
            (t, k): {**self._rank_attrs, semconv.ATTR_TENSOR: t, semconv.ATTR_NONFINITE_KIND: k}
            for t in semconv.TENSORS
            for k in semconv.NONFINITE_KINDS
        }

    def due(self, step_number: int) -> bool:
        """Whether step ``step_number`` runs the diagnostics (the schedule of ``telemetry/README.md``).

        Dense where set-up bugs show, sparse in the steady state: steps 1 to W, W the window of
        diagnosed steps in a row that names a stuck or unstepped parameter
        (``FSDP_PATCH_PRECISION_WINDOW``, 3), so that one stuck from the start is named at step W;
        then the steps of the 1-2-5 series below the interval N (5, 10, 20, 50 for N = 100); then
        every N-th step. A run of 20 steps is diagnosed on 6 of them; past step N the schedule is
        every N-th step alone, the cost the interval sets. Step 1 also shows the snapshot's memory
        peak at the start of a run rather than hours in. Depends only on the environment and the
        step number, so every rank agrees (the diagnostics run a collective).
        """
        if self.every <= 0:
            return False
        if step_number <= self._early_steps or step_number % self.every == 0:
            return True
        return step_number < self.every and _in_one_two_five_series(step_number)

    def begin(self, groups: Sequence[Any]) -> PrecisionSnapshot:
        """Copy the weights before the inner step.

        With diagnostics on every step the copy's buffers are kept and reused from step to step
        (memory the diagnostics need on each step anyway); with a longer interval they are
        released after each diagnostic step.
        """
        snapshot = take_snapshot(groups, self._default_compute_dtype, reuse=self._kept_snapshot)
        self._kept_snapshot = snapshot if self.every == 1 else None
        return snapshot

    def end(self, snapshot: PrecisionSnapshot, groups: Sequence[Any], step: int) -> None:
        """Compute, reduce across ranks and record the diagnostics of step ``step``.

        One row of numbers per parameter (:mod:`~..diagnostics.param_stats`), every rank's rows
        combined by one all-gather; the whole-model metrics are their sums, the per-parameter
        findings (:mod:`~..diagnostics.attribution`) go on the precision span. Reads the buffers
        and writes none. A local failure is logged once and this rank's contribution becomes
        unknown (NaN), but the rank still joins the collective so the others do not hang; nothing
        is recorded for that step.
        """
        detail = self._attribution is not None
        optimizer = self._optimizer_ref()
        table: list[row_spec.ParamSlot] | None = None
        keys: list[tuple[str, ...]] = []
        first: param_stats.FirstRound | None = None
        try:
            table = row_spec.param_table(groups, self._default_compute_dtype, per_parameter=detail)
            states = None
            if self._attribution is not None and optimizer is not None:
                states, keys = self._state_tensors.read(optimizer, table)
            underflow_below = self._underflow_below(table)
            first = param_stats.first_round(
                snapshot, groups, table, states, detail=detail, underflow_below=underflow_below
            )
            local = row_spec.payload(first.matrix, first.needs_second)
        except Exception as exc:
            self._warn(
                "precision",
                "fsdp_patch telemetry: precision diagnostics failed on rank %d (%s: %s); their metrics are skipped.",
                self.rank,
                type(exc).__name__,
                exc,
            )
            count = len(table) if table is not None else row_spec.slot_count(groups, per_parameter=detail)
            local = row_spec.failed_payload(count, self._device())
            first = None
        reduced = reduce_on_host(local, table, groups, first)
        if reduced is None or table is None:
            return
        stats = precision.stats_from_values(reduced.totals)
        if not stats.complete:
            return
        rows = reduced.rows
        self._record_stats(stats, table, rows)
        if reduced.divergence is not None:
            self._record_divergence(step, table, reduced.divergence)
        if self._attribution is None or optimizer is None:
            return
        if not keys:
            keys = [()] * len(table)
        contexts = optimizer_state.contexts_for(optimizer, table, keys)

        def ranks_of(slot: int, slots: Sequence[int]) -> tuple[int, ...]:
            counts = [sum(block[slot][k] for k in slots) for block in reduced.blocks]
            return tuple(sorted(rank for rank, count in zip(reduced.ranks, counts, strict=True) if count))

        loaded, self._loaded_since = self._loaded_since, False
        findings = self._attribution.analyze(
            step,
            table,
            rows,
            contexts,
            ranks_of,
            underflow_measured=self._underflow_below(table) is not None,
            state_loaded=loaded,
        )
        if findings.skipped:
            self._skipped_steps.add(1, self._rank_attrs)
        span = trace.get_current_span()
        if span.is_recording():
            self._record_findings(span, step, table, findings, self._attribution.top_k)

    def _underflow_below(self, table: Sequence[row_spec.ParamSlot]) -> float | None:
        """float16's smallest normal where a float16 backward runs without loss scaling (its grads
        flush to 0 below it), else ``None``: nothing to count. The same on every rank whose
        optimizer a GradScaler steps alike; only values of the rows depend on it."""
        if not self._attribution or self.loss_scaled:
            return None
        if any(slot.compute_dtype == torch.float16 for slot in table):
            return float(torch.finfo(torch.float16).tiny)
        return None

    def _record_findings(
        self, span: Span, step: int, table: Sequence[row_spec.ParamSlot], findings: attribution.StepFindings, top_k: int
    ) -> None:
        span.set_attributes(
            {
                semconv.ATTR_STUCK_PARAMS: findings.stuck,
                semconv.ATTR_UNSTEPPED_PARAMS: findings.unstepped,
                semconv.ATTR_STATE_NONFINITE: findings.state_nonfinite,
                semconv.ATTR_STATE_FLUSHED: findings.state_flushed,
                semconv.ATTR_STEP_SKIPPED: int(findings.skipped),
                semconv.ATTR_UPDATE_JUMP: findings.update_jump,
            }
        )
        if findings.grad_underflow is not None:
            span.set_attribute(semconv.ATTR_GRAD_UNDERFLOW, findings.grad_underflow)
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
            if offender.cause == semconv.UPDATE_JUMP_STATE_LOADED and self.loaded_at:
                attrs[semconv.ATTR_LOAD_SITE] = self.loaded_at
            span.add_event(semconv.EVENT_OFFENDER, attrs)

    def _record_divergence(self, step: int, table: Sequence[row_spec.ParamSlot], found: replicas.Divergence) -> None:
        """Replicas that differ, as an event on the precision span (every diagnosed step they do)."""
        span = trace.get_current_span()
        if not span.is_recording():
            return
        span.add_event(
            semconv.EVENT_REPLICA_DIVERGENCE,
            {
                semconv.ATTR_STEP: step,
                semconv.ATTR_REPLICA_DIFF: found.diff,
                semconv.ATTR_REPLICA_NONFINITE: found.nonfinite,
                semconv.ATTR_RANKS: found.peers,
                semconv.ATTR_PRECISION_PARAMS: [table[i].name for i in found.slots[: self._named_per_finding]],
                semconv.ATTR_PRECISION_PARAMS_COUNT: len(found.slots),
            },
        )

    def _record_stats(
        self, stats: precision.PrecisionStats, table: Sequence[row_spec.ParamSlot], rows: Sequence[Sequence[float]]
    ) -> None:
        # The series exist from the first diagnosed step (a clean step's zero added once).
        self._precision_steps.add(1, self._rank_attrs)
        self._counts.add(self._nonfinite_steps, 1 if any(stats.nonfinite.values()) else 0, self._rank_attrs)
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
                point = self._attrs.get(
                    ("nonfinite", attrs.get(semconv.ATTR_UNIT), *key),
                    lambda key=key: {**attrs, semconv.ATTR_TENSOR: key[0], semconv.ATTR_NONFINITE_KIND: key[1]},
                )
            self._counts.add(self._nonfinite, count, point)
        self._counts.add(self._overflow, stats.overflow, attrs)
        self._counts.add(self._underflow, stats.underflow, attrs)
        for gauge, value in (
            (self._refresh_error, stats.refresh_error),
            (self._lost_ratio, stats.lost_ratio),
            (self._grad_amax, stats.grad_amax),
        ):
            # Gauges reject NaN/Inf with a warning per call; only fp32 overflow of the norms gets here.
            if math.isfinite(value):
                gauge.set(value, attrs)

    # -- dtype contract ----------------------------------------------------------------

    def audit_if_due(self, step_number: int, span: Span | None) -> None:
        """The dtype-contract audit: at the first step, after the optimizer's state was loaded
        (``load_state_dict`` replaces ``optimizer.state``) and on every diagnosed step; each
        violation is named once (span event on the step, counter)."""
        optimizer = self._optimizer_ref()
        if optimizer is None:
            return
        if optimizer.state is self._audited_state and not self.due(step_number):
            return
        self._audited_state = optimizer.state
        try:
            violations = dtype_contract.audit_dtypes(optimizer)
        except Exception as exc:
            self._warn(
                "audit",
                "fsdp_patch telemetry: the dtype-contract audit failed on rank %d (%s: %s).",
                self.rank,
                type(exc).__name__,
                exc,
            )
            return
        for violation in violations:
            self.name_violation(
                violation.key,
                violation.param,
                violation.unit,
                violation.tensor,
                violation.expected,
                violation.actual,
                step_number,
                span,
                state_key=violation.state_key,
            )

    def name_violation(
        self,
        key: tuple[Any, ...],
        param: str,
        unit: str,
        tensor: str,
        expected: torch.dtype,
        actual: torch.dtype,
        step_number: int,
        span: Span | None,
        state_key: str | None = None,
        detail: str | None = None,
    ) -> None:
        """Count and name one tensor in a dtype its role does not take, once per ``key``: the
        dtype-contract audit's, and the model audit's (buffers, the loss, normalization
        statistics, accumulated grads, rebuilt master weights), with ``detail`` saying the fix."""
        if key in self._named_violations:
            return
        self._named_violations.add(key)
        wanted, found = dtype_name(expected), dtype_name(actual)
        self._dtype_contract.add(
            1,
            self._attrs.get(
                ("contract", tensor, wanted, found),
                lambda: {
                    semconv.ATTR_TENSOR: tensor,
                    semconv.ATTR_DTYPE_EXPECTED: wanted,
                    semconv.ATTR_DTYPE_ACTUAL: found,
                },
            ),
        )
        if span is None:
            return
        attrs: dict[str, AttributeValue] = {
            semconv.ATTR_STEP: step_number,
            semconv.ATTR_RANK: self.rank,
            semconv.ATTR_PARAM: param,
            semconv.ATTR_UNIT: unit,
            semconv.ATTR_TENSOR: tensor,
            semconv.ATTR_DTYPE_EXPECTED: wanted,
            semconv.ATTR_DTYPE_ACTUAL: found,
        }
        if state_key is not None:
            attrs[semconv.ATTR_OPTIMIZER_STATE] = state_key
        if detail:
            attrs[semconv.ATTR_DTYPE_DETAIL] = detail
        span.add_event(semconv.EVENT_DTYPE_CONTRACT, attrs)
