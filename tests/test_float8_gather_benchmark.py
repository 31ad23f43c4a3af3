"""``benchmarks.float8_gather``: the float8 compute copy against the bf16 one, bytes, memory, time."""

from __future__ import annotations

import json
import math
from pathlib import Path

from tests.benchmark_runs import run_benchmark
from tests.fsdp.float8_models import require_torchao


def test_float8_gathers_fewer_bytes_and_the_figures_are_written(tmp_path: Path) -> None:
    require_torchao()
    out = tmp_path / "float8.json"
    args = ["--layers", "2", "--width", "64", "--steps", "2", "--world-size", "2", "--json", str(out)]
    run = run_benchmark("benchmarks.float8_gather", *args)
    assert run.returncode == 0, f"exited {run.returncode}:\n{run.stderr[-3000:]}"
    document = json.loads(out.read_text(encoding="utf-8"))
    bf16, float8 = document["bf16"], document["float8"]
    # Each weight's gather moves 1 byte per element instead of 2 (the biases stay bf16 in both),
    # twice a step: forward's gather and backward's re-gather (the units reshard after forward).
    weights = 2 * (2 * 64 * 64)
    assert bf16["gathered_bytes"] - float8["gathered_bytes"] == weights, (
        f"want {weights} bytes fewer gathered with the float8 copy; bf16 {bf16['gathered_bytes']}, "
        f"float8 {float8['gathered_bytes']}"
    )
    for name in ("ratio_gathered", "ratio_peak", "ratio_step"):
        assert math.isfinite(document[name]) and document[name] > 0, f"{name}: {document[name]}"
    assert "float8 / bf16: gathered" in run.stdout, run.stdout


def test_a_width_float8_cannot_multiply_is_refused() -> None:
    run = run_benchmark("benchmarks.float8_gather", "--width", "100", timeout=120)
    assert run.returncode == 2, f"--width 100: exit {run.returncode}"
    assert "--width 100: expected a multiple of 16" in run.stderr, run.stderr
