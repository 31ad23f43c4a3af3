"""Provider resolution, the embedded default (trace file + summary), OTEL_* exporters and failure isolation."""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import urllib.request

import fsdp_patch.telemetry as telemetry
import pytest
import torch
from fsdp_patch.app import cli
from fsdp_patch.telemetry import OptimizerObserver, semconv
from fsdp_patch.telemetry.export import exit_hooks, exporters, providers, trace_files
from fsdp_patch.telemetry.export.isolation import GuardedSpanExporter, WarnOnce, run_bounded
from fsdp_patch.telemetry.export.ranks import RankInfo
from fsdp_patch.telemetry.export.resource import build_resource
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from telemetry_testing import Group, fake_optimizer, metric_points, run_fake_step

from tests.silent_collector import BOUND_S, SilentCollector

STEP_NAMES = {semconv.SPAN_STEP, *semconv.STEP_PHASE_SPANS} - {semconv.SPAN_PRECISION}


def group() -> Group:
    main = torch.linspace(0.5, 1.5, 32)
    return Group(main, main.to(torch.bfloat16), torch.ones(32, dtype=torch.bfloat16))


def run_steps(observer: OptimizerObserver, steps: int = 3) -> None:
    g = group()
    for _ in range(steps):
        run_fake_step(observer, [g], [g.main_weight + 0.25], cast_bytes=64)


def telemetry_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def load_trace(path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return json.load(f)["traceEvents"]


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


# -- exporter selection ---------------------------------------------------------------

RANK0 = RankInfo(rank=0, world_size=1, local_rank=0, run_id=None)


def inner_types(exps) -> list[str]:
    return [type(getattr(e, "inner", e)).__name__ for e in exps]


def test_span_exporter_selection(monkeypatch, caplog):
    resource = build_resource(RANK0)
    got = inner_types(exporters.build_span_exporters(RANK0, resource)[0])
    assert got == ["TraceFileSpanExporter"], f"unset: want the trace files, got {got}"
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console, none")
    got = inner_types(exporters.build_span_exporters(RANK0, resource)[0])
    assert got == ["ConsoleSpanExporter"], f"console, none: got {got}"
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp,trace_file")
    built = exporters.build_span_exporters(RANK0, resource)[0]
    got = inner_types(built)
    assert got == ["OTLPSpanExporter", "TraceFileSpanExporter"], f"otlp,trace_file: got {got}"
    assert "proto.http" in type(built[0].inner).__module__  # the specification's default protocol
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    assert "proto.grpc" in type(exporters.build_span_exporters(RANK0, resource)[0][0].inner).__module__
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    assert "proto.http" in type(exporters.build_span_exporters(RANK0, resource)[0][0].inner).__module__
    for built in exporters.build_span_exporters(RANK0, resource)[0]:
        built.shutdown()

    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "zipkinn")
    with caplog.at_level(logging.WARNING):
        assert exporters.build_span_exporters(RANK0, resource)[0] == []
    (message,) = telemetry_warnings(caplog)
    assert "OTEL_TRACES_EXPORTER lists 'zipkinn'" in message, message
    assert "accepted values: " in message and "console" in message and "trace_file" in message, message


def test_unsupported_protocol_and_missing_package_are_explained(monkeypatch, caplog):
    from fsdp_patch.telemetry.export import selection

    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
    with caplog.at_level(logging.WARNING):
        assert exporters.build_span_exporters(RANK0, build_resource(RANK0))[0] == []
    (message,) = telemetry_warnings(caplog)
    assert "OTEL_EXPORTER_OTLP_PROTOCOL='http/json'" in message and "grpc, http/protobuf" in message, message

    caplog.clear()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    installed = selection.installed_entry_points
    monkeypatch.setattr(
        selection,
        "installed_entry_points",
        lambda group: [ep for ep in installed(group) if ep.name != "otlp_proto_grpc"],
    )
    with caplog.at_level(logging.WARNING):
        assert exporters.build_span_exporters(RANK0, build_resource(RANK0))[0] == []
    assert "pip install 'fsdp-patch[otlp]'" in telemetry_warnings(caplog)[0]


