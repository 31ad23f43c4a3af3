"""``fsdp-patch demo`` against an OTLP collector that never answers, on 2 ranks.

With ``--exporter otlp`` (OTLP beside the trace files) the end of the run does not wait for the
collector past FSDP_PATCH_FLUSH_TIMEOUT (its exporters would wait an hour: the demo exits at all),
and the report still covers every step. With ``OTEL_TRACES_EXPORTER=otlp`` alone no trace files
are written: the demo says so and how to keep them, and does not report the trace files an earlier
run left in the directory.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.silent_collector import BOUND_S, EXPORTER_TIMEOUT_S, SilentCollector

pytestmark = pytest.mark.long  # the demo against a collector that stops answering

REPO = Path(__file__).resolve().parents[2]
BUDGET_S = 2.0
STEPS = 3


def _demo(cwd: Path, trace_dir: Path, collector: SilentCollector, *args: str, **env: str) -> tuple[int, str, str]:
    """Run the demo; its exit code, its stdout and its stderr."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("FSDP_PATCH_", "OTEL_"))}
    environment.update(
        PYTHONPATH=str(REPO) + os.pathsep + environment.get("PYTHONPATH", ""),
        OTEL_EXPORTER_OTLP_ENDPOINT=collector.url,
        OTEL_EXPORTER_OTLP_TIMEOUT=str(EXPORTER_TIMEOUT_S),
        FSDP_PATCH_FLUSH_TIMEOUT=str(BUDGET_S),
        **env,
    )
    command = [
        sys.executable,
        "-m",
        "fsdp_patch",
        "demo",
        "--steps",
        str(STEPS),
        "--precision-every",
        "1",
        "--progress",
        "lines",
        "--trace-dir",
        str(trace_dir),
        *args,
    ]
    try:
        result = subprocess.run(command, cwd=cwd, env=environment, capture_output=True, text=True, timeout=BOUND_S * 5)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"the demo did not exit: its end waited for the collector\n{exc.stdout}") from None
    return result.returncode, result.stdout, result.stderr


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[int, str, str]]:
    work = tmp_path_factory.mktemp("demo_collector")
    traces = work / "traces"
    with SilentCollector() as collector:
        out = {"otlp_and_files": _demo(work, traces, collector, "--exporter", "otlp")}
        # The same directory, now holding the first run's files; this run writes none.
        out["otlp_only"] = _demo(work, traces, collector, OTEL_TRACES_EXPORTER="otlp", OTEL_METRICS_EXPORTER="otlp")
        assert collector.requests > 0, "the demo's OTLP exporters never reached the collector"
    return out


def test_end_of_run_leaves_a_silent_collector_behind_and_the_report_is_complete(runs) -> None:
    code, text, stderr = runs["otlp_and_files"]
    assert code == 0, f"exit {code}:\n{text}\n{stderr[-3000:]}"
    assert f"did not finish within {BUDGET_S:.1f}s" in stderr, f"the collector was not waited for:\n{stderr[-3000:]}"
    want = f"(ranks 0, 1 of 2, {STEPS} optimizer steps, diagnostics on {STEPS})"
    assert want in text, f"the report does not cover every step of both ranks ({want}):\n{text}"


def test_without_trace_files_the_demo_says_so_and_reports_no_earlier_run(runs) -> None:
    code, text, stderr = runs["otlp_only"]
    assert code == 0, f"exit {code}:\n{text}\n{stderr[-3000:]}"
    want = "no precision report: OTEL_TRACES_EXPORTER=otlp does not list trace_file"
    assert want in text and "set OTEL_TRACES_EXPORTER=otlp,trace_file" in text, (
        f"want {want!r} and how to keep them:\n{text}"
    )
    reported = [line for line in text.splitlines() if line.startswith("precision report:")]
    assert not reported, f"an earlier run's trace files were reported as this run's: {reported}"
