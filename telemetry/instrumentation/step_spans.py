"""The spans of one adapted optimizer step beyond the step's own: its phases, and how a failure is
recorded on a span.

The step span and ``fsdp.optimizer.inner_step`` are entered as the current span while they run
(spans the optimizer's own hooks open nest in the inner step), as is ``fsdp.optimizer.precision``
(the diagnostics add their attributes and events to the current span). The other phases
(``cast_grads``, ``restore_grads``, ``refresh``) open nothing inside them: the observer notes their
start and end times as they run and makes their spans after the fact (:func:`emit_phases`), with
those times and the step as parent, which costs no context switch per phase: as the next live
phase begins, or as the step ends, so that spans still end in the order the phases ran. A trace
reads the same either way.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Span, Status, StatusCode
from opentelemetry.util.types import AttributeValue

from .. import semconv
from .recorded_spans import RecordedSpan, SpanMaker

__all__ = ["StepScope", "emit_phases", "fail_span", "public_type_name"]


def public_type_name(exc: BaseException) -> str:
    """The exception's class name, or that of its first public base class.

    Internal subclasses (``_MismatchError(TypeError)``) are reported as the public class a
    caller catches (``TypeError``): for ``error.type``, the status and the exception event.
    """
    for cls in type(exc).__mro__:
        if not cls.__name__.startswith("_"):
            return cls.__qualname__
    return type(exc).__qualname__  # pragma: no cover - object is always public


def fail_span(span: Span, exc: BaseException) -> None:
    """Mark ``span`` failed by ``exc``: status ERROR, the exception recorded, ``error.type`` set."""
    public = public_type_name(exc)
    span.record_exception(exc, attributes={semconv.ATTR_EXCEPTION_TYPE: public}, escaped=True)
    span.set_attribute(semconv.ATTR_ERROR_TYPE, public)
    span.set_status(Status(StatusCode.ERROR, f"{public}: {exc}"))


class StepScope:
    """Handle on the running ``fsdp.optimizer.step`` span, yielded by ``OptimizerObserver.step``.

    Attributes:
        step_number: 1 for the optimizer's first step, then counting up.
    """

    __slots__ = ("step_number", "_span", "cast_bytes", "casts", "phases", "attributes")

    def __init__(self, step_number: int, span: Span | None) -> None:
        self.step_number = step_number
        self._span = span
        self.cast_bytes = 0
        # The step's casts by their metric attributes, added to the counter once as the step ends
        # (one measurement per kind and dtype pair, not one per group).
        self.casts: dict[tuple[Any, ...], tuple[Mapping[str, AttributeValue], int]] = {}
        # The phases run so far whose spans are made as the step ends: (span name, start and
        # end in nanoseconds since the epoch, the exception it raised).
        self.phases: list[tuple[str, int, int, BaseException | None]] = []
        # The attributes set on the step span during the step, set on it at once as it ends.
        self.attributes: dict[str, AttributeValue] = {}

    @property
    def span(self) -> Span | None:
        """The step span (``None`` on ranks that do not trace)."""
        return self._span

    def set_attribute(self, key: str, value: AttributeValue) -> None:
        """Set an attribute on the step span as it ends (no-op on ranks that do not trace): one
        call into the span for all of a step's, where each costs a lock and a validation."""
        if self._span is not None:
            self.attributes[key] = value

    def end_attributes(self) -> None:
        """Set the attributes noted so far on the step span (as it ends, also when the step raised)."""
        span = self._span
        if span is not None and self.attributes:
            if isinstance(span, RecordedSpan):
                span.note_attributes(self.attributes)  # this package's values: no cleaning
            else:
                span.set_attributes(self.attributes)
            self.attributes = {}


def emit_phases(tracer: SpanMaker, scope: StepScope) -> None:
    """The spans of ``scope``'s noted phases, children of its step span, with the times noted."""
    phases, scope.phases = scope.phases, []
    step = scope.span
    if step is None or not phases:
        return
    context = trace.set_span_in_context(step)
    for name, start, end, exc in phases:
        span = tracer.start_span(name, context=context, start_time=start)
        if exc is not None:
            fail_span(span, exc)
        span.end(end_time=end)
