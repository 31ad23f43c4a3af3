"""Spans recorded in plain Python (recorded_spans.SpanMaker) reach the exporters as the SDK's own
spans would, and the SDK makes them wherever a processor or sampler could tell the difference."""

from __future__ import annotations

from typing import Any

import pytest
from fsdp_patch.telemetry.instrumentation.recorded_spans import RecordedSpan, SpanMaker
from opentelemetry import context as context_api
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Span as SdkSpan
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, ParentBased
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import NonRecordingSpan, SpanContext, Status, StatusCode, TraceFlags

SCOPE = InstrumentationScope("fsdp_patch", "1.0", "https://example.org/schema")


def pipeline(sampler: Any = None) -> tuple[TracerProvider, InMemorySpanExporter, SpanMaker]:
    provider = TracerProvider(resource=Resource({"service.name": "t"}), **({"sampler": sampler} if sampler else {}))
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer(SCOPE.name, SCOPE.version, schema_url=SCOPE.schema_url)
    return provider, exporter, SpanMaker(tracer, SCOPE)


def exercise(start: Any, parent: trace.Span) -> None:
    """The same calls on a span, whoever makes it: attributes of this package and of a caller
    (a list, which the SDK keeps as a tuple, and a None, which it drops), events, a link, a
    renaming, an exception, an error status that a later UNSET does not undo."""
    context = trace.set_span_in_context(parent)
    span = start("phase", context=context, attributes={"fsdp.step": 3}, start_time=1_000)
    span.set_attribute("caller.list", [1, 2])
    span.set_attributes({"caller.none": None, "caller.flag": True})
    span.add_event("noted", {"k": "v"}, timestamp=1_500)
    span.add_link(parent.get_span_context(), {"why": "parent"})
    span.update_name("phase.renamed")
    try:
        raise ValueError("bad value")
    except ValueError as exc:
        span.record_exception(exc, attributes={"exception.type.public": "ValueError"}, timestamp=1_600, escaped=True)
    span.set_status(Status(StatusCode.ERROR, "ValueError: bad value"))
    span.set_status(StatusCode.UNSET)
    span.end(end_time=2_000)
    span.set_attribute("after.end", 1)  # ignored by both: the span has ended
    span.end(end_time=3_000)


def exported(span: Any) -> dict[str, Any]:
    """What an exporter reads of a span, ids left out (they are random)."""
    return {
        "name": span.name,
        "attributes": dict(span.attributes),
        "events": [
            (e.name, e.timestamp, {k: v for k, v in e.attributes.items() if k != "exception.stacktrace"})
            for e in span.events
        ],
        "stacktrace": [
            "ValueError: bad value" in (e.attributes.get("exception.stacktrace") or "") for e in span.events
        ],
        "links": [dict(link.attributes) for link in span.links],
        "status": (span.status.status_code, span.status.description),
        "kind": span.kind,
        "times": (span.start_time, span.end_time),
        "resource": dict(span.resource.attributes),
        "scope": (
            span.instrumentation_scope.name,
            span.instrumentation_scope.version,
            span.instrumentation_scope.schema_url,
        ),
    }


def test_a_recorded_span_is_exported_as_the_sdks_own():
    provider, exporter, maker = pipeline()
    assert maker.direct, "an SDK tracer with a simple processor: spans are recorded in plain Python"
    parent = maker.tracer.start_span("step")
    exercise(maker.start_span, parent)
    exercise(maker.tracer.start_span, parent)
    parent.end()
    recorded, sdk, _ = exporter.get_finished_spans()
    got, want = exported(recorded), exported(sdk)
    assert got == want, f"recorded span as exported: {got}\nthe SDK's: {want}"
    assert (
        recorded.parent == parent.get_span_context() and recorded.context.trace_id == parent.get_span_context().trace_id
    ), f"want the step as parent, got parent {recorded.parent} in trace {recorded.context.trace_id:x}"
    assert recorded.context.span_id not in (sdk.context.span_id, parent.get_span_context().span_id), (
        "a span id of its own"
    )
    provider.shutdown()


