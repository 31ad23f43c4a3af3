"""FSDPOptimizerInstrumentor and the conventions of an OpenTelemetry instrumentation, in one process.

Optimizers here hold plain parameters (no process group), so nothing needs ``torch.distributed``;
the instrumentor's automatic adaptation of FSDP-managed optimizers and bitwise training are shown
on gloo ranks in ``tests/integration/test_instrumentation.py``.
"""

from __future__ import annotations

import atexit
import importlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsdp_patch.telemetry as telemetry
import pytest
import tomllib
import torch
from fsdp_patch.telemetry import FSDPOptimizerInstrumentor, semconv
from fsdp_patch.telemetry.export import providers
from opentelemetry import metrics, trace
from opentelemetry.instrumentation.instrumentor import BaseInstrumentor
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from telemetry_testing import global_state

import fsdp_patch
from fsdp_patch.adapter import NullObserver, adaptation_of
from fsdp_patch.optimizer import fully_shard_optimizer

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def instrumentor() -> Iterator[FSDPOptimizerInstrumentor]:
    instance = FSDPOptimizerInstrumentor()
    yield instance
    if instance.is_instrumented_by_opentelemetry:
        instance.uninstrument()


def plain_optimizer(grad_dtype: torch.dtype | None = None) -> torch.optim.Optimizer:
    param = torch.nn.Parameter(torch.linspace(-1, 1, 8))
    if grad_dtype is not None:
        param.grad_dtype = grad_dtype
        param.grad = torch.ones(8, dtype=grad_dtype)
    else:
        param.grad = torch.ones(8)
    return torch.optim.SGD([param], lr=0.1)


def spans_named(exporter: InMemorySpanExporter, name: str) -> list[Any]:
    return [s for s in exporter.get_finished_spans() if s.name == name]


def test_entry_point_and_instrumentor_conventions():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    target = project["entry-points"]["opentelemetry_instrumentor"]["fsdp_patch"]
    module_name, class_name = target.split(":")
    loaded = getattr(importlib.import_module(module_name), class_name)
    assert loaded is FSDPOptimizerInstrumentor and issubclass(loaded, BaseInstrumentor)
    # opentelemetry-instrument instruments nothing where this is not met: the package's own range.
    want = [d for d in project["dependencies"] if d.startswith("torch")]
    got = [d.replace(" ", "") for d in loaded().instrumentation_dependencies()]
    assert got == want == ["torch>=2.11"], f"instrumentation_dependencies {got}, package's torch requirement {want}"
    assert FSDPOptimizerInstrumentor is telemetry.FSDPOptimizerInstrumentor


def test_scope_name_version_and_schema_url(instrumentor, otel):
    instrumentor.instrument(tracer_provider=otel.tracer_provider, meter_provider=otel.meter_provider)
    optimizer = plain_optimizer()
    fully_shard_optimizer(optimizer)
    observer = adaptation_of(optimizer).observer
    assert isinstance(observer, telemetry.OptimizerObserver), f"instrumented: observer {observer!r}, want telemetry's"
    optimizer.step()
    (step,) = spans_named(otel.span_exporter, semconv.SPAN_STEP)
    scope = step.instrumentation_scope
    got = (scope.name, scope.version, scope.schema_url)
    want = (semconv.SCOPE_NAME, fsdp_patch.__version__, semconv.SCHEMA_URL)
    assert got == want, f"want scope {want}, got {got}"
    data = otel.metric_reader.get_metrics_data()
    scopes = {
        (s.scope.name, s.scope.version, s.scope.schema_url) for rm in data.resource_metrics for s in rm.scope_metrics
    }
    assert scopes == {want}, f"meter scope: want {want}, got {scopes}"