def test_metric_reader_selection(monkeypatch):
    setup = exporters.build_metric_readers(RANK0, "header")
    assert setup.summary is not None and setup.readers == [setup.summary.reader]
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "console,otlp")
    setup = exporters.build_metric_readers(RANK0, "header")
    assert setup.summary is None
    assert [type(r.__dict__["_exporter"].inner).__name__ for r in setup.readers] == [
        "ConsoleMetricExporter",
        "OTLPMetricExporter",
    ]
    for reader in setup.readers:
        reader.shutdown()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_prometheus_endpoint_serves_rank_labelled_metrics(monkeypatch, otel):
    from prometheus_client import CollectorRegistry

    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "prometheus")
    monkeypatch.setenv("OTEL_EXPORTER_PROMETHEUS_HOST", "127.0.0.1")
    monkeypatch.setenv("OTEL_EXPORTER_PROMETHEUS_PORT", "0")
    setup = exporters.build_metric_readers(RANK0, "header", prometheus_registry=CollectorRegistry())
    provider = MeterProvider(metric_readers=setup.readers)
    try:
        observer = OptimizerObserver(
            fake_optimizer(), precision_aware=False, tracer_provider=otel.tracer_provider, meter_provider=provider
        )
        run_steps(observer, 2)
        (endpoint,) = setup.prometheus_endpoints
        url = f"http://127.0.0.1:{endpoint.port}/metrics"
        body = urllib.request.urlopen(url, timeout=10).read().decode()
    finally:
        provider.shutdown()
        providers._stop_servers(setup)
    assert 'fsdp_optimizer_step_duration_seconds_count{fsdp_rank="0"' in body
    assert "fsdp_optimizer_cast_size_bytes_total" in body


def test_prometheus_port_offsets_by_local_rank_and_survives_a_busy_port(monkeypatch, caplog):
    assert exporters._prometheus_port(local_rank=3) == 9464 + 3
    monkeypatch.setenv("OTEL_EXPORTER_PROMETHEUS_PORT", "12000")
    assert exporters._prometheus_port(local_rank=2) == 12002
    monkeypatch.setenv("OTEL_EXPORTER_PROMETHEUS_PORT", "http")
    with caplog.at_level(logging.WARNING):
        assert exporters._prometheus_port(local_rank=0) == 9464
    assert "OTEL_EXPORTER_PROMETHEUS_PORT='http'" in telemetry_warnings(caplog)[0]

    caplog.clear()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        monkeypatch.setenv("OTEL_METRICS_EXPORTER", "prometheus")
        monkeypatch.setenv("OTEL_EXPORTER_PROMETHEUS_HOST", "127.0.0.1")
        monkeypatch.setenv("OTEL_EXPORTER_PROMETHEUS_PORT", str(busy.getsockname()[1]))
        from prometheus_client import CollectorRegistry

        with caplog.at_level(logging.WARNING):
            setup = exporters.build_metric_readers(RANK0, "h", prometheus_registry=CollectorRegistry())
    assert setup.readers == [] and setup.prometheus_endpoints == []
    assert "cannot serve Prometheus metrics" in telemetry_warnings(caplog)[0]


# -- failure isolation ----------------------------------------------------------------


class RaisingExporter(SpanExporter):
    def __init__(self) -> None:
        self.calls = 0

    def export(self, spans):
        self.calls += 1
        raise ConnectionError("collector is gone")

    def shutdown(self):
        raise OSError("cannot close")


def test_raising_exporter_never_reaches_training_and_warns_once(otel, caplog, tmp_path):
    raising = RaisingExporter()
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(GuardedSpanExporter(raising), schedule_delay_millis=10))
    observer = OptimizerObserver(
        fake_optimizer(), precision_aware=False, tracer_provider=provider, meter_provider=otel.meter_provider
    )
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            run_steps(observer, 2)
            provider.force_flush()
        provider.shutdown()
    assert raising.calls >= 3
    messages = telemetry_warnings(caplog)
    assert len(messages) == 1, messages
    assert "RaisingExporter failed to export spans (ConnectionError: collector is gone)" in messages[0]
    assert otel.points()[semconv.METRIC_STEP_DURATION][0].count == 6  # metrics unaffected