def test_a_recorded_span_made_current_parents_the_callers_spans():
    """The inner step's span is current while the optimizer's hooks run: what they open nests in it."""
    provider, exporter, maker = pipeline()
    outer = maker.start_span("fsdp.optimizer.inner_step")
    token = context_api.attach(trace.set_span_in_context(outer))
    try:
        with maker.tracer.start_as_current_span("hook"):
            pass
    finally:
        context_api.detach(token)
    outer.end()
    hook, inner = exporter.get_finished_spans()
    assert isinstance(outer, RecordedSpan), f"want a recorded span, got {type(outer).__name__}"
    assert hook.parent == inner.context, f"want the hook's span under {inner.context}, got parent {hook.parent}"
    assert inner.parent is None, f"a span started with no current span is a root, got parent {inner.parent}"
    provider.shutdown()


def test_the_tracers_sampler_decides_as_it_does_for_its_own_spans():
    provider, exporter, maker = pipeline(ALWAYS_OFF)
    dropped = maker.start_span("step")
    dropped.end()
    assert isinstance(dropped, NonRecordingSpan) and not dropped.get_span_context().trace_flags.sampled, (
        f"ALWAYS_OFF: want a span neither recorded nor sampled, got {dropped!r}"
    )
    provider.shutdown()
    provider, exporter, maker = pipeline(ParentBased(ALWAYS_ON))
    unsampled = SpanContext(0x1234, 0x5678, is_remote=True, trace_flags=TraceFlags(TraceFlags.DEFAULT))
    child = maker.start_span("phase", context=trace.set_span_in_context(NonRecordingSpan(unsampled)))
    child.end()
    sampled_root = maker.start_span("step")
    sampled_root.end()
    names = [s.name for s in exporter.get_finished_spans()]
    assert names == ["step"], (
        f"parent-based: the child of an unsampled parent is dropped, a root kept; exported {names}"
    )
    assert child.get_span_context().trace_id == 0x1234, "the child stays in its parent's trace"
    provider.shutdown()


class _StartingProcessor(SpanProcessor):
    """A processor that writes on a span as it starts (as a baggage processor does)."""

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        span.set_attribute("seen.at.start", True)


def test_a_processor_that_sees_spans_start_gets_the_sdks_spans():
    provider, exporter, maker = pipeline()
    first = maker.start_span("before")
    first.end()
    provider.add_span_processor(_StartingProcessor())
    assert not maker.direct, "a processor that looks at a starting span: the SDK makes the spans"
    second = maker.start_span("after")
    second.end()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert isinstance(first, RecordedSpan) and isinstance(second, SdkSpan), (
        f"want a recorded span before the processor came and an SDK span after, got {type(first).__name__}, "
        f"{type(second).__name__}"
    )
    got = spans["after"].attributes.get("seen.at.start")
    assert got is True, f"the processor's attribute on the span it saw start: want True, got {got!r}"
    provider.shutdown()


def test_another_tracer_makes_its_own_spans():
    maker = SpanMaker(trace.NoOpTracer(), SCOPE)
    span = maker.start_span("step", attributes={"fsdp.step": 1})
    assert not maker.direct and not span.is_recording(), f"a no-op tracer's span, got {span!r}"


@pytest.mark.parametrize("first", [StatusCode.OK, StatusCode.ERROR])
def test_status_rules_follow_the_sdk(first: StatusCode):
    provider, exporter, maker = pipeline()
    for start in (maker.start_span, maker.tracer.start_span):
        span = start("s")
        span.set_status(first)
        span.set_status(Status(StatusCode.ERROR, "later"))
        span.end()
    recorded, sdk = exporter.get_finished_spans()
    got, want = (
        (recorded.status.status_code, recorded.status.description),
        (sdk.status.status_code, sdk.status.description),
    )
    assert got == want, f"after {first.name} then ERROR: recorded {got}, the SDK's {want}"
    provider.shutdown()


def test_record_off_gives_every_maker_the_sdks_spans(monkeypatch: pytest.MonkeyPatch):
    """What benchmarks/span_cost.py times its SDK contender with."""
    provider, exporter, maker = pipeline()
    monkeypatch.setattr(SpanMaker, "record", False)
    span = maker.start_span("step")
    span.end()
    assert isinstance(span, SdkSpan) and not maker.direct, f"record off: want an SDK span, got {type(span).__name__}"
    monkeypatch.setattr(SpanMaker, "record", True)
    again = maker.start_span("step")
    again.end()
    assert isinstance(again, RecordedSpan), f"record on again: want a recorded span, got {type(again).__name__}"
    provider.shutdown()
