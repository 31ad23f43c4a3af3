"""``fsdp-patch demo`` against an unreachable OTLP collector (a closed port), on 2 ranks.

With ``--exporter otlp`` (OTLP beside the trace files) the end of the run waits for the collector
at most FSDP_PATCH_FLUSH_TIMEOUT once, both ranks side by side, and the report still covers every
step. With ``OTEL_TRACES_EXPORTER=otlp`` alone no trace files are written: the demo says so and how
to keep them, and does not report the trace files an earlier run left in the directory.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
BUDGET_S = 2.0
STEPS = 3


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _demo(cwd: Path, trace_dir: Path, *args: str, **env: str) -> tuple[int, list[tuple[float, str]], str]:
    """Run the demo; its exit code, its stdout lines with the time each arrived, and its stderr."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("FSDP_PATCH_", "OTEL_"))}
    environment.update(
        PYTHONPATH=str(REPO) + os.pathsep + environment.get("PYTHONPATH", ""),
        OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{_closed_port()}",
        FSDP_PATCH_FLUSH_TIMEOUT=str(BUDGET_S),
        **env,
    )
    command = [sys.executable, "-m", "fsdp_patch", "demo", "--steps", str(STEPS), "--precision-every", "1",
               "--progress", "lines", "--trace-dir", str(trace_dir), *args]  # fmt: skip
    process = subprocess.Popen(command, cwd=cwd, env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[tuple[float, str]] = []
    errors: list[str] = []
    readers = [
        threading.Thread(target=lambda: [lines.append((time.monotonic(), line)) for line in process.stdout], daemon=True),
        threading.Thread(target=lambda: errors.extend(process.stderr), daemon=True),
    ]
    for reader in readers:
        reader.start()
    code = process.wait(timeout=600)
    for reader in readers:
        reader.join(timeout=30)
    return code, lines, "".join(errors)


def _arrived(lines: list[tuple[float, str]], prefix: str) -> float:
    times = [t for t, line in lines if line.startswith(prefix)]
    assert times, f"no line starting with {prefix!r} in:\n{''.join(line for _, line in lines)}"
    return times[0]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[int, list[tuple[float, str]], str]]:
    work = tmp_path_factory.mktemp("demo_collector")
    traces = work / "traces"
    out = {"otlp_and_files": _demo(work, traces, "--exporter", "otlp")}
    # The same directory, now holding the first run's files; this run writes none.
    out["otlp_only"] = _demo(work, traces, OTEL_TRACES_EXPORTER="otlp", OTEL_METRICS_EXPORTER="otlp")
    return out


def test_end_of_run_waits_for_a_dead_collector_once_and_the_report_is_complete(runs) -> None:
    code, lines, stderr = runs["otlp_and_files"]
    text = "".join(line for _, line in lines)
    assert code == 0, f"exit {code}:\n{text}\n{stderr[-3000:]}"
    # Rank 0's last step line, then telemetry's shutdown on both ranks side by side, then "done".
    took = _arrived(lines, "done:") - _arrived(lines, f"step {STEPS}/{STEPS}")
    assert took <= BUDGET_S + 1.0, f"the end of the run took {took:.2f} s, want at most the {BUDGET_S} s budget + 1 s"
    assert "did not finish within" in stderr, f"the collector was not waited for:\n{stderr[-3000:]}"
    want = f"(ranks 0, 1 of 2, {STEPS} optimizer steps, diagnostics on {STEPS})"
    assert want in text, f"the report does not cover every step of both ranks ({want}):\n{text}"


def test_without_trace_files_the_demo_says_so_and_reports_no_earlier_run(runs) -> None:
    code, lines, stderr = runs["otlp_only"]
    text = "".join(line for _, line in lines)
    assert code == 0, f"exit {code}:\n{text}\n{stderr[-3000:]}"
    want = "no precision report: OTEL_TRACES_EXPORTER=otlp does not list trace_file"
    assert want in text and "set OTEL_TRACES_EXPORTER=otlp,trace_file" in text, f"want {want!r} and how to keep them:\n{text}"
    reported = [line for _, line in lines if line.startswith("precision report:")]
    assert not reported, f"an earlier run's trace files were reported as this run's: {reported}"
    took = _arrived(lines, "done:") - _arrived(lines, f"step {STEPS}/{STEPS}")
    assert took <= BUDGET_S + 1.0, f"the end of the run took {took:.2f} s, want at most the {BUDGET_S} s budget + 1 s"
