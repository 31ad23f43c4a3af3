"""Provider resolution and the embedded default: trace files (merged, converted for Jaeger) and the
exit summary, the application's providers kept, the SDK disabled, the resource (``OTEL_*``,
torchrun, the mesh coordinate), ``destroy_process_group`` wrapped once."""

from __future__ import annotations

import json

import fsdp_patch.telemetry as telemetry
from export_testing import STEP_NAMES, load_trace, run_steps
from fsdp_patch.app import cli
from fsdp_patch.telemetry import OptimizerObserver, semconv
from fsdp_patch.telemetry.export import exit_hooks, providers, trace_files
from fsdp_patch.telemetry.export.resource import build_resource
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from telemetry_testing import fake_optimizer, metric_points

# -- the embedded default -----------------------------------------------------------


def test_embedded_default_writes_a_valid_chrome_trace_and_prints_a_summary(tmp_path, capsys):
    observer = OptimizerObserver(fake_optimizer(), precision_aware=False)
    run_steps(observer, 3)
    with observer.zero_grad(True):
        pass
    telemetry.shutdown()

    trace_dir = tmp_path / "traces"
    events = load_trace(trace_dir / "rank0.trace.json")
    complete = [e for e in events if e["ph"] == "X"]
    assert {e["name"] for e in complete} >= STEP_NAMES | {semconv.SPAN_ZERO_GRAD, semconv.SPAN_PRECISION}
    steps = [e for e in complete if e["name"] == semconv.SPAN_STEP]
    assert sorted(e["args"][semconv.ATTR_STEP] for e in steps) == [1, 2, 3]
    step_ids = {e["args"]["span_id"] for e in steps}
    children = [e for e in complete if e["name"] == semconv.SPAN_INNER_STEP]
    assert {e["args"]["parent_span_id"] for e in children} == step_ids
    assert all(e["pid"] == 0 and e["dur"] >= 0 for e in complete)
    process = next(e for e in events if e["ph"] == "M" and e["name"] == "process_name")
    assert process["args"]["otel.resource"][semconv.ATTR_RANK] == 0
    assert process["args"]["otel.resource"]["service.name"] == "fsdp_patch"

    jaeger = json.loads((trace_dir / "rank0.jaeger.json").read_text())
    assert len(jaeger["data"]) == 4  # three steps and one zero_grad, each its own trace
    step_trace = next(t for t in jaeger["data"] if any(s["operationName"] == semconv.SPAN_STEP for s in t["spans"]))
    by_id = {s["spanID"]: s for s in step_trace["spans"]}
    inner = next(s for s in step_trace["spans"] if s["operationName"] == semconv.SPAN_INNER_STEP)
    assert by_id[inner["references"][0]["spanID"]]["operationName"] == semconv.SPAN_STEP
    assert step_trace["processes"]["p0"]["serviceName"] == "fsdp_patch"
    assert (trace_dir / ".gitignore").read_text().strip().endswith("*")

    err = capsys.readouterr().err
    assert "fsdp_patch telemetry summary: rank 0 of 1 (service fsdp_patch)" in err
    assert "fsdp.optimizer.step.duration [s]" in err and "count 3," in err
    assert "fsdp.cast.kind=grad fsdp.dtype.source=bfloat16 fsdp.dtype.target=float32: 192" in err
    assert "rank0.trace.json" in err and "rank0.jaeger.json" in err

    telemetry.shutdown()  # idempotent: nothing printed twice
    assert capsys.readouterr().err == ""


def test_trace_file_is_valid_json_before_shutdown(tmp_path, monkeypatch):
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "10")
    observer = OptimizerObserver(fake_optimizer(), precision_aware=False)
    run_steps(observer, 2)
    providers.flush()
    events = load_trace(tmp_path / "traces" / "rank0.trace.json")
    assert sum(e["name"] == semconv.SPAN_STEP for e in events) == 2
    run_steps(observer, 1)
    providers.flush()
    events = load_trace(tmp_path / "traces" / "rank0.trace.json")
    assert sum(e["name"] == semconv.SPAN_STEP for e in events) == 3


def test_summary_only_on_rank0_by_default(capsys, monkeypatch):
    monkeypatch.setenv("FSDP_PATCH_SUMMARY", "none")
    run_steps(OptimizerObserver(fake_optimizer(), precision_aware=False), 1)
    telemetry.shutdown()
    assert "telemetry summary" not in capsys.readouterr().err


def test_merge_and_jaeger_command_line(tmp_path, capsys):
    for rank in (0, 1):
        exporter = trace_files.TraceFileExporter(str(tmp_path), rank, {"service.name": "svc", semconv.ATTR_RANK: rank})
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        with provider.get_tracer("t").start_as_current_span(f"outer{rank}"):
            with provider.get_tracer("t").start_as_current_span("inner") as inner:
                inner.record_exception(ValueError("bad"))
        provider.shutdown()
    inputs = [str(tmp_path / f"rank{r}.trace.json") for r in (0, 1)]
    merged_path = str(tmp_path / "all.json")
    code = cli.main(["trace", "merge", merged_path, *inputs])
    out = capsys.readouterr().out
    assert code == 0, f"fsdp-patch trace merge exited {code}"
    merged = load_trace(tmp_path / "all.json")
    pids = {e["pid"] for e in merged if e["ph"] == "X"}
    assert pids == {0, 1}, f"merged span rows {pids}, want one per rank {{0, 1}}"
    assert out == f"wrote {len(merged)} events to {merged_path}\n", f"merge printed {out!r}"
    jaeger_path = str(tmp_path / "all.jaeger.json")
    code = cli.main(["trace", "jaeger", jaeger_path, str(tmp_path)])  # a trace directory as input
    out = capsys.readouterr().out
    assert code == 0, f"fsdp-patch trace jaeger exited {code}"
    data = json.loads((tmp_path / "all.jaeger.json").read_text())["data"]
    assert len(data) == 2, f"{len(data)} Jaeger traces, want one per rank (2)"
    assert out == f"wrote 2 traces to {jaeger_path}\n", f"jaeger printed {out!r}"
    inner = next(s for s in data[0]["spans"] if s["operationName"] == "inner")
    field = inner["logs"][0]["fields"][0]
    assert field == {"key": "event", "type": "string", "value": "exception"}, f"first log field {field}"


