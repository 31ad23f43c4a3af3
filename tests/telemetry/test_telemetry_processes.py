"""Behaviour only a fresh interpreter shows: what telemetry-off imports, a training script with its
own ``telemetry.py`` beside it, and a forked child's exit."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.training_script import one_rank_training

REPO = Path(__file__).resolve().parents[2]

# Three adapted training steps beside a module of the script's own named telemetry; prints the loss trend.
TRAIN_SCRIPT = one_rank_training(
    3,
    after="import telemetry  # the script's own module, untouched by fsdp_patch\n"
    'print("own telemetry:", telemetry.WHO)\n'
    'print("trained", losses[-1] < losses[0])\n',
)


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
        TRAIN_SCRIPT,
        tmp_path,
        FSDP_PATCH_TELEMETRY=telemetry_on,
        FSDP_PATCH_TRACE_DIR=str(tmp_path / "traces"),
        FSDP_PATCH_SUMMARY="none",
    )
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
