"""Span names, parents, attributes and error handling of OptimizerObserver."""

from __future__ import annotations

import pytest
import torch
from fsdp_patch.telemetry import semconv
from opentelemetry.trace import StatusCode
from telemetry_testing import Group, run_fake_step

from fsdp_patch.adapter.events import Phase

PHASES = [semconv.SPAN_CAST_GRADS, semconv.SPAN_INNER_STEP, semconv.SPAN_RESTORE_GRADS, semconv.SPAN_REFRESH]


def small_group() -> Group:
    main = torch.linspace(-1, 1, 16)
    return Group(main, main.to(torch.bfloat16), torch.ones(16, dtype=torch.bfloat16))


def by_name(spans):
    out: dict[str, list] = {}
    for span in spans:
        out.setdefault(span.name, []).append(span)
    return out


def test_step_span_tree_and_attributes(otel, make_observer, monkeypatch):
    monkeypatch.setenv("FSDP_PATCH_PRECISION_EVERY", "2")
    monkeypatch.setenv("FSDP_PATCH_PRECISION_WINDOW", "2")  # the dense start: steps 1 and 2
    observer = make_observer(precision_aware=True)
    group = small_group()
    tracer = otel.tracer_provider.get_tracer("training-loop")
    with tracer.start_as_current_span("train_iteration") as caller:
        for step in range(3):
            run_fake_step(observer, [group], [group.main_weight + 0.5 * step], cast_bytes=64 * (step + 1))

    spans = by_name(otel.spans())
    steps = sorted(spans[semconv.SPAN_STEP], key=lambda s: s.attributes[semconv.ATTR_STEP])
    assert [s.attributes[semconv.ATTR_STEP] for s in steps] == [1, 2, 3]
    for index, span in enumerate(steps):
        assert span.parent.span_id == caller.get_span_context().span_id
        assert dict(span.attributes) == {
            semconv.ATTR_STEP: index + 1,
            semconv.ATTR_RANK: 0,
            semconv.ATTR_WORLD_SIZE: 1,
            semconv.ATTR_OPTIMIZER_CLASS: "SGD",
            semconv.ATTR_PRECISION_AWARE: True,
            semconv.ATTR_PARAMS_COUNT: 3,
            semconv.ATTR_GROUPS_COUNT: 1,
            semconv.ATTR_CAST_BYTES: 64 * (index + 1),
        }
        assert span.status.status_code is StatusCode.UNSET
    step_ids = {s.context.span_id: s.attributes[semconv.ATTR_STEP] for s in steps}
    for phase in PHASES:
        children = spans[phase]
        assert sorted(step_ids[c.parent.span_id] for c in children) == [1, 2, 3]
    # precision every 2 steps, with FSDP_PATCH_PRECISION_WINDOW=2 (below): steps 1 and 2, not step 3
    precision = spans[semconv.SPAN_PRECISION]
    got = sorted(step_ids[c.parent.span_id] for c in precision)
    assert got == [1, 2], f"want precision spans under steps [1, 2], got {got}"
    assert semconv.METRIC_LOST_RATIO in precision[0].attributes
    # children nest inside their parent's time range, and in call order
    for step in steps:
        kids = sorted(
            (c for c in otel.spans() if c.parent and c.parent.span_id == step.context.span_id),
            key=lambda c: c.start_time,
        )
        assert [k.name for k in kids][:4] == PHASES
        assert all(step.start_time <= k.start_time <= k.end_time <= step.end_time for k in kids)
    assert len(otel.spans()) == 1 + 3 * (1 + len(PHASES)) + 2


def test_step_without_caller_span_is_a_root(otel, make_observer):
    observer = make_observer()
    run_fake_step(observer, [small_group()])
    (step,) = by_name(otel.spans())[semconv.SPAN_STEP]
    assert step.parent is None
    assert step.attributes[semconv.ATTR_PRECISION_AWARE] is False


def test_spans_opened_inside_inner_step_nest_under_it(otel, make_observer):
    observer = make_observer()
    tracer = otel.tracer_provider.get_tracer("optimizer-hook")
    with observer.step():
        with observer.phase(Phase.INNER_STEP):
            with tracer.start_as_current_span("user_hook"):
                pass
    spans = by_name(otel.spans())
    assert spans["user_hook"][0].parent.span_id == spans[semconv.SPAN_INNER_STEP][0].context.span_id