def test_application_sets_global_providers_after_the_first_step(instrumentor, tmp_path, caplog):
    instrumentor.instrument()  # no providers given and none global: the embedded default
    optimizer = plain_optimizer()
    fully_shard_optimizer(optimizer)
    optimizer.step()

    app_spans = InMemorySpanExporter()
    app_tracer_provider = TracerProvider()
    app_tracer_provider.add_span_processor(SimpleSpanProcessor(app_spans))
    app_meter_provider = MeterProvider(metric_readers=[InMemoryMetricReader()])
    with caplog.at_level(logging.WARNING):
        trace.set_tracer_provider(app_tracer_provider)
        metrics.set_meter_provider(app_meter_provider)
    refusals = [r.getMessage() for r in caplog.records if "Overriding" in r.getMessage()]
    assert refusals == [], f"the API refused the application's providers: {refusals}"
    assert trace.get_tracer_provider() is app_tracer_provider
    assert metrics.get_meter_provider() is app_meter_provider
    with trace.get_tracer("app").start_as_current_span("app.iteration"):
        optimizer.step()
    assert [s.name for s in app_spans.get_finished_spans()] == ["app.iteration"]

    providers.flush()
    trace_file = tmp_path / "traces" / "rank0.trace.json"
    events = json.loads(trace_file.read_text())["traceEvents"]
    steps = [e for e in events if e.get("name") == semconv.SPAN_STEP]
    assert sorted(e["args"][semconv.ATTR_STEP] for e in steps) == [1, 2], "the embedded default kept writing"
    # ... and the second step still nests under the application's span, through the context
    (app_span,) = app_spans.get_finished_spans()
    second = next(e for e in steps if e["args"][semconv.ATTR_STEP] == 2)
    assert second["args"]["parent_span_id"] == f"{app_span.context.span_id:016x}"


