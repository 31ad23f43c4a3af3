"""Spans recorded in plain Python and handed to the SDK's span processors whole, as they end.

Each optimizer step makes the same six spans (``fsdp.optimizer.step``, its phases,
``fsdp.optimizer.zero_grad``); on a step bound by the host, the SDK's ``Tracer.start_span`` and
``Span.end`` cost more than the rest of the telemetry's fixed part together (a lock, attribute
validation and a copy per span). :class:`SpanMaker` makes them the cheap way where the result is
the same: it asks the tracer's own sampler and id generator, as ``start_span`` does, records the
span's attributes, events and status in a :class:`RecordedSpan`, and as the span ends hands the
processors the ``ReadableSpan`` the SDK would have built. Exporters see the same spans.

[Note: when a span is recorded here]
Only where nothing could tell: an SDK tracer (``opentelemetry.sdk.trace.Tracer``) that is
enabled and records no metrics of its own spans, whose processors all do nothing as a span starts
or is ending (the SDK's batch and simple processors: a processor that writes attributes as a span
starts, such as a baggage processor, is given real SDK spans). Anything else (another SDK, a
no-op tracer, a processor added later that does look at a starting span) gets
``tracer.start_span``, checked again whenever the processors change.

Alternatives considered: spans made by the SDK after the fact for every phase (what the phases
whose spans open nothing inside them had already): still the SDK's lock, validation and copy per
span, about three times this cost; events on the step span in place of phase spans: the phase
spans are fixed names dashboards and users read.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry import context as context_api
from opentelemetry import trace
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.sdk import trace as sdk_trace
from opentelemetry.sdk.trace import export as sdk_export
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.util import types

__all__ = ["RecordedSpan", "SpanMaker"]

_logger = logging.getLogger(__name__)

_UNSET = Status(StatusCode.UNSET)  # immutable: every span's status until one is set

# What a processor that does nothing as a span starts or is ending inherits (the SDK's own).
_INERT: frozenset[Any] = frozenset(
    getattr(cls, method, None)
    for cls in (sdk_trace.SpanProcessor, sdk_export.SimpleSpanProcessor, sdk_export.BatchSpanProcessor)
    for method in ("on_start", "_on_ending")
)


class RecordedSpan(trace.Span):
    """A recording span whose attributes, events and status are kept in plain Python until it
    ends, when its processors are given the SDK's ``ReadableSpan`` of it (made by :class:`SpanMaker`)."""

    __slots__ = (
        "_maker",
        "_name",
        "_context",
        "_parent",
        "_attributes",
        "_checked",
        "_events",
        "_links",
        "_status",
        "_start_time",
        "_end_time",
    )

    def __init__(
        self,
        maker: SpanMaker,
        name: str,
        context: SpanContext,
        parent: SpanContext | None,
        attributes: dict[str, Any],
        start_time: int,
    ) -> None:
        self._maker = maker
        self._name = name
        self._context = context
        self._parent = parent
        self._attributes = attributes
        # Whether every attribute value is one this package set (checked types); others are
        # cleaned as the SDK cleans them when the span ends.
        self._checked = True
        self._events: list[sdk_trace.Event] | None = None  # made when first needed
        self._links: list[trace.Link] | None = None
        self._status = _UNSET
        self._start_time = start_time
        self._end_time: int | None = None

    @property
    def name(self) -> str:
        return self._name

    # -- what the API asks of a span -------------------------------------------------------

    def get_span_context(self) -> SpanContext:
        return self._context

    def is_recording(self) -> bool:
        return self._end_time is None

    def set_attributes(self, attributes: Mapping[str, types.AttributeValue]) -> None:
        if self._end_time is None:
            self._attributes.update(attributes)
            self._checked = False

    def set_attribute(self, key: str, value: types.AttributeValue) -> None:
        if self._end_time is None:
            self._attributes[key] = value
            self._checked = False

    def note_attributes(self, attributes: Mapping[str, types.AttributeValue]) -> None:
        """Set attributes this package made (valid values already: not cleaned again)."""
        if self._end_time is None:
            self._attributes.update(attributes)

    def add_event(self, name: str, attributes: types.Attributes = None, timestamp: int | None = None) -> None:
        if self._end_time is None:
            cleaned = BoundedAttributes(attributes=attributes, immutable=True)
            event = sdk_trace.Event(name, cleaned, timestamp if timestamp is not None else time.time_ns())
            if self._events is None:
                self._events = []
            self._events.append(event)

    def add_link(self, context: SpanContext, attributes: types.Attributes = None) -> None:
        if self._end_time is None and context.is_valid:
            if self._links is None:
                self._links = []
            self._links.append(trace.Link(context, BoundedAttributes(attributes=attributes, immutable=True)))

    def update_name(self, name: str) -> None:
        if self._end_time is None:
            self._name = name

    def set_status(self, status: Status | StatusCode, description: str | None = None) -> None:
        # As the SDK's span: an OK status is final, UNSET is never set.
        if self._end_time is not None or self._status.status_code is StatusCode.OK:
            return
        if isinstance(status, StatusCode):
            status = Status(status, description)
        if status.status_code is not StatusCode.UNSET:
            self._status = status

    def record_exception(
        self,
        exception: BaseException,
        attributes: types.Attributes = None,
        timestamp: int | None = None,
        escaped: bool = False,
    ) -> None:
        # The event the SDK's span records (the semantic conventions' exception attributes).
        module = type(exception).__module__
        qualname = type(exception).__qualname__
        recorded: dict[str, Any] = {
            "exception.type": f"{module}.{qualname}" if module and module != "builtins" else qualname,
            "exception.message": str(exception),
            "exception.stacktrace": "".join(
                traceback.format_exception(type(exception), exception, exception.__traceback__)
            ),
            "exception.escaped": str(escaped),
        }
        if attributes:
            recorded.update(attributes)
        self.add_event("exception", recorded, timestamp)

    def end(self, end_time: int | None = None) -> None:
        if self._end_time is not None:
            _logger.warning("Calling end() on an ended span.")
            return
        self._end_time = end_time if end_time is not None else time.time_ns()
        self._maker._ended(self)

    def __repr__(self) -> str:
        return f"RecordedSpan(name={self._name!r}, context={self._context!r})"


