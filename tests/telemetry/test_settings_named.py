"""Every setting that cannot be honoured is named in one line, and what a user needs to find the
telemetry (trace cap, trace directory, Prometheus endpoints) is printed where the job's output is read.

Each test adapts a real observer on its embedded default and runs a step, as the adapter does.
"""

from __future__ import annotations

import logging
import urllib.request
from pathlib import Path

import fsdp_patch.telemetry as telemetry
import pytest
import torch
from fsdp_patch.telemetry import OptimizerObserver
from telemetry_testing import Group, fake_optimizer, run_fake_step


def _one_step() -> None:
    main = torch.linspace(0.5, 1.5, 16)
    group = Group(main, main.to(torch.bfloat16), torch.ones(16, dtype=torch.bfloat16))
    run_fake_step(OptimizerObserver(fake_optimizer(), precision_aware=False), [group], [main + 0.25])


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_trace_cap_below_a_mebibyte_is_printed_as_it_is(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setenv("FSDP_PATCH_TRACE_MAX_BYTES", "64K")
    _one_step()
    telemetry.shutdown()
    err = capsys.readouterr().err
    start = next((line for line in err.splitlines() if "traces go to" in line), None)
    assert start is not None, f"no start-up line about the traces: {err!r}"
    assert "at most 64 KiB per rank" in start, f"the start-up line misstates a 64K cap: {start!r}"


def test_a_trace_directory_that_cannot_be_created_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    trace_dir = blocker / "traces"
    monkeypatch.setenv("FSDP_PATCH_TRACE_DIR", str(trace_dir))
    with caplog.at_level(logging.WARNING):
        _one_step()
        telemetry.shutdown()
    messages = _warnings(caplog)
    assert len(messages) == 1, f"want one warning, got {messages}"
    want = f"cannot create the trace directory {trace_dir}"
    assert want in messages[0] and "FSDP_PATCH_TRACE_DIR" in messages[0], f"want {want!r}, got {messages[0]!r}"
    assert "rank0" not in messages[0], f"the warning names a file instead of the directory: {messages[0]!r}"


def test_each_rank_prints_its_prometheus_endpoint_when_it_starts(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    pytest.importorskip("opentelemetry.exporter.prometheus")
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "prometheus")
    monkeypatch.setenv("OTEL_EXPORTER_PROMETHEUS_PORT", "0")  # any free port: the line must name the real one
    monkeypatch.setenv("FSDP_PATCH_SUMMARY", "none")
    monkeypatch.setenv("FSDP_PATCH_PROMETHEUS_FINAL_SCRAPES", "0")  # scraped by hand here; no Prometheus comes back
    from prometheus_client import REGISTRY

    before = set(REGISTRY._collector_to_names)
    try:
        _one_step()
        err = capsys.readouterr().err  # before shutdown: where a user starting the job looks
        lines = [line for line in err.splitlines() if "serves Prometheus metrics at" in line]
        assert len(lines) == 1, f"want one endpoint line, got {lines} in {err!r}"
        url = lines[0].rsplit(" ", 1)[1]
        assert lines[0].startswith("fsdp_patch telemetry: rank 0 serves") and url.startswith("http://localhost:"), (
            lines[0]
        )
        with urllib.request.urlopen(url, timeout=10) as response:
            body = response.read().decode()
        assert "fsdp_optimizer_step_duration_seconds_count" in body, f"{url} does not serve the step metrics"
    finally:
        telemetry.shutdown()
        for collector in set(REGISTRY._collector_to_names) - before:
            REGISTRY.unregister(collector)


# (variable, bad value, other variables the case needs, what the message must also say)
BAD_SETTINGS = [
    ("OTEL_METRIC_EXPORT_INTERVAL", "-5", {}, "a positive number"),
    ("OTEL_METRIC_EXPORT_TIMEOUT", "abc", {}, "a non-negative number"),
    ("OTEL_SDK_DISABLED", "maybe", {}, "true, false"),
    ("OTEL_SERVICE_NAME", "", {}, "'fsdp_patch'"),
    ("OTEL_SERVICE_NAME", "  ", {}, "'fsdp_patch'"),
    ("OTEL_SERVICE_NAME", "", {"OTEL_RESOURCE_ATTRIBUTES": "service.name=from-attributes"}, "'from-attributes'"),
    ("OTEL_BSP_SCHEDULE_DELAY", "-1", {}, "a positive number"),
    ("OTEL_BSP_MAX_QUEUE_SIZE", "x", {}, "a positive integer"),
    ("OTEL_ATTRIBUTE_COUNT_LIMIT", "-3", {}, "a non-negative integer"),
    ("OTEL_TRACES_EXPORTER", "otlpp", {}, "accepted values: console, otlp, otlp_proto_grpc"),
    ("OTEL_METRICS_EXPORTER", "promethus", {}, "prometheus, summary, none"),
    ("FSDP_PATCH_TRACE_MAX_BYTES", "12", {}, "64K"),
]


@pytest.mark.parametrize(
    ("variable", "value", "others", "also"), BAD_SETTINGS, ids=lambda v: v if isinstance(v, str) else ""
)
def test_a_setting_that_cannot_be_honoured_is_named_in_one_line(
    variable: str, value: str, others: dict[str, str], also: str, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    monkeypatch.setenv("FSDP_PATCH_SUMMARY", "none")
    for name, other in others.items():
        monkeypatch.setenv(name, other)
    monkeypatch.setenv(variable, value)
    with caplog.at_level(logging.WARNING):
        _one_step()
        telemetry.shutdown()
    naming = [m for m in _warnings(caplog) if variable in m]
    assert len(naming) == 1, f"{variable}={value!r}: want one line naming it, got {naming} (all: {_warnings(caplog)})"
    line = naming[0]
    assert "\n" not in line and (repr(value) in line or not value.strip()), (
        f"the line does not show the value: {line!r}"
    )
    assert also in line, f"{variable}={value!r}: the line does not say {also!r}: {line!r}"


def test_valid_settings_are_silent(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    for variable, value in (
        ("OTEL_SDK_DISABLED", "false"),
        ("OTEL_SERVICE_NAME", "llm"),
        ("OTEL_METRIC_EXPORT_INTERVAL", "5000"),
    ):
        monkeypatch.setenv(variable, value)
    monkeypatch.setenv("FSDP_PATCH_SUMMARY", "none")
    with caplog.at_level(logging.WARNING):
        _one_step()
        telemetry.shutdown()
    assert _warnings(caplog) == [], _warnings(caplog)