def test_uninstrument_removes_every_global_and_turns_telemetry_off(instrumentor, tmp_path, capsys, monkeypatch):
    # atexit cannot be listed; torch's lazy imports register their own callbacks meanwhile, so
    # watch which callbacks of this package are registered and unregistered.
    exit_hooks: list[Any] = []
    real_register, real_unregister = atexit.register, atexit.unregister

    def register(fn: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(fn, "__module__", "").startswith("fsdp_patch"):
            exit_hooks.append(fn)
        return real_register(fn, *args, **kwargs)

    def unregister(fn: Any) -> None:
        while fn in exit_hooks:
            exit_hooks.remove(fn)
        real_unregister(fn)

    monkeypatch.setattr(atexit, "register", register)
    monkeypatch.setattr(atexit, "unregister", unregister)
    before = global_state()
    instrumentor.instrument()
    optimizer = plain_optimizer()
    fully_shard_optimizer(optimizer)
    optimizer.step()  # builds the embedded default: atexit hook, destroy_process_group wrapper, filters
    during = global_state()
    watched = ("Optimizer.__init__", "dist.destroy_process_group", "opentelemetry logger filters")
    installed = [k for k in watched if during[k] != before[k]]
    assert installed == list(watched), f"want {watched} installed while instrumented, got {installed}"
    assert len(exit_hooks) == 1, exit_hooks
    hooks = optimizer._optimizer_load_state_dict_post_hooks
    assert len(hooks) == 1, f"want telemetry's load hook on the optimizer (where a load comes from), got {hooks}"

    instrumentor.uninstrument()
    assert len(hooks) == 0, f"want the optimizer's load hook removed with telemetry, got {hooks}"
    after = global_state()
    left = {k: (before[k], after[k]) for k in before if after[k] != before[k]}
    assert left == {}, f"left installed after uninstrument (before, after): {left}"
    assert exit_hooks == [], f"atexit callbacks left registered: {exit_hooks}"
    assert "fsdp_patch telemetry summary" in capsys.readouterr().err  # shut down like at exit

    # The adaptation keeps working, without telemetry; instrumenting again brings it back.
    adaptation = adaptation_of(optimizer)
    assert type(adaptation.observer) is NullObserver, f"uninstrumented: observer {adaptation.observer!r}"
    optimizer.step()
    instrumentor.instrument()
    optimizer.step()
    assert adaptation.observer.step_count == 3, "step numbering continues across the round trip"
    instrumentor.uninstrument()


def test_instrumenting_gives_telemetry_to_optimizers_adapted_while_off(instrumentor, otel, monkeypatch):
    monkeypatch.delenv("FSDP_PATCH_TELEMETRY", raising=False)
    optimizer = plain_optimizer()
    fully_shard_optimizer(optimizer)
    optimizer.step()
    observer = adaptation_of(optimizer).observer
    assert type(observer) is NullObserver, f"telemetry off: observer {observer!r}, want a NullObserver"
    instrumentor.instrument(tracer_provider=otel.tracer_provider, meter_provider=otel.meter_provider)
    optimizer.step()
    got = [s.attributes[semconv.ATTR_STEP] for s in spans_named(otel.span_exporter, semconv.SPAN_STEP)]
    assert got == [2], f"step spans after instrumenting: got steps {got}, want [2] (numbering continues)"


def test_rejected_step_span_carries_every_attribute_and_the_public_error_type(otel, make_observer, monkeypatch):
    from fsdp_patch.adapter import adapt_optimizer

    optimizer = plain_optimizer(grad_dtype=torch.bfloat16)  # fp32 plain param with a bf16 grad
    adapt_optimizer(optimizer, precision_aware=False, observer_factory=lambda: make_observer(optimizer))
    with pytest.raises(TypeError, match=r"param_groups\[0\]\['params'\]\[0\]") as info:
        optimizer.step()
    assert type(info.value).__name__.startswith("_"), (
        f"the adapter raised {type(info.value)}, want its internal subclass"
    )
    (step,) = spans_named(otel.span_exporter, semconv.SPAN_STEP)
    missing = [k for k in semconv.STEP_ATTRIBUTES if k not in step.attributes]
    assert missing == [], f"rejected step span lacks {missing}"
    got = (
        step.attributes[semconv.ATTR_PARAMS_COUNT],
        step.attributes[semconv.ATTR_GROUPS_COUNT],
        step.attributes[semconv.ATTR_CAST_BYTES],
    )
    assert got == (1, 0, 0), f"want params 1, FSDP groups 0, cast bytes 0; got {got}"
    assert step.attributes[semconv.ATTR_ERROR_TYPE] == "TypeError"
    assert step.status.status_code is StatusCode.ERROR
    assert step.status.description.startswith("TypeError: fully_shard_optimizer"), step.status.description
    assert type(info.value).__name__ not in step.status.description
    (event,) = [e for e in step.events if e.name == "exception"]
    assert event.attributes[semconv.ATTR_EXCEPTION_TYPE] == "TypeError"
    rejected = [
        p
        for p in otel.points()[semconv.METRIC_DTYPE_MISMATCHES]
        if p.attributes[semconv.ATTR_MISMATCH_ACTION] == semconv.MISMATCH_REJECTED
    ]
    assert [p.value for p in rejected] == [1]


def test_bare_zero_grad_records_torch_default_set_to_none(monkeypatch, otel):
    trace.set_tracer_provider(otel.tracer_provider)
    metrics.set_meter_provider(otel.meter_provider)
    monkeypatch.setenv("FSDP_PATCH_TELEMETRY", "1")
    optimizer = plain_optimizer()
    fully_shard_optimizer(optimizer)
    optimizer.zero_grad()
    optimizer.zero_grad(set_to_none=False)
    optimizer.zero_grad(False)
    got = [
        s.attributes[semconv.ATTR_ZERO_GRAD_SET_TO_NONE]
        for s in spans_named(otel.span_exporter, semconv.SPAN_ZERO_GRAD)
    ]
    assert got == [True, False, False], f"want torch's default True for a bare zero_grad(), got {got}"


@pytest.mark.parametrize(
    ("variable", "value", "exporters"),
    [
        ("OTEL_BSP_MAX_QUEUE_SIZE", "-1", {}),
        ("OTEL_BSP_SCHEDULE_DELAY", "-5", {}),
        ("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "0", {}),
        ("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "100000", {}),
        ("OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT", "x", {}),
        ("OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT", "-3", {}),
        ("OTEL_SPAN_EVENT_COUNT_LIMIT", "-1", {}),
        ("OTEL_METRIC_EXPORT_INTERVAL", "-1", {"OTEL_METRICS_EXPORTER": "console"}),
    ],
)
def test_invalid_otel_values_warn_once_and_training_goes_on(monkeypatch, caplog, variable, value, exporters):
    from fsdp_patch.telemetry.export import otel_env
    from fsdp_patch.telemetry.export.isolation import WarnOnce

    monkeypatch.setattr(otel_env, "_warn", WarnOnce(otel_env._logger))  # "once" per process: fresh for each case
    monkeypatch.setenv(variable, value)
    for name, exporter in exporters.items():
        monkeypatch.setenv(name, exporter)
    monkeypatch.setenv("FSDP_PATCH_TELEMETRY", "1")
    monkeypatch.setenv("FSDP_PATCH_SUMMARY", "none")
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            optimizer = plain_optimizer()
            fully_shard_optimizer(optimizer)
            optimizer.step()  # raised ValueError out of the first step before
            providers.uninstall()  # the next optimizer builds the providers again
    messages = [r.getMessage() for r in caplog.records if variable in r.getMessage()]
    assert len(messages) == 1, f"want one warning naming {variable}, got {messages}"
    assert repr(value) in messages[0] and "default" in messages[0], messages[0]
