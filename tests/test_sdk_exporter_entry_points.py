"""The trace files and the exit summary are the SDK's own exporters, selected by name.

They are registered as the entry points ``trace_file`` (``opentelemetry_traces_exporter``) and
``summary`` (``opentelemetry_metrics_exporter``), so the SDK's configurator finds them the way it
finds ``console`` or ``otlp``: ``opentelemetry-instrument`` with ``OTEL_TRACES_EXPORTER=trace_file``
writes this package's trace files and ``OTEL_METRICS_EXPORTER=summary`` prints its summary.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from fsdp_patch.telemetry.export.exporters import TraceFileSpanExporter
from fsdp_patch.telemetry.export.summary import SummaryMetricReader
from opentelemetry.sdk._configuration import _import_exporters
from opentelemetry.sdk.metrics import MeterProvider

from tests.integration.test_opentelemetry_instrument import job_python_path  # noqa: F401 (a fixture)
from tests.training_script import one_rank_training

REPO = Path(__file__).resolve().parents[1]


def test_the_sdk_configurator_imports_them_by_name() -> None:
    spans, metrics, _logs = _import_exporters(["trace_file"], ["summary"], [])
    assert spans == {"trace_file": TraceFileSpanExporter}, f"want trace_file -> TraceFileSpanExporter, got {spans}"
    assert metrics == {"summary": SummaryMetricReader}, f"want summary -> SummaryMetricReader, got {metrics}"


def test_trace_file_exporter_without_arguments_reads_the_environment(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("FSDP_PATCH_TRACE_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "entry-point-job")
    exporter = TraceFileSpanExporter()
    got = (exporter.directory, exporter.rank)
    assert got == (str(tmp_path), 3), f"want the directory and rank of the environment, got {got}"
    exporter.shutdown()


def test_summary_reader_prints_at_shutdown(monkeypatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("FSDP_PATCH_SUMMARY", "all")
    reader = SummaryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    provider.get_meter("t").create_counter("fsdp.optimizer.cast.size", unit="By").add(7)
    provider.shutdown()
    err = capsys.readouterr().err
    assert "fsdp_patch telemetry summary: rank 0 of 1" in err and "fsdp.optimizer.cast.size [By]" in err, err


def test_summary_reader_of_a_process_that_recorded_nothing_prints_nothing(monkeypatch, capsys) -> None:
    # A launcher (torchrun) under opentelemetry-instrument gets a reader too, and trains nothing.
    monkeypatch.setenv("FSDP_PATCH_SUMMARY", "all")
    provider = MeterProvider(metric_readers=[SummaryMetricReader()])
    provider.get_meter("t")
    provider.shutdown()
    err = capsys.readouterr().err
    assert "fsdp_patch" not in err, f"want nothing printed, got:\n{err}"


# Two training steps of an optimizer the instrumentor adapts.
SCRIPT = one_rank_training(2, adapt=False)


def test_opentelemetry_instrument_selects_them(job_python_path: str, tmp_path: Path) -> None:  # noqa: F811
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FSDP_PATCH_", "OTEL_", "PYTHONPATH"))}
    if job_python_path:
        env["PYTHONPATH"] = job_python_path
    env.update(
        OTEL_TRACES_EXPORTER="trace_file",
        OTEL_METRICS_EXPORTER="summary",
        OTEL_LOGS_EXPORTER="none",
        FSDP_PATCH_TRACE_DIR=str(tmp_path / "traces"),
        FSDP_PATCH_PRECISION_EVERY="0",
    )
    command = [str(Path(sys.executable).parent / "opentelemetry-instrument"), sys.executable, str(script)]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, f"want exit 0, got {result.returncode}:\n{result.stderr[-3000:]}"
    trace = tmp_path / "traces" / "rank0.trace.json"
    assert trace.is_file(), f"want {trace} written by the trace_file entry point; stderr:\n{result.stderr[-2000:]}"
    events = json.loads(trace.read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    steps = [e for e in events if e.get("name") == "fsdp.optimizer.step" and e.get("ph") == "X"]
    assert len(steps) == 2, f"want 2 fsdp.optimizer.step spans in {trace.name}, got {len(steps)}"
    assert "fsdp_patch telemetry summary: rank 0 of 1" in result.stderr, result.stderr[-2000:]
    assert "fsdp.optimizer.step.duration [s]" in result.stderr, result.stderr[-2000:]
