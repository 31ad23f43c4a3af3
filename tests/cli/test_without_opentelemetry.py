"""Without OpenTelemetry installed: the demo trains with telemetry off and says why in one line;
``fully_shard_optimizer`` with telemetry asked for refuses clearly and changes nothing; ``fsdp-patch
trace`` converts trace files as it does with it.

The interpreter of these runs has OpenTelemetry hidden the way a machine without it would have:
a folder first on ``PYTHONPATH`` whose ``opentelemetry`` package cannot be imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
WHY = (
    "OpenTelemetry is not installed (opentelemetry-api and opentelemetry-sdk missing; "
    "installing fsdp-patch with its dependencies brings them)"
)


@pytest.fixture
def env_without_opentelemetry(tmp_path: Path) -> dict[str, str]:
    hidden = tmp_path / "hide"
    (hidden / "opentelemetry").mkdir(parents=True)
    (hidden / "opentelemetry" / "__init__.py").write_text("raise ImportError(\"No module named 'opentelemetry'\")\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FSDP_PATCH_", "OTEL_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(hidden), str(REPO)])
    probe = subprocess.run(
        [sys.executable, "-c", "import opentelemetry.sdk"], env=env, capture_output=True, text=True, check=False
    )
    assert probe.returncode != 0, "OpenTelemetry is still importable with the hiding folder first on the path"
    return env


def test_demo_runs_with_telemetry_off_and_says_why(env_without_opentelemetry: dict[str, str], tmp_path: Path) -> None:
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "fsdp_patch",
            "demo",
            "--steps",
            "2",
            "--world-size",
            "1",
            "--progress",
            "lines",
            "--trace-dir",
            str(tmp_path / "traces"),
        ],
        cwd=tmp_path,
        env=env_without_opentelemetry,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    out = run.stdout + run.stderr
    assert run.returncode == 0, f"want exit 0, got {run.returncode}:\n{out[-3000:]}"
    lines = run.stdout.splitlines()
    said = [line for line in lines if "telemetry off" in line]
    assert said == [f"fsdp-patch demo: telemetry off: {WHY}"], (
        f"want the one line saying why, got {said}:\n{out[-3000:]}"
    )
    assert lines[0] == said[0], f"want the reason first, got first line {lines[0]!r}"
    assert "done: 2 steps" in run.stdout and lines[-1] == "no precision report: telemetry is off", out[-2000:]
    assert "Traceback" not in out, out[-3000:]
    assert not (tmp_path / "traces").exists(), "telemetry off wrote trace files"


ADAPT = """
import torch
from fsdp_patch.adapter import adaptation_of
from fsdp_patch.optimizer import fully_shard_optimizer

param = torch.nn.Parameter(torch.ones(4))
param.grad = torch.ones(4)
optimizer = torch.optim.SGD([param], lr=0.5)
try:
    fully_shard_optimizer(optimizer)
except ModuleNotFoundError as exc:
    print("refused:", exc)
optimizer.step()
print("adapted:", adaptation_of(optimizer) is not None, "stepped:", param.tolist())
"""


def test_fully_shard_optimizer_with_telemetry_on_refuses_and_changes_nothing(
    env_without_opentelemetry: dict[str, str],
) -> None:
    env = {**env_without_opentelemetry, "FSDP_PATCH_TELEMETRY": "1"}
    run = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(ADAPT)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, f"exit {run.returncode}:\n{run.stderr[-3000:]}"
    want = [
        f"refused: fsdp_patch telemetry is on (FSDP_PATCH_TELEMETRY=1 or instrumented), but {WHY}; "
        "set FSDP_PATCH_TELEMETRY=0 to train without it",
        "adapted: False stepped: [0.5, 0.5, 0.5, 0.5]",
    ]
    assert run.stdout.splitlines() == want, f"want {want}, got {run.stdout.splitlines()}\n{run.stderr[-2000:]}"


# One span of one rank, as the trace-file exporter writes it.
ONE_SPAN = {
    "traceEvents": [
        {"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "rank 0", "otel.resource": {}}},
        {
            "name": "fsdp.optimizer.step",
            "ph": "X",
            "ts": 1.0,
            "dur": 2.0,
            "pid": 0,
            "tid": 1,
            "args": {"trace_id": "0" * 31 + "1", "span_id": "0" * 15 + "2"},
        },
    ]
}


@pytest.mark.parametrize(("tool", "want"), [("merge", "wrote 2 events"), ("jaeger", "wrote 1 traces")])
def test_trace_tools_run_without_opentelemetry(
    env_without_opentelemetry: dict[str, str], tmp_path: Path, tool: str, want: str
) -> None:
    (tmp_path / "rank0.trace.json").write_text(json.dumps(ONE_SPAN))
    output = tmp_path / f"out.{tool}.json"
    run = subprocess.run(
        [sys.executable, "-m", "fsdp_patch", "trace", tool, str(output), str(tmp_path)],
        env=env_without_opentelemetry,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    got = (run.returncode, run.stdout)
    assert got == (0, f"{want} to {output}\n"), f"fsdp-patch trace {tool}: got {got}:\n{run.stderr[-3000:]}"
    assert json.loads(output.read_text()), f"fsdp-patch trace {tool} wrote an empty document"
