"""OTEL_TRACES_EXPORTER / OTEL_METRICS_EXPORTER mean to the embedded default what they mean to the SDK's
configurator (opentelemetry-instrument): the same names resolve to the same entry points and classes,
third-party ones included. On top: the defaults when unset, http/protobuf for otlp where no protocol
variable is set, and a bad name, protocol or exporter is one warning while the other names are kept;
the span exporters and metric readers the embedded default builds, and the Prometheus endpoint per
local rank (a busy port survived)."""

from __future__ import annotations

import logging
import socket
import sys
import textwrap
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from export_testing import run_steps, telemetry_warnings
from fsdp_patch.telemetry import OptimizerObserver
from fsdp_patch.telemetry.export import exporters, providers, selection
from fsdp_patch.telemetry.export.ranks import RankInfo
from fsdp_patch.telemetry.export.resource import build_resource
from opentelemetry.sdk import _configuration
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.util import _importlib_metadata
from telemetry_testing import fake_optimizer

RANK0 = RankInfo(rank=0, world_size=1, local_rank=0, run_id=None)

FAKE_MODULE = """
from opentelemetry.sdk.metrics.export import InMemoryMetricReader, MetricExporter, MetricExportResult
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult


class FakeSpanExporter(SpanExporter):
    def export(self, spans):
        return SpanExportResult.SUCCESS


class RaisingSpanExporter(SpanExporter):
    def __init__(self):
        raise ValueError("no endpoint configured")


class FakeMetricExporter(MetricExporter):
    def export(self, metrics_data, timeout_millis=10_000, **kwargs):
        return MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis=10_000):
        return True

    def shutdown(self, timeout_millis=30_000, **kwargs):
        pass


class FakePullReader(InMemoryMetricReader):
    pass
"""

FAKE_ENTRY_POINTS = """
[opentelemetry_traces_exporter]
fake_spans = fake_otel_exporters:FakeSpanExporter
broken_spans = fake_otel_exporters:RaisingSpanExporter
unloadable_spans = no_such_module_anywhere:Exporter
not_a_span_exporter = fake_otel_exporters:FakeMetricExporter

[opentelemetry_metrics_exporter]
fake_metrics = fake_otel_exporters:FakeMetricExporter
fake_pull = fake_otel_exporters:FakePullReader
"""


def _forget_entry_points() -> None:
    # The API caches the installed entry points for the process (1.45; older releases read them each time).
    cached = getattr(_importlib_metadata, "_original_entry_points_cached", None)
    if cached is not None:
        cached.cache_clear()


@pytest.fixture
def third_party(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A distribution installed for this test only, whose entry points name exporters as a third party's do."""
    site = tmp_path / "site"
    dist_info = site / "fake_otel_exporters-1.0.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-otel-exporters\nVersion: 1.0\n")
    (dist_info / "entry_points.txt").write_text(textwrap.dedent(FAKE_ENTRY_POINTS))
    (site / "fake_otel_exporters.py").write_text(textwrap.dedent(FAKE_MODULE))
    monkeypatch.syspath_prepend(str(site))
    _forget_entry_points()
    yield
    sys.modules.pop("fake_otel_exporters", None)
    _forget_entry_points()


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def the_sdks(signal: str) -> list[type]:
    """The classes the SDK's configurator (opentelemetry-instrument) selects for the variables as set."""
    traces, metrics, _logs = _configuration._import_exporters(
        _configuration._get_exporter_names("traces") if signal == "traces" else [],
        _configuration._get_exporter_names("metrics") if signal == "metrics" else [],
        [],
    )
    return list((traces if signal == "traces" else metrics).values())