def test_zero_grad_span(otel, make_observer):
    observer = make_observer()
    tracer = otel.tracer_provider.get_tracer("training-loop")
    with tracer.start_as_current_span("iteration") as caller:
        with observer.zero_grad(set_to_none=False):
            pass
    with observer.zero_grad(set_to_none=True):
        pass
    first, second = by_name(otel.spans())[semconv.SPAN_ZERO_GRAD]
    assert first.parent.span_id == caller.get_span_context().span_id
    assert first.attributes[semconv.ATTR_ZERO_GRAD_SET_TO_NONE] is False
    assert second.attributes[semconv.ATTR_ZERO_GRAD_SET_TO_NONE] is True
    assert second.parent is None


def test_failing_step_marks_error_records_exception_and_reraises_unchanged(otel, make_observer):
    observer = make_observer()
    boom = RuntimeError("inner optimizer exploded")
    with pytest.raises(RuntimeError, match="inner optimizer exploded") as info:
        run_fake_step(observer, [small_group()], fail_in_inner_step=boom)
    assert info.value is boom

    spans = by_name(otel.spans())
    (step,) = spans[semconv.SPAN_STEP]
    assert step.status.status_code is StatusCode.ERROR
    assert "RuntimeError: inner optimizer exploded" in step.status.description
    (event,) = [e for e in step.events if e.name == "exception"]
    assert event.attributes[semconv.ATTR_EXCEPTION_TYPE] == "RuntimeError"
    assert event.attributes["exception.message"] == "inner optimizer exploded"
    (inner,) = spans[semconv.SPAN_INNER_STEP]
    assert inner.status.status_code is StatusCode.ERROR
    # the adapter restores grads in a finally: that span still ends normally, under the step
    (restore,) = spans[semconv.SPAN_RESTORE_GRADS]
    assert restore.status.status_code is StatusCode.UNSET
    assert restore.parent.span_id == step.context.span_id
    assert semconv.SPAN_REFRESH not in spans

    # the observer keeps working, and counts on
    assert run_fake_step(observer, [small_group()]) == 2


def test_ranks_not_selected_emit_no_spans_but_metrics(otel, make_observer, monkeypatch):
    monkeypatch.setenv("FSDP_PATCH_TRACE_RANKS", "1-3")  # this process is rank 0
    observer = make_observer()
    run_fake_step(observer, [small_group()], cast_bytes=10)
    with observer.zero_grad(True):
        pass
    assert otel.spans() == []
    points = otel.points()
    assert points[semconv.METRIC_CAST_SIZE]
    assert points[semconv.METRIC_STEP_DURATION][0].count == 1


def test_step_numbers_count_per_observer(make_observer):
    first, second = make_observer(), make_observer()
    assert [run_fake_step(first, []) for _ in range(3)] == [1, 2, 3]
    assert run_fake_step(second, []) == 1
    assert first.step_count == 3


def test_a_steps_attributes_are_set_on_its_span_in_one_call(otel, make_observer):
    """What the step learns as it runs (its plan's counts, the bytes cast) goes onto the step span
    once, as it ends, as values that need no cleaning (each value set through the API is cleaned
    as the span ends, as the SDK cleans it)."""
    from fsdp_patch.telemetry.instrumentation.recorded_spans import RecordedSpan

    observer = make_observer(precision_aware=True)
    group = small_group()
    run_fake_step(observer, [group], [group.main_weight], cast_bytes=64)  # providers ready, first step's extras done
    calls: list[tuple[str, str, tuple[str, ...]]] = []
    originals = {name: getattr(RecordedSpan, name) for name in ("set_attribute", "set_attributes", "note_attributes")}

    def recording(method: str):
        def record(self, *args):
            keys = (args[0],) if method == "set_attribute" else tuple(args[0])
            calls.append((self.name, method, keys))
            return originals[method](self, *args)

        return record

    with pytest.MonkeyPatch.context() as patch:
        for method in originals:
            patch.setattr(RecordedSpan, method, recording(method))
        run_fake_step(observer, [group], [group.main_weight], cast_bytes=64)
    on_step = [(method, keys) for name, method, keys in calls if name == semconv.SPAN_STEP]
    want = {semconv.ATTR_PARAMS_COUNT, semconv.ATTR_GROUPS_COUNT, semconv.ATTR_CAST_BYTES}
    assert len(on_step) == 1 and on_step[0][0] == "note_attributes" and want <= set(on_step[0][1]), (
        f"want one note_attributes call setting {sorted(want)} on the step span, got {on_step}"
    )
