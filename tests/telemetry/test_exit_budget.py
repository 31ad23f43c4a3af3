"""The end of a run waits for its exporters at most FSDP_PATCH_FLUSH_TIMEOUT in all, however many
exporters are stuck on a collector that never answers, and the local trace files are complete anyway.

A fresh interpreter trains a few adapted steps with OTLP spans and metrics sent to a collector that
takes requests and never answers (its exporters would wait an hour for it), beside the trace files
and the summary, calls ``destroy_process_group`` (telemetry flushes before it) and exits (telemetry
shuts down at exit). That the process exits at all shows the end of the run did not wait for the
collector; the waits telemetry allotted, which its warnings state, show they shared one budget.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.silent_collector import BOUND_S, EXPORTER_TIMEOUT_S, SilentCollector

REPO = Path(__file__).resolve().parents[2]
BUDGET_S = 2.0
STEPS = 3

SCRIPT = """
import os, tempfile
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
dist.destroy_process_group()
"""


def _run(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("FSDP_PATCH_", "OTEL_"))}
    environment.update(
        PYTHONPATH=str(REPO) + os.pathsep + environment.get("PYTHONPATH", ""),
        FSDP_PATCH_TELEMETRY="1",
        FSDP_PATCH_PRECISION_EVERY="1",
        FSDP_PATCH_TRACE_DIR=str(tmp_path / "traces"),
        FSDP_PATCH_FLUSH_TIMEOUT=str(BUDGET_S),
        OTEL_EXPORTER_OTLP_TIMEOUT=str(EXPORTER_TIMEOUT_S),
        **env,
    )
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT.format(steps=STEPS)))
    try:
        result = subprocess.run(
            [sys.executable, str(script)],
            cwd=tmp_path,
            env=environment,
            capture_output=True,
            text=True,
            timeout=BOUND_S * 3,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"the run did not exit: its end waited for the collector\n{exc.stderr}") from None
    assert result.returncode == 0, f"exit {result.returncode}:\n{result.stderr[-3000:]}"
    return result


_ALLOTTED = re.compile(r"fsdp_patch telemetry: (.+?) did not finish within ([0-9.]+)s")


def test_a_silent_collector_costs_the_flush_budget_once_and_the_trace_files_stay_complete(tmp_path: Path) -> None:
    with SilentCollector() as collector:
        result = _run(
            tmp_path,
            OTEL_TRACES_EXPORTER="otlp,trace_file",
            OTEL_METRICS_EXPORTER="otlp,summary",
            OTEL_EXPORTER_OTLP_ENDPOINT=collector.url,
        )
        assert collector.requests > 0, "the OTLP exporters never reached the collector"
    # Two OTLP exporters stuck, a flush before destroy_process_group and a shutdown at exit: one budget.
    allotted = _ALLOTTED.findall(result.stderr)
    flush = max((float(s) for what, s in allotted if "flush" in what), default=None)
    at_exit = max((float(s) for what, s in allotted if "shutdown" in what), default=None)
    assert flush == BUDGET_S, f"want the flush before destroy_process_group allotted {BUDGET_S} s, got {allotted}"
    assert at_exit is not None and flush + at_exit <= BUDGET_S + 0.05, (
        f"the flush and the shutdown at exit waited more than one {BUDGET_S} s budget together: {allotted}"
    )
    events = json.loads((tmp_path / "traces" / "rank0.trace.json").read_text())["traceEvents"]
    steps = sorted(e["args"]["fsdp.step"] for e in events if e.get("name") == "fsdp.optimizer.step")
    assert steps == list(range(1, STEPS + 1)), f"the trace file holds steps {steps}: the stuck exporter held it back"
    assert (tmp_path / "traces" / "rank0.jaeger.json").exists(), "no Jaeger file: the trace file's shutdown was cut"
    assert "fsdp_patch telemetry summary" in result.stderr, "the summary was not printed"


def test_a_reachable_setup_exits_without_waiting(tmp_path: Path) -> None:
    result = _run(tmp_path, OTEL_TRACES_EXPORTER="trace_file", OTEL_METRICS_EXPORTER="summary")
    allotted = _ALLOTTED.findall(result.stderr)
    assert allotted == [], f"with nothing to wait for, the end of the run ran out of its budget: {allotted}"
    assert "fsdp_patch telemetry summary" in result.stderr, "the summary was not printed"