def test_a_silent_collector_holds_neither_the_steps_nor_the_end_and_is_reported_once(monkeypatch, caplog):
    with SilentCollector() as collector:
        monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
        monkeypatch.setenv("OTEL_METRICS_EXPORTER", "otlp")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", collector.url)
        # Ten times the flush budget: an exporter waiting for the collector is still waiting when
        # flush and shutdown return, and gives up before the test ends.
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "5")
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "10")
        monkeypatch.setenv("FSDP_PATCH_FLUSH_TIMEOUT", "0.5")
        observer = OptimizerObserver(fake_optimizer(), precision_aware=False)
        with caplog.at_level(logging.WARNING):
            run_steps(observer, 3)
            assert collector.wait_for_request(), "the exporters never reached the collector"
            run_steps(observer, 3)  # they return while an export is waiting: it runs off the training thread
            providers.flush()
            run_steps(observer, 3)
            telemetry.shutdown()
            waiting = collector.open_connections()
            until_shutdown = list(caplog.records)
        assert waiting > 0, "flush and shutdown returned only once the exporters had given up on the collector"
        # The exporters' threads end on their own timeout, not on a connection the test cuts (whose
        # retries would log into later tests).
        assert collector.wait_until_idle(), "the exporters never gave up on the silent collector"
    messages = telemetry_warnings(caplog)
    span_reports = [m for m in messages if "OTLPSpanExporter failed to export spans" in m]
    metric_reports = [m for m in messages if "OTLPMetricExporter failed to export metrics" in m]
    timeouts = [m for m in messages if "did not finish within 0.5s" in m]
    assert len(span_reports) <= 1 and len(metric_reports) <= 1, f"want each exporter reported once at most: {messages}"
    assert timeouts, f"want the budget named where the collector held the flush: {messages}"
    # OpenTelemetry's own retry warnings were folded into those reports while telemetry ran.
    theirs = [
        r.getMessage() for r in until_shutdown if r.name.startswith("opentelemetry") and r.levelno >= logging.WARNING
    ]
    assert theirs == [], f"want OpenTelemetry's own warnings folded into ours, got {theirs}"


def test_unwritable_trace_dir_warns_once(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("FSDP_PATCH_TRACE_DIR", str(blocker / "traces"))
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "10")
    observer = OptimizerObserver(fake_optimizer(), precision_aware=False)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            run_steps(observer, 1)
            providers.flush()
        telemetry.shutdown()
    messages = telemetry_warnings(caplog)
    # Warnings of other origin (a thread an earlier test left behind) are not this test's subject.
    about_dir = [m for m in messages if "a_file" in m or "TraceFileSpanExporter" in m]
    assert len(about_dir) == 1, f"want one warning about the unwritable trace dir, got {about_dir}; all: {messages}"
    assert "TraceFileSpanExporter failed to export spans" in about_dir[0] and "a_file" in about_dir[0], about_dir


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full to simulate a full disk")
def test_full_disk_warns_once_and_training_continues(tmp_path, caplog, otel):
    (tmp_path / "rank0.trace.json").symlink_to("/dev/full")
    exporter = GuardedSpanExporter(trace_files.TraceFileExporter(str(tmp_path), 0, {}))
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=10))
    observer = OptimizerObserver(
        fake_optimizer(), precision_aware=False, tracer_provider=provider, meter_provider=otel.meter_provider
    )
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            run_steps(observer, 1)
            provider.force_flush()
        provider.shutdown()
    messages = telemetry_warnings(caplog)
    assert len(messages) == 1, messages
    assert "No space left on device" in messages[0]


