"""The end of a run waits for its exporters at most FSDP_PATCH_FLUSH_TIMEOUT in all, however many
exporters are stuck on an unreachable collector, and the local trace files are complete anyway.

A fresh interpreter trains a few adapted steps with OTLP spans and metrics sent to a closed port
beside the trace files and the summary, calls ``destroy_process_group`` (telemetry flushes before
it) and exits (telemetry shuts down at exit). An ``atexit`` hook registered before telemetry's
runs after it, so the time from the last step to that hook is what telemetry's exit took.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BUDGET_S = 2.0
STEPS = 3

SCRIPT = """
import atexit, os, sys, tempfile, time
atexit.register(lambda: print("EXIT_WORK_DONE", time.monotonic(), flush=True))  # runs after telemetry's hook
import torch, torch.distributed as dist

dist.init_process_group("gloo", init_method="file://" + os.path.join(tempfile.mkdtemp(), "init"), rank=0, world_size=1)
from fsdp_patch import fully_shard
from fsdp_patch.optimizer import fully_shard_optimizer

model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 1)).bfloat16()
fully_shard(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
fully_shard_optimizer(optimizer)
x = torch.randn(4, 8).bfloat16()
for _ in range({steps}):
    model(x).float().sum().backward()
    optimizer.step()
    optimizer.zero_grad()
print("LAST_STEP", time.monotonic(), flush=True)
dist.destroy_process_group()
"""


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # released on return: nothing listens there


def _run(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess[str], float]:
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("FSDP_PATCH_", "OTEL_"))}
    environment.update(
        PYTHONPATH=str(REPO) + os.pathsep + environment.get("PYTHONPATH", ""),
        FSDP_PATCH_TELEMETRY="1",
        FSDP_PATCH_PRECISION_EVERY="1",
        FSDP_PATCH_TRACE_DIR=str(tmp_path / "traces"),
        FSDP_PATCH_FLUSH_TIMEOUT=str(BUDGET_S),
        **env,
    )
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT.format(steps=STEPS)))
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=environment, capture_output=True,
                            text=True, timeout=300, check=False)  # fmt: skip
    assert result.returncode == 0, f"exit {result.returncode}:\n{result.stderr[-3000:]}"
    marks = {line.split()[0]: float(line.split()[1]) for line in result.stdout.splitlines() if line.split()[:1]}
    return result, marks["EXIT_WORK_DONE"] - marks["LAST_STEP"]


def test_a_dead_collector_costs_the_flush_budget_once_and_the_trace_files_stay_complete(tmp_path: Path) -> None:
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    result, took = _run(
        tmp_path,
        OTEL_TRACES_EXPORTER="otlp,trace_file",
        OTEL_METRICS_EXPORTER="otlp,summary",
        OTEL_EXPORTER_OTLP_ENDPOINT=endpoint,
    )
    # Two OTLP exporters stuck, a flush before destroy_process_group and a shutdown at exit: one budget.
    assert took <= BUDGET_S + 1.0, f"telemetry's exit took {took:.2f} s, want at most the {BUDGET_S} s budget + 1 s"
    assert "did not finish within" in result.stderr, f"the collector was not waited for at all:\n{result.stderr[-3000:]}"
    events = json.loads((tmp_path / "traces" / "rank0.trace.json").read_text())["traceEvents"]
    steps = sorted(e["args"]["fsdp.step"] for e in events if e.get("name") == "fsdp.optimizer.step")
    assert steps == list(range(1, STEPS + 1)), f"the trace file holds steps {steps}: the stuck exporter held it back"
    assert (tmp_path / "traces" / "rank0.jaeger.json").exists(), "no Jaeger file: the trace file's shutdown was cut"
    assert "fsdp_patch telemetry summary" in result.stderr, "the summary was not printed"


def test_a_reachable_setup_exits_without_waiting(tmp_path: Path) -> None:
    result, took = _run(tmp_path, OTEL_TRACES_EXPORTER="trace_file", OTEL_METRICS_EXPORTER="summary")
    assert took < BUDGET_S, f"telemetry's exit took {took:.2f} s with nothing to wait for (budget {BUDGET_S} s)"
    assert "did not finish within" not in result.stderr, result.stderr[-3000:]
