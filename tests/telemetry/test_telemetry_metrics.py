"""Metric values recorded by OptimizerObserver, and the instrument table itself."""

from __future__ import annotations

import os
import re
import time
from unittest import mock

import pytest
import torch
from fsdp_patch.telemetry import semconv
from fsdp_patch.telemetry.instrumentation import instruments
from telemetry_testing import Group, fake_optimizer, point_value, run_fake_step

from fsdp_patch.adapter.events import Mismatch, MismatchAction, StepPlanned

README = os.path.join(os.path.dirname(os.path.dirname(instruments.__file__)), "README.md")  # telemetry/README.md

# docs/conventions.md's metric table: kinds, units and attribute sets written out independently of
# telemetry/instrumentation/instruments.py (tests/test_conventions.py pins the table to the page itself).
DESIGN_TABLE = {
    semconv.METRIC_CAST_SIZE: (
        "Counter",
        "By",
        {semconv.ATTR_CAST_KIND, semconv.ATTR_DTYPE_SOURCE, semconv.ATTR_DTYPE_TARGET},
    ),
    semconv.METRIC_REFRESH_DURATION: ("Histogram", "s", set()),
    semconv.METRIC_STEP_DURATION: ("Histogram", "s", set()),
    semconv.METRIC_DTYPE_MISMATCHES: (
        "Counter",
        "{parameter}",
        {semconv.ATTR_DTYPE_PARAM, semconv.ATTR_DTYPE_GRAD, semconv.ATTR_MISMATCH_ACTION},
    ),
    semconv.METRIC_NONFINITE: ("Counter", "{element}", {semconv.ATTR_TENSOR, semconv.ATTR_NONFINITE_KIND}),
    semconv.METRIC_REFRESH_OVERFLOW: ("Counter", "{element}", set()),
    semconv.METRIC_REFRESH_UNDERFLOW: ("Counter", "{element}", set()),
    semconv.METRIC_REFRESH_ERROR: ("Gauge", "1", set()),
    semconv.METRIC_LOST_RATIO: ("Gauge", "1", set()),
    semconv.METRIC_GRAD_AMAX: ("Gauge", "1", set()),
}
# The counts of diagnosed steps (semconv's block of them).
DIAGNOSED_STEP_COUNTS = {
    semconv.METRIC_PRECISION_STEPS: ("Counter", "{step}", set()),
    semconv.METRIC_NONFINITE_STEPS: ("Counter", "{step}", set()),
}
# The counters the attribution adds (docs/conventions.md, "Attribution").
ATTRIBUTION_TABLE = {
    semconv.METRIC_DTYPE_CONTRACT: (
        "Counter",
        "{tensor}",
        {semconv.ATTR_TENSOR, semconv.ATTR_DTYPE_EXPECTED, semconv.ATTR_DTYPE_ACTUAL},
    ),
    semconv.METRIC_SKIPPED_STEPS: ("Counter", "{step}", set()),
}
# Step accounting (docs/conventions.md, "Origin ... and step accounting").
STEP_ACCOUNTING_TABLE = {
    semconv.METRIC_OPTIMIZER_SKIPPED_STEPS: ("Counter", "{step}", set()),
}


def test_instrument_table_matches_the_design_page():
    table = {s.name: (s.kind, s.unit, set(s.attributes)) for s in instruments.INSTRUMENTS}
    want = {**DESIGN_TABLE, **DIAGNOSED_STEP_COUNTS, **ATTRIBUTION_TABLE, **STEP_ACCOUNTING_TABLE}
    assert table == want, f"want {want}, got {table}"
    assert all(s.description for s in instruments.INSTRUMENTS)


def test_readme_embeds_the_instrument_table():
    with open(README, encoding="utf-8") as f:
        assert instruments.markdown_table() in f.read()