def test_run_bounded_gives_up_waiting_and_warns_once(caplog):
    warn = WarnOnce(logging.getLogger("telemetry.test"))
    with caplog.at_level(logging.WARNING):
        release = threading.Event()
        finished: list[bool] = []

        def slow() -> None:
            release.wait(BOUND_S)
            finished.append(True)

        assert run_bounded(slow, 0.2, "slow flush", warn) is False
        assert run_bounded(slow, 0.2, "slow flush", warn) is False
        assert finished == [], "run_bounded waited for the call it bounds"
        release.set()
        assert run_bounded(lambda: 1 / 0, 1.0, "bad flush", warn) is False
        assert run_bounded(lambda: None, 1.0, "good flush", warn) is True
    messages = telemetry_warnings(caplog)
    assert len(messages) == 2
    assert "slow flush did not finish within 0.2s" in messages[0]
    assert "ZeroDivisionError" in messages[1]


class BlockingExporter(SpanExporter):
    """A collector that hangs: export waits until released."""

    def __init__(self) -> None:
        import threading

        self.release = threading.Event()
        self.entered = threading.Event()
        self.exporting = False
        self.exported_batches = 0

    def export(self, spans):
        self.entered.set()
        self.exporting = True
        self.exported_batches += 1
        self.release.wait(BOUND_S)
        self.exporting = False
        return SpanExportResult.SUCCESS

    def shutdown(self):
        self.release.set()


def test_hanging_exporter_does_not_block_steps_and_queue_overflow_is_reported_once(monkeypatch, caplog):
    from fsdp_patch.telemetry.export import isolation

    monkeypatch.setattr(isolation._ONCE, "_seen", set())  # a fresh "once" for this test
    blocking = BlockingExporter()
    monkeypatch.setattr(providers, "build_span_exporters", lambda info, resource: ([GuardedSpanExporter(blocking)], []))
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "8")
    monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "4")
    monkeypatch.setenv("FSDP_PATCH_FLUSH_TIMEOUT", "1")
    observer = OptimizerObserver(fake_optimizer(), precision_aware=False)
    with caplog.at_level(logging.WARNING):
        run_steps(observer, 20)  # 100+ spans into a queue of 8 behind a hung export
        assert blocking.entered.wait(BOUND_S), "nothing was exported"
        assert blocking.exporting, "the steps returned only once the hung export had returned"
        blocking.release.set()
        telemetry.shutdown()
    queue_full = [m for m in telemetry_warnings(caplog) if "Queue full" in m]
    assert len(queue_full) == 1
    assert blocking.exported_batches >= 1


def test_queue_full_warnings_fold_for_our_processors_only(monkeypatch, caplog):
    """Our batch processors' "Queue full" warning shows once per run, beyond the SDK's own 20 s
    window; an application's processor in the same process keeps the SDK's behaviour."""
    from fsdp_patch.telemetry.export.isolation import OwnBatchSpanProcessor

    now = [1000.0]
    monkeypatch.setattr(time, "time", lambda: now[0])  # the SDK's own filter forgets after 20 s
    counts = {}
    for label, processor_class in (("ours", OwnBatchSpanProcessor), ("application's", BatchSpanProcessor)):
        exporter = BlockingExporter()
        processor = processor_class(exporter, max_queue_size=1, max_export_batch_size=1, schedule_delay_millis=60_000)
        provider = TracerProvider()
        provider.add_span_processor(processor)
        tracer = provider.get_tracer("t")
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            tracer.start_span("first").end()
            assert exporter.entered.wait(10), "the exporter never started exporting"
            for _ in range(5):  # queue of 1 behind a hung export: each further span is dropped
                tracer.start_span("more").end()
                now[0] += 40
        counts[label] = sum("Queue full" in r.getMessage() for r in caplog.records)
        exporter.release.set()
        provider.shutdown()
    assert counts["ours"] == 1, f"our processor: want the warning once, got {counts['ours']} times"
    assert counts["application's"] >= 2, f"application's processor: want the SDK's repeats, got {counts}"


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
