"""The tables hook: a results-table marker becomes the table of its JSON file, with the machine it
was measured on, and anything it cannot render fails naming the file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.docs.docs_build import REPO, load_hook

hook = load_hook()

SUITE = {
    "benchmark": "suite",
    "device": "cpu-x86_64-2cores",
    "machine": {"platform": "Linux-x86_64", "processor": "", "cpus": 2},
    "python": "3.11.7",
    "torch": "2.13.0+cpu",
    "timer": "perf_counter",
    "quick": False,
    "time": "2026-01-02T03:04:05Z",
    "command": "python -m benchmarks --case 1",
    "cases": {
        "1 floor": {
            "rows": [
                {
                    "case": "1 floor",
                    "measure": "adapter work / flat-copy floor",
                    "value": 1.04412,
                    "unit": "x",
                    "target": "<= 1.3",
                    "met": True,
                    "note": "18.1 vs 17.9 ms",
                },
                {
                    "case": "1 floor",
                    "measure": "slope",
                    "value": 7.5,
                    "unit": "us",
                    "target": "<= 3",
                    "met": False,
                    "note": "a | in a note",
                },
            ],
            "raw": {},
        }
    },
}


def _results(tmp_path: Path, name: str, document: object) -> Path:
    (tmp_path / name).write_text(json.dumps(document), encoding="utf-8")
    return tmp_path


def test_a_marker_becomes_the_table_of_its_file(tmp_path: Path) -> None:
    results = _results(tmp_path, "suite-small.json", SUITE)
    page = "Before.\n\n<!-- results-table: suite-small.json -->\n\nAfter.\n"
    out = hook.render_markers(page, results, "page.md")
    want_rows = [
        "| case | measure | value | target | met | note |",
        "| 1 floor | adapter work / flat-copy floor | 1.044x | <= 1.3 | yes | 18.1 vs 17.9 ms |",
        "| 1 floor | slope | 7.50 us | <= 3 | **no** | a \\| in a note |",
    ]
    for row in want_rows:
        assert row in out, f"expected the row {row!r} in the rendered page, got:\n{out}"
    for fact in ("`cpu-x86_64-2cores`", "2 CPUs", "torch 2.13.0+cpu", "`python -m benchmarks --case 1`"):
        assert fact in out, f"expected the caption to state {fact!r}, got:\n{out}"
    assert "benchmarks/results/suite-small.json" in out, f"expected the caption to name the source, got:\n{out}"
    assert out.startswith("Before.") and out.rstrip().endswith("After."), f"expected the text around kept, got:\n{out}"
    assert "results-table" not in out, f"expected the marker replaced, got:\n{out}"


def test_a_missing_file_raises_naming_it(tmp_path: Path) -> None:
    with pytest.raises(hook.ResultsTableError) as raised:
        hook.render_markers("<!-- results-table: gone.json -->\n", tmp_path, "benchmarks.md")
    message = str(raised.value)
    assert "benchmarks/results/gone.json" in message and "benchmarks.md" in message, (
        f"expected the error to name the file and the page, got {message!r}"
    )


def test_a_benchmark_without_a_table_raises_naming_the_file(tmp_path: Path) -> None:
    results = _results(tmp_path, "odd.json", {"benchmark": "something_new", "device": "cpu"})
    with pytest.raises(hook.ResultsTableError) as raised:
        hook.render_markers("<!-- results-table: odd.json -->\n", results, "page.md")
    message = str(raised.value)
    assert "odd.json" in message and "something_new" in message, (
        f"expected the error to name the file and its benchmark, got {message!r}"
    )


def test_a_file_without_what_its_table_needs_raises_naming_it(tmp_path: Path) -> None:
    results = _results(tmp_path, "thin.json", {"benchmark": "suite", "device": "cpu"})
    with pytest.raises(hook.ResultsTableError) as raised:
        hook.render_markers("<!-- results-table: thin.json -->\n", results, "page.md")
    assert "thin.json" in str(raised.value), f"expected the error to name thin.json, got {str(raised.value)!r}"


@pytest.mark.parametrize(
    "line",
    [
        "<!-- results-table suite.json -->",
        "<!-- results-tables: suite.json -->",
        "  <!-- results-table: suite.json -->",
    ],
)
def test_a_malformed_marker_raises(tmp_path: Path, line: str) -> None:
    with pytest.raises(hook.ResultsTableError) as raised:
        hook.render_markers(f"text\n{line}\n", tmp_path, "page.md")
    assert line.strip() in str(raised.value), f"expected the error to quote {line.strip()!r}, got {str(raised.value)!r}"


def test_every_recorded_result_renders() -> None:
    # A benchmark that changes its JSON's shape fails here, by name, before the docs build does.
    results = REPO / "benchmarks" / "results"
    for path in sorted(results.glob("*.json")):
        table = hook.render(path.name, results)
        assert table.startswith("| "), f"expected a table for {path.name}, got:\n{table[:300]}"
        assert "Measured on" in table, f"expected {path.name}'s table to state its machine, got:\n{table[-300:]}"


def test_a_host_cost_record_renders_each_size_and_the_fit(tmp_path: Path) -> None:
    size = {"layers": 0, "tensors": 6, "step_s_off": 0.004, "ratio_on_off": 1.04, "added_s": 2e-4}
    document = {
        "benchmark": "host_cost",
        "device": "cpu-x86_64-2cores",
        "torch": "2.13.0+cpu",
        "rounds": 40,
        "width": 16,
        "fully_shard": {
            "sizes": [
                {**size, "ratio_diagnosed_off": 1.2},
                {**size, "layers": 1, "tensors": 18, "added_s": 2.2e-4, "ratio_diagnosed_off": 1.1},
            ],
            "added_fixed_s": 1.5e-4,
            "added_per_tensor_s": 1e-6,
        },
    }
    out = hook.render_markers("<!-- results-table: host.json -->\n", _results(tmp_path, "host.json", document))
    for row in (
        "| `fully_shard` | 6 | 4.00 ms | 1.040x | 200 us | 1.200x |",
        "| `fully_shard` | 18 | 4.00 ms | 1.040x | 220 us | 1.100x |",
        "| `fully_shard` | fit |  |  | 150 us + 1.00 us per tensor |  |",
    ):
        assert row in out, f"expected the row {row!r}, got:\n{out}"


def test_a_host_cost_record_of_one_gpu_size_shows_its_synchronizations_and_no_fit(tmp_path: Path) -> None:
    """The 1b preset on a GPU: one size (no fit to draw), its parameters and profiled CUDA
    synchronizations on and off."""
    size = {"layers": 18, "tensors": 222, "params": 1_038_000_000, "step_s_off": 0.1, "ratio_on_off": 1.004}
    document = {
        "benchmark": "host_cost",
        "device": "NVIDIA H100",
        "torch": "2.11.0",
        "rounds": 10,
        "width": 2048,
        "compute_dtype": "torch.bfloat16",
        "fully_shard": {
            "sizes": [{**size, "added_s": 4e-4, "ratio_diagnosed_off": 1.25, "syncs_on": 1, "syncs_off": 1}],
            "added_fixed_s": 4e-4,
            "added_per_tensor_s": 0.0,
        },
    }
    out = hook.render_markers("<!-- results-table: gpu.json -->\n", _results(tmp_path, "gpu.json", document))
    row = "| `fully_shard` | 222 (1.04B parameters) | 100 ms | 1.004x | 400 us | 1.250x | 1 / 1 |"
    assert row in out, f"expected the row {row!r}, got:\n{out}"
    assert "| fit |" not in out, f"one size: want no fit row, got:\n{out}"
    assert "width 2048, bfloat16 compute" in out, f"want the width and compute dtype said, got:\n{out}"
