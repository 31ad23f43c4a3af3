"""scripts/gpu_check.sh keeps working between GPU sessions: CI runs it, here usually without CUDA.

Without CUDA the script must still pass, say that it skips the CUDA parts, have the CUDA tests
skip with their reason, run the demo under torchrun (gloo) with a checkpoint and a resume, skip
the GPU benchmarks, and leave its log under $OUT (where the device tool collects files). With
CUDA it must pass and leave each benchmark's JSON, named after the GPU, in both places.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]


def test_gpu_check_script_runs(tmp_path: Path) -> None:
    out, results = tmp_path / "out", tmp_path / "results"
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(out), "GPU_CHECK_RESULTS_DIR": str(results)}
    run = subprocess.run(
        ["bash", "scripts/gpu_check.sh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    log = run.stdout + run.stderr
    assert run.returncode == 0, f"gpu_check.sh exited {run.returncode}:\n{log[-4000:]}"
    assert (out / "gpu_check.log").read_text() == run.stdout, "the log under $OUT is not the script's output"
    assert "gpu_check: all parts passed" in log, log[-2000:]
    if torch.cuda.is_available():
        jsons = sorted(results.glob("suite-*.json"))
        assert len(jsons) == 6, f"want one benchmark JSON per suite case in {results}, got {jsons}: {log[-2000:]}"
        for path in jsons:
            assert (out / path.name).exists(), f"{path.name} was not copied to $OUT"
            assert json.loads(path.read_text())["timer"] == "cuda_events", f"{path.name}: not timed with CUDA events"
        return
    assert "no CUDA device: running what runs without one, skipping the CUDA parts" in log, log[:2000]
    assert "3 skipped" in log and "SKIPPED" in log and "scripts/gpu_check.sh runs the CUDA tests on a GPU machine" in log, log
    for part, status in (("2 demo, torchrun", "PASS"), ("2 demo, torchrun --resume", "PASS"), ("3 GPU benchmarks", "SKIP")):
        assert re.search(rf"^{re.escape(part)} +{status}", log, re.MULTILINE), f"summary lacks '{part} {status}':\n{log[-2000:]}"
    assert "resuming from" in log and "overall: healthy" in log, log[-4000:]
    assert not results.exists(), f"a CPU run wrote GPU results: {list(results.iterdir())}"
