"""``benchmarks.float8_watch_cost``: what the float8 cast watch costs a diagnosed step, and at the
default interval; four models paired, the figures written."""

from __future__ import annotations

import json
import math
from pathlib import Path

from tests.benchmark_runs import run_benchmark
from tests.fsdp.float8_models import require_torchao


def test_the_watch_s_cost_is_measured_and_written(tmp_path: Path) -> None:
    require_torchao()
    out = tmp_path / "watch.json"
    args = ["--layers", "2", "--width", "64", "--rounds", "2", "--json", str(out)]
    run = run_benchmark("benchmarks.float8_watch_cost", *args)
    assert run.returncode == 0, f"exited {run.returncode}:\n{run.stderr[-3000:]}"
    document = json.loads(out.read_text(encoding="utf-8"))
    for setting in ("off", "on", "diagnosed", "diagnosed_no_watch"):
        value = document[f"step_s_{setting}"]
        assert math.isfinite(value) and value > 0, f"step_s_{setting}: {value}"
    for name in ("ratio_on_off", "ratio_diagnosed_off", "ratio_diagnosed_no_watch_off", "ratio_default_interval"):
        assert math.isfinite(document[name]) and document[name] > 0, f"{name}: {document[name]}"
    assert document["ratio_default_interval"] >= 1.0, f"a cost spread over 100 steps: {document}"
    assert (document["benchmark"], document["float8_modules"]) == ("float8_watch_cost", 2), document
    assert "at the default interval (100)" in run.stdout, run.stdout


def test_more_rounds_than_the_undiagnosed_stretch_holds_are_refused() -> None:
    run = run_benchmark("benchmarks.float8_watch_cost", "--rounds", "60", timeout=120)
    assert run.returncode == 2 and "--rounds 60: at most 46" in run.stderr, (run.returncode, run.stderr[-2000:])