# (signal, variables, the entry points they resolve to)
SAME_AS_THE_SDK = [
    ("traces", {"OTEL_TRACES_EXPORTER": "console"}, ["console"]),
    ("traces", {"OTEL_TRACES_EXPORTER": "trace_file"}, ["trace_file"]),
    ("traces", {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, ["otlp_proto_grpc"]),
    ("traces", {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}, ["otlp_proto_http"]),
    (
        "traces",
        {
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        },
        ["otlp_proto_grpc"],
    ),
    (
        "traces",
        {
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        },
        ["otlp_proto_http"],
    ),
    ("traces", {"OTEL_TRACES_EXPORTER": "otlp_proto_grpc"}, ["otlp_proto_grpc"]),
    (
        "traces",
        {"OTEL_TRACES_EXPORTER": "otlp,otlp_proto_grpc", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
        ["otlp_proto_grpc"],
    ),
    ("traces", {"OTEL_TRACES_EXPORTER": "fake_spans"}, ["fake_spans"]),
    ("traces", {"OTEL_TRACES_EXPORTER": "console, trace_file ,fake_spans"}, ["console", "trace_file", "fake_spans"]),
    ("metrics", {"OTEL_METRICS_EXPORTER": "console"}, ["console"]),
    ("metrics", {"OTEL_METRICS_EXPORTER": "summary"}, ["summary"]),
    ("metrics", {"OTEL_METRICS_EXPORTER": "prometheus"}, ["prometheus"]),
    ("metrics", {"OTEL_METRICS_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": "grpc"}, ["otlp_proto_grpc"]),
    ("metrics", {"OTEL_METRICS_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}, ["otlp_proto_http"]),
    ("metrics", {"OTEL_METRICS_EXPORTER": "fake_metrics,fake_pull"}, ["fake_metrics", "fake_pull"]),
    ("metrics", {"OTEL_METRICS_EXPORTER": "summary,console"}, ["summary", "console"]),
]


@pytest.mark.parametrize(("signal", "variables", "entry_points"), SAME_AS_THE_SDK)
def test_a_name_means_the_same_exporter_as_under_the_sdks_configurator(
    monkeypatch, third_party, signal, variables, entry_points
):
    for variable, value in variables.items():
        monkeypatch.setenv(variable, value)
    resolved = selection.resolve(signal)
    got = [r.entry_point for r in resolved]
    assert got == entry_points, f"{variables}: want the entry points {entry_points}, got {got}"
    ours, sdks = [r.exporter_class for r in resolved], the_sdks(signal)
    assert ours == sdks, f"{variables}: the embedded default resolved {ours}, the SDK's configurator {sdks}"


def test_otlp_is_http_protobuf_where_no_protocol_variable_is_set(monkeypatch):
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")  # traces only: metrics have none set
    got = {signal: [r.entry_point for r in selection.resolve(signal)] for signal in ("traces", "metrics")}
    want = {"traces": ["otlp_proto_grpc"], "metrics": ["otlp_proto_http"]}
    assert got == want, f"want the SDK's choice where a protocol is set, else http/protobuf: {want}, got {got}"
    sdks = _configuration._get_exporter_names("metrics")
    assert sdks == ["otlp_proto_grpc"], f"the SDK's configurator's own default changed: {sdks}"


@pytest.mark.parametrize("value", ["", "   "])
def test_unset_or_empty_selects_the_trace_files_and_the_summary(monkeypatch, value):
    if value:
        monkeypatch.setenv("OTEL_TRACES_EXPORTER", value)
        monkeypatch.setenv("OTEL_METRICS_EXPORTER", value)
    got = {signal: [r.name for r in selection.resolve(signal)] for signal in ("traces", "metrics")}
    assert got == {"traces": ["trace_file"], "metrics": ["summary"]}, f"want the embedded defaults, got {got}"

    spans, files = exporters.build_span_exporters(RANK0, build_resource(RANK0))
    assert [type(s.inner).__name__ for s in spans] == ["TraceFileSpanExporter"], f"got {spans}"
    assert files == [spans[0].inner], f"want the trace-file exporter remembered, got {files}"
    setup = exporters.build_metric_readers(RANK0, "header")
    assert setup.summary is not None and setup.readers == [setup.summary.reader], f"got {setup}"
    assert selection.trace_files_off_reason() is None


def test_none_selects_nothing(monkeypatch):
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "None")
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "none")
    got = {signal: selection.resolve(signal) for signal in ("traces", "metrics")}
    assert got == {"traces": [], "metrics": []}, f"want nothing, got {got}"
    reason = selection.trace_files_off_reason()
    want = "OTEL_TRACES_EXPORTER=None does not list trace_file"
    assert reason is not None and reason.startswith(want), f"want {want!r}..., got {reason!r}"
    assert reason.endswith("set OTEL_TRACES_EXPORTER=trace_file"), reason


def test_a_bad_name_is_a_warning_and_the_others_are_kept(monkeypatch, caplog, third_party):
    listed = "console,zipkinn,unloadable_spans,not_a_span_exporter,broken_spans,fake_spans"
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", listed)
    with caplog.at_level(logging.WARNING):
        spans, files = exporters.build_span_exporters(RANK0, build_resource(RANK0))
    got = [type(s.inner).__name__ for s in spans]
    assert got == ["ConsoleSpanExporter", "FakeSpanExporter"], f"want the names that work kept, got {got}"
    assert files == []
    messages = warnings_of(caplog)
    assert len(messages) == 4, f"want one warning per bad name, got {messages}"
    unknown, unloadable, wrong_kind, raising = messages
    assert "OTEL_TRACES_EXPORTER lists 'zipkinn'" in unknown, unknown
    accepted = unknown.split("accepted values: ", 1)[-1].split(". ", 1)[0].split(", ")
    assert {"console", "fake_spans", "otlp", "trace_file", "none"} <= set(accepted), (
        f"want the names that select something: {unknown}"
    )
    assert "'unloadable_spans'" in unloadable and "ModuleNotFoundError" in unloadable, unloadable
    assert "'not_a_span_exporter'" in wrong_kind and "is not a trace exporter" in wrong_kind, wrong_kind
    assert "could not create span exporter 'broken_spans'" in raising, raising
    assert "ValueError: no endpoint configured" in raising, raising


def test_a_bad_metric_name_keeps_the_summary(monkeypatch, caplog):
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "summary,statsd")
    with caplog.at_level(logging.WARNING):
        setup = exporters.build_metric_readers(RANK0, "header")
    assert setup.summary is not None and setup.readers == [setup.summary.reader], f"got {setup.readers}"
    (message,) = warnings_of(caplog)
    assert "OTEL_METRICS_EXPORTER lists 'statsd'" in message and "summary" in message, message


def test_a_refused_protocol_is_a_warning_naming_it_and_the_others_are_kept(monkeypatch, caplog):
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp,console")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json")
    with pytest.raises(RuntimeError, match="Unsupported OTLP protocol 'http/json'"):
        _configuration._get_exporter_names("traces")  # opentelemetry-instrument stops here
    with caplog.at_level(logging.WARNING):
        spans, _files = exporters.build_span_exporters(RANK0, build_resource(RANK0))
    got = [type(s.inner).__name__ for s in spans]
    assert got == ["ConsoleSpanExporter"], f"want console kept, got {got}"
    (message,) = warnings_of(caplog)
    want = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL='http/json' is not valid; accepted values: grpc, http/protobuf."
    assert message.startswith(want), f"want {want!r}..., got {message!r}"


