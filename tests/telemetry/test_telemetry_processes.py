"""Behaviour only a fresh interpreter shows: what telemetry-off imports, a training script with its
own ``telemetry.py`` beside it, and a forked child's exit."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# One gloo rank, a model sharded by fully_shard, three adapted AdamW steps; prints the loss trend.
TRAIN_SCRIPT = """
import os, sys, tempfile
import torch, torch.distributed as dist

dist.init_process_group("gloo", init_method="file://" + os.path.join(tempfile.mkdtemp(), "init"), rank=0, world_size=1)
from fsdp_patch import fully_shard
from fsdp_patch.optimizer import fully_shard_optimizer

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)).bfloat16()
fully_shard(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
fully_shard_optimizer(optimizer)
x, y = torch.randn(32, 8).bfloat16(), torch.randn(32, 1).bfloat16()
losses = []
for _ in range(3):
    loss = torch.nn.functional.mse_loss(model(x).float(), y.float())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    losses.append(loss.item())
import telemetry  # the script's own module, untouched by fsdp_patch
print("own telemetry:", telemetry.WHO)
print("trained", losses[-1] < losses[0])
dist.destroy_process_group()
"""


# An SGD optimizer over one plain parameter, adapted through the public API, and one step.
ONE_ADAPTED_STEP = """
    import os, sys
    import torch
    from fsdp_patch.optimizer import fully_shard_optimizer

    param = torch.nn.Parameter(torch.ones(4))
    param.grad = torch.ones(4)
    optimizer = torch.optim.SGD([param], lr=0.1)
    fully_shard_optimizer(optimizer)
    optimizer.step()
"""


def run_python(code: str, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("FSDP_PATCH_", "OTEL_"))}
    environment.update(env)
    environment["PYTHONPATH"] = str(REPO) + os.pathsep + environment.get("PYTHONPATH", "")
    script = cwd / "script.py"
    script.write_text(textwrap.dedent(code))
    return subprocess.run(
        [sys.executable, str(script)],
        cwd=cwd,
        env=environment,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


@pytest.mark.parametrize("telemetry_on", ["0", "1"])
def test_script_beside_its_own_telemetry_py_trains(tmp_path, telemetry_on):
    # A common file name in training repositories: importable as `telemetry` from the script's folder.
    (tmp_path / "telemetry.py").write_text(
        'WHO = "the training repository\'s"\n'
        "def telemetry_enabled():\n    raise AssertionError('fsdp_patch imported the script\\'s telemetry.py')\n"
    )
    result = run_python(
        TRAIN_SCRIPT, tmp_path, FSDP_PATCH_TELEMETRY=telemetry_on, FSDP_PATCH_TRACE_DIR=str(tmp_path / "traces"),
        FSDP_PATCH_SUMMARY="none",
    )  # fmt: skip
    assert result.returncode == 0, f"want exit 0, got {result.returncode}:\n{result.stderr[-3000:]}"
    lines = result.stdout.strip().splitlines()
    assert lines == ["own telemetry: the training repository's", "trained True"], result.stdout
    wrote_traces = (tmp_path / "traces" / "rank0.trace.json").exists()
    assert wrote_traces is (telemetry_on == "1"), f"telemetry {telemetry_on}: trace file written {wrote_traces}"


def test_telemetry_unset_imports_no_telemetry_module(tmp_path):
    code = (
        ONE_ADAPTED_STEP
        + """
    print(sorted(m for m in sys.modules if m.startswith("fsdp_patch.telemetry")))
    print(sorted(m for m in sys.modules if m.split(".")[0] == "opentelemetry"))
    """
    )
    result = run_python(code, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    telemetry_modules, otel_modules = result.stdout.strip().splitlines()
    assert telemetry_modules == "[]", f"telemetry unset imported {telemetry_modules}"
    assert otel_modules == "[]", f"telemetry off imported OpenTelemetry: {otel_modules}"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork is POSIX-only")
def test_forked_child_that_exits_prints_no_second_summary(tmp_path):
    code = (
        ONE_ADAPTED_STEP
        + """
    pid = os.fork()
    if pid == 0:
        sys.exit(0)  # runs the inherited atexit hooks, as a worker that returns normally does
    os.waitpid(pid, 0)
    print("parent done")
    """
    )
    result = run_python(code, tmp_path, FSDP_PATCH_TELEMETRY="1", FSDP_PATCH_TRACE_DIR=str(tmp_path / "traces"))
    assert result.returncode == 0, result.stderr[-3000:]
    summaries = result.stderr.count("fsdp_patch telemetry summary")
    assert summaries == 1, f"want the parent's summary only, got {summaries}:\n{result.stderr[-3000:]}"
