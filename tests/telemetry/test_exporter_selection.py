"""The exporters ``OTEL_*`` selects: span exporters and metric readers by name, an unsupported protocol or a
missing package explained, the Prometheus endpoint per local rank."""

from __future__ import annotations

import logging
import socket
import urllib.request

from export_testing import run_steps, telemetry_warnings
from fsdp_patch.telemetry import OptimizerObserver
from fsdp_patch.telemetry.export import exporters, providers
from fsdp_patch.telemetry.export.ranks import RankInfo
from fsdp_patch.telemetry.export.resource import build_resource
from opentelemetry.sdk.metrics import MeterProvider
from telemetry_testing import fake_optimizer

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