def test_cast_mismatch_and_duration_values_are_exact(otel, make_observer):
    observer = make_observer()
    main = torch.arange(8, dtype=torch.float32)
    group = Group(main, main.to(torch.float16), torch.zeros(8, dtype=torch.bfloat16))
    steps = 4
    started = time.perf_counter()
    for step in range(steps):
        run_fake_step(observer, [group], [main + 1], cast_bytes=100 + step)
    for count in (5, 2):  # two steps rejected by the adapter, as it reports them
        rejected_plan = StepPlanned(1, 1, (Mismatch(torch.float32, torch.float16, MismatchAction.REJECTED, count),))
        with pytest.raises(TypeError, match="rejected"), observer.step():
            observer.step_planned(rejected_plan)
            raise TypeError("rejected")
    elapsed = time.perf_counter() - started

    points = otel.points()
    grad = point_value(points, semconv.METRIC_CAST_SIZE, **{semconv.ATTR_CAST_KIND: semconv.CAST_KIND_GRAD})
    assert grad == sum(100 + s for s in range(steps))
    refresh = point_value(
        points, semconv.METRIC_CAST_SIZE, **{semconv.ATTR_CAST_KIND: semconv.CAST_KIND_WEIGHT_REFRESH}
    )
    assert refresh == steps * 8 * 2  # 8 fp16 elements written per refresh
    (refresh_point,) = [p for p in points[semconv.METRIC_CAST_SIZE] if p.value == refresh]
    assert dict(refresh_point.attributes) == {
        semconv.ATTR_RANK: 0,
        semconv.ATTR_CAST_KIND: semconv.CAST_KIND_WEIGHT_REFRESH,
        semconv.ATTR_DTYPE_SOURCE: "float32",
        semconv.ATTR_DTYPE_TARGET: "float16",
    }
    assert (
        point_value(points, semconv.METRIC_DTYPE_MISMATCHES, **{semconv.ATTR_MISMATCH_ACTION: semconv.MISMATCH_CAST})
        == 2 * steps
    )
    rejected = [
        p
        for p in points[semconv.METRIC_DTYPE_MISMATCHES]
        if p.attributes[semconv.ATTR_MISMATCH_ACTION] == semconv.MISMATCH_REJECTED
    ]
    assert len(rejected) == 1 and rejected[0].value == 7
    assert dict(rejected[0].attributes) == {
        semconv.ATTR_RANK: 0,
        semconv.ATTR_DTYPE_PARAM: "float32",
        semconv.ATTR_DTYPE_GRAD: "float16",
        semconv.ATTR_MISMATCH_ACTION: semconv.MISMATCH_REJECTED,
    }

    for name, count in ((semconv.METRIC_STEP_DURATION, steps + 2), (semconv.METRIC_REFRESH_DURATION, steps)):
        (hist,) = points[name]
        assert dict(hist.attributes) == {semconv.ATTR_RANK: 0}
        assert hist.count == count, f"{name}: want {count} durations, got {hist.count}"
        assert 0 < hist.min <= hist.max and hist.sum <= elapsed
        assert list(hist.explicit_bounds) == list(instruments.DURATION_BUCKETS_S)
    step_hist, refresh_hist = points[semconv.METRIC_STEP_DURATION][0], points[semconv.METRIC_REFRESH_DURATION][0]
    assert refresh_hist.sum < step_hist.sum  # the refresh is part of the step


def test_failed_step_still_records_one_duration(otel, make_observer):
    observer = make_observer()
    with pytest.raises(ValueError, match="planted inner-step failure"):
        run_fake_step(observer, [], fail_in_inner_step=ValueError("planted inner-step failure"))
    run_fake_step(observer, [])
    (hist,) = otel.points()[semconv.METRIC_STEP_DURATION]
    assert hist.count == 2


