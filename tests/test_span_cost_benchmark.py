"""``benchmarks.span_cost``: a step's spans recorded in plain Python against the SDK's, paired."""

from __future__ import annotations

import json
import math
from pathlib import Path

from tests.benchmark_runs import run_benchmark


def test_span_cost_measures_both_shardings_and_writes_its_figures(tmp_path: Path) -> None:
    out = tmp_path / "spans.json"
    run = run_benchmark("benchmarks.span_cost", "--repeats", "1", "--json", str(out))
    assert run.returncode == 0, f"exited {run.returncode}:\n{run.stderr[-3000:]}"
    document = json.loads(out.read_text(encoding="utf-8"))
    assert document["benchmark"] == "span_cost" and document["repeats"] == 1, document
    for kind in ("fully_shard", "fsdp2"):
        got = document[kind]
        assert (got["tensors"], got["rounds"]) == (6, 46), f"{kind}: want 6 tensors and 46 rounds, got {got}"
        figures = (got["step_s_off"], got["added_s_recorded"], got["added_s_sdk"], got["saved_s"])
        assert all(math.isfinite(v) for v in figures) and got["step_s_off"] > 0, f"{kind}: {got}"
        assert f"{kind}, 6 tensors, 46 paired rounds" in run.stdout, run.stdout


def test_bad_arguments_are_refused_naming_what_is_expected() -> None:
    run = run_benchmark("benchmarks.span_cost", "--repeats", "0", timeout=120)
    assert run.returncode == 2, f"--repeats 0: exit {run.returncode}"
    assert "--repeats 0, --layers 0: expected at least 1 repeat and 0 blocks" in run.stderr, run.stderr