class SpanMaker:
    """Starts spans for one tracer: :class:`RecordedSpan` where the tracer's pipeline allows
    ([Note: when a span is recorded here]), else the tracer's own.

    Args:
        tracer: The tracer the spans belong to.
        scope: Its instrumentation scope (what the spans' ``instrumentation_scope`` reads).

    Attributes:
        record: Whether spans may be recorded here (a class attribute: ``False`` makes every
            maker use the tracer's own spans; ``benchmarks/span_cost.py`` times both).
    """

    record = True

    def __init__(self, tracer: trace.Tracer, scope: InstrumentationScope) -> None:
        self.tracer = tracer
        self._scope = scope
        self._sdk = isinstance(tracer, sdk_trace.Tracer)
        self._processors: object = None  # the processor tuple last found inert
        self._direct = False

    @property
    def direct(self) -> bool:
        """Whether spans are recorded here now (see [Note: when a span is recorded here])."""
        if not (self._sdk and self.record):
            return False
        tracer = self.tracer
        assert isinstance(tracer, sdk_trace.Tracer)
        enabled = getattr(tracer, "_is_enabled", None)
        if enabled is not None and not enabled():
            return False
        processors = getattr(tracer.span_processor, "_span_processors", None)
        if processors is not self._processors:
            self._processors = processors
            self._direct = _inert(tracer, processors)
        return self._direct

    def start_span(
        self,
        name: str,
        context: context_api.Context | None = None,
        attributes: Mapping[str, types.AttributeValue] | None = None,
        start_time: int | None = None,
    ) -> trace.Span:
        """A started span, child of the span current in ``context`` (or now), as
        ``Tracer.start_span`` would make it."""
        if not self.direct:
            return self.tracer.start_span(name, context=context, attributes=attributes, start_time=start_time)
        tracer = self.tracer
        assert isinstance(tracer, sdk_trace.Tracer)
        parent: SpanContext | None = trace.get_current_span(context).get_span_context()
        if parent is not None and parent.is_valid:
            trace_id = parent.trace_id
            random_trace_id = parent.trace_flags.random_trace_id
        else:
            parent = None
            trace_id = tracer.id_generator.generate_trace_id()
            random_trace_id = tracer.id_generator.is_trace_id_random()
        sampled = tracer.sampler.should_sample(context, trace_id, name, SpanKind.INTERNAL, attributes, ())
        flags = TraceFlags.SAMPLED if sampled.decision.is_sampled() else TraceFlags.DEFAULT
        if random_trace_id:
            flags |= TraceFlags.RANDOM_TRACE_ID
        span_context = SpanContext(
            trace_id,
            tracer.id_generator.generate_span_id(),
            is_remote=False,
            trace_flags=TraceFlags(flags),
            trace_state=sampled.trace_state,
        )
        if not sampled.decision.is_recording():
            return trace.NonRecordingSpan(span_context)
        recorded: dict[str, Any] = dict(sampled.attributes or ())
        if attributes:
            recorded.update(attributes)
        return RecordedSpan(
            self, name, span_context, parent, recorded, start_time if start_time is not None else time.time_ns()
        )

    def _ended(self, span: RecordedSpan) -> None:
        tracer = self.tracer
        assert isinstance(tracer, sdk_trace.Tracer)
        attributes: Mapping[str, Any] = span._attributes
        if not span._checked:
            attributes = BoundedAttributes(attributes=attributes, immutable=True)
        tracer.span_processor.on_end(
            sdk_trace.ReadableSpan(
                name=span._name,
                context=span._context,
                parent=span._parent,
                resource=tracer.resource,
                attributes=attributes,
                events=tuple(span._events or ()),
                links=tuple(span._links or ()),
                kind=SpanKind.INTERNAL,
                status=span._status,
                start_time=span._start_time,
                end_time=span._end_time,
                instrumentation_scope=self._scope,
            )
        )


def _inert(tracer: sdk_trace.Tracer, processors: Sequence[object] | None) -> bool:
    """Whether no processor of ``tracer`` looks at a span before it ends, and the tracer records
    no metrics of its spans."""
    if processors is None:
        return False  # a processor of another kind: nothing known of what it does
    metrics = getattr(tracer, "_tracer_metrics", None)
    if metrics is not None and type(metrics).__name__ != "NoOpTracerMetrics":
        return False
    return all(
        getattr(type(p), "on_start", None) in _INERT and getattr(type(p), "_on_ending", None) in _INERT
        for p in processors
    )