def test_step_durations_measure_the_step(otel, make_observer, monkeypatch):
    from types import SimpleNamespace

    from fsdp_patch.telemetry.instrumentation import timing

    now = [100.0]  # the host clock the durations are read from, moved by the "work" of each step
    monkeypatch.setattr(timing, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    observer = make_observer()
    with observer.step():
        now[0] += 0.25
    with observer.step():
        now[0] += 0.5
    (hist,) = otel.points()[semconv.METRIC_STEP_DURATION]
    got = (hist.count, hist.min, hist.max, hist.sum)
    assert got == (2, 0.25, 0.5, 0.75), f"want 2 steps of 0.25 s and 0.5 s, got (count, min, max, sum) {got}"


def test_prometheus_names_are_distinct_and_as_documented(otel, make_observer):
    from fsdp_patch.telemetry import OptimizerObserver
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from opentelemetry.sdk.metrics import MeterProvider
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry()
    provider = MeterProvider(metric_readers=[PrometheusMetricReader(registry=registry)])
    try:
        group = Group(torch.ones(4), torch.ones(4, dtype=torch.float16), torch.ones(4, dtype=torch.bfloat16))
        optimizer = fake_optimizer()
        (param,) = optimizer.param_groups[0]["params"]
        optimizer.state[param]["momentum_buffer"] = torch.zeros(4, dtype=torch.bfloat16)  # the audit names it
        observer = OptimizerObserver(
            optimizer, precision_aware=False, tracer_provider=otel.tracer_provider, meter_provider=provider
        )
        run_fake_step(observer, [group], [torch.full((4,), 2.0)], cast_bytes=8)  # step 1 runs the diagnostics
        with mock.patch.dict(os.environ, {"FSDP_PATCH_PRECISION_EVERY": "1"}):
            observer = OptimizerObserver(
                optimizer, precision_aware=False, tracer_provider=otel.tracer_provider, meter_provider=provider
            )
        run_fake_step(observer, [group], [torch.full((4,), 2.0)])  # grads, and no weight moves: a skipped step
        observer.step_skipped(1024.0)  # a GradScaler ran no step at all
        text = generate_latest(registry).decode()
    finally:
        provider.shutdown()
    families = set(re.findall(r"^# TYPE (\S+) ", text, re.MULTILINE))
    expected = {
        "fsdp_optimizer_cast_size_bytes_total": "counter",
        "fsdp_optimizer_refresh_duration_seconds": "histogram",
        "fsdp_optimizer_step_duration_seconds": "histogram",
        "fsdp_optimizer_dtype_mismatches_total": "counter",
        "fsdp_precision_nonfinite_total": "counter",
        "fsdp_precision_refresh_overflow_total": "counter",
        "fsdp_precision_refresh_underflow_total": "counter",
        "fsdp_precision_refresh_error": "gauge",
        "fsdp_precision_update_lost_ratio": "gauge",
        "fsdp_precision_grad_amax": "gauge",
        "fsdp_precision_dtype_contract_violations_total": "counter",
        "fsdp_precision_update_skipped_steps_total": "counter",
        "fsdp_optimizer_skipped_steps_total": "counter",
    }
    ours = {f for f in families if f.startswith("fsdp_")}
    # one family per instrument: nothing collided in translation
    assert len(ours) == len(instruments.INSTRUMENTS)
    for family, kind in expected.items():
        base = family.removesuffix("_total")
        assert re.search(rf"^# TYPE ({family}|{base}) {kind}$", text, re.MULTILINE), family
    assert re.search(r'^fsdp_optimizer_step_duration_seconds_count\{.*fsdp_rank="0".*\} 2\.0$', text, re.MULTILINE)


class _CountingCounter:
    """Stands for an SDK counter: what was added to which series."""

    def __init__(self) -> None:
        self.adds: list[tuple[int, dict]] = []

    def add(self, amount: int, attributes: dict) -> None:
        self.adds.append((amount, dict(attributes)))


def test_a_zero_is_added_once_per_series_and_every_other_amount_always():
    counts = instruments.CounterAdds()
    first, second = _CountingCounter(), _CountingCounter()
    clean, other = {semconv.ATTR_RANK: 0}, {semconv.ATTR_RANK: 0, semconv.ATTR_TENSOR: "main_grad"}
    for amount in (0, 0, 3, 0, 2):
        counts.add(first, amount, clean)
    counts.add(first, 0, dict(other))
    counts.add(first, 0, dict(other))  # the same series in a dict of its own
    counts.add(second, 0, clean)
    want = [(0, clean), (3, clean), (2, clean), (0, other)]
    assert first.adds == want, f"want the first zero of each series and every other amount {want}, got {first.adds}"
    assert second.adds == [(0, clean)], f"another counter's series is its own: got {second.adds}"


def test_clean_diagnosed_steps_export_their_counters_at_zero(otel, make_observer, monkeypatch):
    """The zeros a clean step would add are added once: the series exist, at 0, after many steps."""
    monkeypatch.setenv("FSDP_PATCH_PRECISION_EVERY", "1")
    observer = make_observer()
    main = torch.linspace(-1, 1, 16)
    group = Group(main, main.to(torch.bfloat16), torch.full((16,), 0.5, dtype=torch.bfloat16))
    for step in range(3):
        run_fake_step(observer, [group], [main + 0.01 * (step + 1)])
    points = otel.points()
    for tensor in semconv.TENSORS:
        for kind in semconv.NONFINITE_KINDS:
            got = point_value(
                points, semconv.METRIC_NONFINITE, **{semconv.ATTR_TENSOR: tensor, semconv.ATTR_NONFINITE_KIND: kind}
            )
            assert got == 0, f"{tensor} {kind}: want the series at 0 after 3 clean steps, got {got}"
    got = (point_value(points, semconv.METRIC_REFRESH_OVERFLOW), point_value(points, semconv.METRIC_NONFINITE_STEPS))
    assert got == (0, 0), f"overflow and steps with a NaN/Inf: want (0, 0), got {got}"
    assert point_value(points, semconv.METRIC_PRECISION_STEPS) == 3, "every diagnosed step counted"