# -- providers ----------------------------------------------------------------------


def test_application_providers_are_kept(tmp_path):
    app_spans = InMemorySpanExporter()
    app_tracer_provider = TracerProvider()
    app_tracer_provider.add_span_processor(SimpleSpanProcessor(app_spans))
    app_reader = InMemoryMetricReader()
    app_meter_provider = MeterProvider(metric_readers=[app_reader])
    trace.set_tracer_provider(app_tracer_provider)
    metrics.set_meter_provider(app_meter_provider)

    run_steps(OptimizerObserver(fake_optimizer(), precision_aware=False), 2)
    telemetry.shutdown()

    assert trace.get_tracer_provider() is app_tracer_provider
    assert metrics.get_meter_provider() is app_meter_provider
    assert {s.name for s in app_spans.get_finished_spans()} >= STEP_NAMES
    assert metric_points(app_reader)[semconv.METRIC_STEP_DURATION][0].count == 2
    assert not (tmp_path / "traces").exists()
    assert providers.written_trace_files() == []
    # our shutdown left the application's providers running
    with app_tracer_provider.get_tracer("app").start_as_current_span("after"):
        pass
    assert app_spans.get_finished_spans()[-1].name == "after"


def test_only_the_missing_signal_is_installed():
    app_reader = InMemoryMetricReader()
    app_meter_provider = MeterProvider(metric_readers=[app_reader])
    metrics.set_meter_provider(app_meter_provider)
    run_steps(OptimizerObserver(fake_optimizer(), precision_aware=False), 1)
    # ours is used for spans, without taking the global slot from the application
    assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
    assert isinstance(providers.tracer_provider(), TracerProvider)
    assert metrics.get_meter_provider() is app_meter_provider
    assert providers.written_trace_files() == []  # not flushed yet
    providers.flush()
    assert providers.written_trace_files()[0].endswith("rank0.trace.json")


def test_sdk_disabled_yields_no_spans_files_or_providers(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    observer = OptimizerObserver(fake_optimizer(), precision_aware=False)
    run_steps(observer, 2)
    telemetry.shutdown()
    assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
    assert not (tmp_path / "traces").exists()
    assert capsys.readouterr().err == ""


def test_sdk_disabled_with_injected_sdk_providers_records_nothing(monkeypatch):
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    exporter = InMemorySpanExporter()
    provider = TracerProvider()  # reads OTEL_SDK_DISABLED itself
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    observer = OptimizerObserver(fake_optimizer(), precision_aware=False, tracer_provider=provider)
    run_steps(observer, 1)
    assert exporter.get_finished_spans() == ()


def test_resource_honours_otel_variables_and_torchrun(monkeypatch):
    monkeypatch.setenv("OTEL_SERVICE_NAME", "llm-pretrain")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=lab,team=numerics")
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-42")
    from fsdp_patch.telemetry.export.ranks import current_rank_info

    resource = build_resource(current_rank_info())
    attributes = dict(resource.attributes)
    assert attributes["service.name"] == "llm-pretrain"
    assert attributes["deployment.environment"] == "lab" and attributes["team"] == "numerics"
    assert (attributes[semconv.ATTR_RANK], attributes[semconv.ATTR_WORLD_SIZE], attributes["fsdp.local_rank"]) == (
        5,
        8,
        1,
    )
    assert attributes["fsdp.run_id"] == "job-42"
    monkeypatch.delenv("OTEL_SERVICE_NAME")
    assert build_resource(current_rank_info()).attributes["service.name"] == "fsdp_patch"


def test_destroy_process_group_is_wrapped_once():
    import torch.distributed as dist

    run_steps(OptimizerObserver(fake_optimizer(), precision_aware=False), 1)
    wrapper = dist.destroy_process_group
    assert getattr(wrapper, "_self_fsdp_telemetry_flush", False)
    assert dist.distributed_c10d.destroy_process_group is wrapper
    exit_hooks.wrap_destroy_process_group(providers.flush)
    assert dist.destroy_process_group is wrapper


def test_the_mesh_coordinate_joins_the_resource_until_uninstalled() -> None:
    from fsdp_patch.telemetry.export.ranks import current_rank_info, note_mesh_coordinate

    note_mesh_coordinate("replicate=1,shard=0")
    try:
        got = build_resource(current_rank_info()).attributes.get("fsdp.mesh.coordinate")
        assert got == "replicate=1,shard=0", f"want the noted coordinate in the resource, got {got!r}"
    finally:
        providers.uninstall()
    after = build_resource(current_rank_info()).attributes.get("fsdp.mesh.coordinate")
    assert after is None, f"want no coordinate after uninstall, got {after!r}"
