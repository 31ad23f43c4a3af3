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

from . import env, instruments, precision, providers
from .isolation import WarnOnce
from .ranks import distributed_rank
from .timing import DurationRecorder, duration_recorder_for

_logger = logging.getLogger(__name__)

STEP_SPAN = "fsdp.optimizer.step"
ZERO_GRAD_SPAN = "fsdp.optimizer.zero_grad"
PHASES = ("cast_grads", "inner_step", "restore_grads", "refresh", "precision")


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: the form used in metric attributes."""
    return str(dtype).removeprefix("torch.")


class StepScope:
    """Handle on the running ``fsdp.optimizer.step`` span, yielded by :meth:`OptimizerObserver.step`.

    Attributes:
        step_number: 1 for the observer's first step, then counting up.
    """

    __slots__ = ("step_number", "_span")

    def __init__(self, step_number: int, span: Span | None) -> None:
        self.step_number = step_number
        self._span = span

    def set_attribute(self, key: str, value: AttributeValue) -> None:
        """Set an attribute on the step span (no-op on ranks that do not trace)."""
        if self._span is not None:
            self._span.set_attribute(key, value)


def _fail(span: Span, exc: BaseException) -> None:
    span.record_exception(exc, escaped=True)
    span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))


class OptimizerObserver:
    """Emits the design page's spans and metrics for one optimizer.

    Construction parses every ``FSDP_PATCH_*`` variable, so a malformed one fails when the
    optimizer is adapted. Providers, rank and device are resolved on first use, so an
    application may install its own providers (or initialize ``torch.distributed``) after
    adapting the optimizer, as long as it does so before the first step.

    Args:
        optimizer: The adapted optimizer; held weakly, read for its class and parameter device.
        precision_aware: Whether the adapter passes grads through uncast (span attribute).
        tracer_provider: Use this instead of the global provider (tests, or applications that
            keep providers out of the global API).
        meter_provider: Same for metrics.

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
    ) -> None:
        env.validate_all()
        self._optimizer_ref = weakref.ref(optimizer)
        self._optimizer_class = type(optimizer).__qualname__
        self._precision_aware = bool(precision_aware)
        # Diagnostics run a collective: every rank must agree, so decide from the environment only.
        self._precision_every = 0 if env.sdk_disabled() else env.precision_every()
        self._trace_ranks = env.trace_ranks()
        self._given_tracer_provider = tracer_provider
        self._given_meter_provider = meter_provider
        self._warn = WarnOnce(_logger)
        self._lock = threading.Lock()
        self._ready = False
        self._step_count = 0
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
            # Untraced ranks skip span work entirely rather than paying for no-op spans.
            self._tracer = tracer_provider.get_tracer(providers.SCOPE_NAME) if traced else None
            meter = meter_provider.get_meter(providers.SCOPE_NAME)
            created = instruments.create_instruments(meter)
            self._cast_size = created[instruments.CAST_SIZE]
            self._mismatches = created[instruments.DTYPE_MISMATCHES]
            self._nonfinite = created[instruments.NONFINITE]
            self._overflow = created[instruments.REFRESH_OVERFLOW]
            self._underflow = created[instruments.REFRESH_UNDERFLOW]
            self._refresh_error = created[instruments.REFRESH_ERROR]
            self._lost_ratio = created[instruments.LOST_RATIO]
            self._grad_amax = created[instruments.GRAD_AMAX]
            self._rank_attrs = {instruments.RANK_ATTRIBUTE: self.rank}
            self._attr_cache: dict[tuple[Any, ...], dict[str, AttributeValue]] = {}
            self._nonfinite_attrs = {
                key: {**self._rank_attrs, "fsdp.tensor": key[0], "fsdp.nonfinite.kind": key[1]}
                for key in ((t, k) for t in precision.TENSOR_NAMES for k in precision.NONFINITE_KINDS)
            }
            self._base_step_attrs: dict[str, AttributeValue] = {
                "fsdp.rank": self.rank,
                "fsdp.world_size": self.world_size,
                "fsdp.optimizer.class": self._optimizer_class,
                "fsdp.precision_aware": self._precision_aware,
            }
            self._phase_names = {name: f"fsdp.optimizer.{name}" for name in PHASES}
            device = self._parameter_device()
            step_hist = created[instruments.STEP_DURATION]
            refresh_hist = created[instruments.REFRESH_DURATION]
            attrs = self._rank_attrs
            self._step_timer: DurationRecorder = duration_recorder_for(device, lambda s: step_hist.record(s, attrs))
            self._refresh_timer: DurationRecorder = duration_recorder_for(
                device, lambda s: refresh_hist.record(s, attrs)
            )
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
    def step(self, attributes: Mapping[str, AttributeValue]) -> Iterator[StepScope]:
        """Span ``fsdp.optimizer.step`` around one ``optimizer.step()``, and its duration.

        Args:
            attributes: Extra span attributes (the adapter passes ``fsdp.params.count`` and
                ``fsdp.groups.count``).

        Yields:
            The :class:`StepScope` of this step. An exception propagates unchanged after the
            span is marked ERROR with the exception recorded.
        """
        self._ensure_ready()
        self._step_count += 1
        step_number = self._step_count
        # Read back device timings of earlier steps that have finished by now (non-blocking).
        self._step_timer.poll()
        self._refresh_timer.poll()
        span_attrs: dict[str, AttributeValue] | None = None
        if self._tracer is not None:
            span_attrs = {**self._base_step_attrs, **attributes, "fsdp.step": step_number}
        token = self._step_timer.start()
        try:
            with self._span(STEP_SPAN, span_attrs) as span:
                yield StepScope(step_number, span)
        finally:
            # Recorded for failed steps too: one duration per optimizer.step() call.
            self._step_timer.stop(token)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Child span ``fsdp.optimizer.{name}``; ``refresh`` is also timed into its histogram.

        Args:
            name: One of ``cast_grads``, ``inner_step``, ``restore_grads``, ``refresh``, ``precision``.
        """
        self._ensure_ready()
        span_name = self._phase_names.get(name) or f"fsdp.optimizer.{name}"
        if name != "refresh":
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
        with self._span(ZERO_GRAD_SPAN, {"fsdp.rank": self.rank, "fsdp.zero_grad.set_to_none": bool(set_to_none)}):
            yield

    # -- metrics -----------------------------------------------------------------------

    def _cached(self, key: tuple[Any, ...], build: Any) -> dict[str, AttributeValue]:
        attrs = self._attr_cache.get(key)
        if attrs is None:
            attrs = self._attr_cache[key] = {**self._rank_attrs, **build()}
        return attrs

    def record_cast(self, kind: str, source: torch.dtype, target: torch.dtype, nbytes: int) -> None:
        """Add ``nbytes`` (size of the cast's output) to ``fsdp.optimizer.cast.size``.

        Args:
            kind: ``grad`` or ``weight_refresh``.
            source: Dtype cast from.
            target: Dtype cast to.
            nbytes: Bytes written.
        """
        self._ensure_ready()
        attrs = self._cached(
            ("cast", kind, source, target),
            lambda: {
                "fsdp.cast.kind": kind,
                "fsdp.dtype.source": dtype_name(source),
                "fsdp.dtype.target": dtype_name(target),
            },
        )
        self._cast_size.add(nbytes, attrs)

    def record_mismatches(self, param_dtype: torch.dtype, grad_dtype: torch.dtype, action: str, count: int) -> None:
        """Add ``count`` parameters to ``fsdp.optimizer.dtype_mismatches``.

        Args:
            param_dtype: The parameters' data dtype.
            grad_dtype: Their grad dtype.
            action: ``cast``, ``passthrough`` or ``rejected``.
            count: Number of parameters.
        """
        self._ensure_ready()
        attrs = self._cached(
            ("mismatch", param_dtype, grad_dtype, action),
            lambda: {
                "fsdp.dtype.param": dtype_name(param_dtype),
                "fsdp.dtype.grad": dtype_name(grad_dtype),
                "fsdp.mismatch.action": action,
            },
        )
        self._mismatches.add(count, attrs)

    # -- precision diagnostics ---------------------------------------------------------

    @property
    def precision_every(self) -> int:
        """Diagnostics interval from ``FSDP_PATCH_PRECISION_EVERY``; 0 when off (or when the SDK is disabled)."""
        return self._precision_every

    def precision_due(self, step_number: int) -> bool:
        """Whether step ``step_number`` runs the diagnostics: step 1, then every N-th step.

        Step 1 is included so that short runs report once and the snapshot's memory peak shows
        at the start of a run rather than hours in. Depends only on the environment and the
        step number, so every rank agrees (the diagnostics run a collective).
        """
        every = self._precision_every
        return every > 0 and (step_number == 1 or step_number % every == 0)

    def precision_begin(self, groups: Sequence[precision.PrecisionView]) -> precision.PrecisionSnapshot:
        """Clone the weights before the inner step; call after the grad cast, before ``inner_step``."""
        return precision.take_snapshot(groups)

    def precision_end(self, snapshot: precision.PrecisionSnapshot, groups: Sequence[precision.PrecisionView]) -> None:
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
            device = groups[0].main_weight.device if groups else torch.device("cpu")
            local = precision.nan_stats(device)
        stats = precision.stats_from_vector(precision.reduce_stats(local, precision.first_process_group(groups)))
        if not stats.complete:
            return
        self._record_precision(stats)

    def _record_precision(self, stats: precision.PrecisionStats) -> None:
        for key, count in stats.nonfinite.items():
            self._nonfinite.add(count, self._nonfinite_attrs[key])
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
                    "fsdp.precision.refresh.overflow": stats.overflow,
                    "fsdp.precision.refresh.underflow": stats.underflow,
                    "fsdp.precision.refresh.error": stats.refresh_error,
                    "fsdp.precision.update.lost_ratio": stats.lost_ratio,
                    "fsdp.precision.grad.amax": stats.grad_amax,
                    "fsdp.precision.nonfinite": sum(stats.nonfinite.values()),
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