def test_a_missing_otlp_package_names_the_extra(monkeypatch, caplog):
    installed = selection.installed_entry_points
    monkeypatch.setattr(
        selection,
        "installed_entry_points",
        lambda group: [ep for ep in installed(group) if ep.name != "otlp_proto_grpc"],
    )
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp,trace_file")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    with caplog.at_level(logging.WARNING):
        got = [r.name for r in selection.resolve("traces")]
    assert got == ["trace_file"], f"want the trace files kept, got {got}"
    (message,) = warnings_of(caplog)
    assert "'otlp' (the entry point 'otlp_proto_grpc')" in message, message
    assert "pip install 'fsdp-patch[otlp]'" in message, message


def test_the_product_uses_no_private_opentelemetry_name() -> None:
    """Every OpenTelemetry module and name the product imports is public (no ``_``-prefixed part): an
    SDK release may change its private ones; the tests may still read them as a control."""
    import ast

    root = Path(selection.__file__).resolve().parents[1]
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            modules: list[str] = []
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("opentelemetry"):
                modules = [f"{node.module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names if alias.name.startswith("opentelemetry")]
            elif (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and node.value.startswith("opentelemetry")
            ):
                modules = [node.value]  # a logger or module named by string
            private = [m for m in modules if any(part.startswith("_") for part in m.split("."))]
            found += [f"{path.relative_to(root)}:{node.lineno}: {m}" for m in private]
    assert not found, "private OpenTelemetry names used by the product:\n" + "\n".join(found)


# -- the builders, name by name; the Prometheus reader ----------------------------------


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
