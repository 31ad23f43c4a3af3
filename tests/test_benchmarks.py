"""The benchmark suite runs end to end (small sizes) and writes what docs/benchmarks.md renders.

No time is asserted: the figures depend on the machine. What must hold is that every case runs, fills its rows (a finite value, a verdict wherever there is a target) and lands in
the JSON document with its raw samples, and that bad arguments are refused with a clear message.
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest
import torch

from tests.benchmark_runs import run_benchmark

CASES = ["1 floor", "2 step", "3 scaling", "4 attachments", "5 telemetry", "6 end_to_end", "7 hsdp"]


def _suite(*args: str) -> subprocess.CompletedProcess[str]:
    return run_benchmark("benchmarks", *args)


@pytest.mark.long
def test_every_case_runs_and_lands_in_the_table_and_the_json(tmp_path: Path) -> None:
    out = tmp_path / "suite.json"
    run = _suite("--quick", "--json", str(out))
    assert run.returncode == 0, f"python -m benchmarks --quick exited {run.returncode}:\n{run.stderr[-3000:]}"
    document = json.loads(out.read_text())
    assert sorted(document["cases"]) == CASES, f"cases in the JSON: got {sorted(document['cases'])}, want {CASES}"
    assert document["timer"] == "perf_counter" and document["quick"] is True, document
    for name, case in document["cases"].items():
        assert case["rows"], f"{name}: no rows"
        assert case["raw"], f"{name}: no raw figures"
        for row in case["rows"]:
            assert math.isfinite(row["value"]), f"{name}: {row['measure']} is {row['value']}"
            want_verdict = bool(row["target"])
            assert (row["met"] is not None) == want_verdict, (
                f"{name}: {row['measure']}: target {row['target']!r}, met {row['met']!r}"
            )
            assert f"| {row['case']} | {row['measure']} |" in run.stdout, (
                f"{row['measure']} missing from the printed table"
            )
    measures = [row["measure"] for case in document["cases"].values() for row in case["rows"]]
    for needle in (
        "adapted step / bare step",
        "per-tensor cast loop / adapter",
        "per parameter",
        "adapter (telemetry off) / no adapter",
        "telemetry on (diagnostics off) / off",
        "diagnostics every step",
        "attribution / whole-model diagnostics",
        "ours / FSDP2 step time, 1 microbatch",
        "ours / FSDP2 step time, 4 microbatches",
        "peak tensor bytes",
        "between steps tensor bytes",
        "ours / FSDP2 step time, 2 x 2 mesh, 1 mb",
        "losses bitwise equal to FSDP2, runs x ranks (both lifetimes)",
    ):
        assert any(needle in m for m in measures), f"no row measures {needle!r}: {measures}"
    end_to_end = document["cases"]["6 end_to_end"]["raw"]
    assert end_to_end["world_size"] == 2, f"end to end ran on {end_to_end['world_size']} ranks, want 2"


def test_bad_arguments_are_refused_naming_what_is_expected() -> None:
    run = _suite("--case", "8")
    assert run.returncode == 2, f"unknown case: exit {run.returncode}"
    assert "unknown case '8'" in run.stderr and "7 (hsdp)" in run.stderr, run.stderr
    if not torch.cuda.is_available():
        run = _suite("--device", "cuda", "--case", "1")
        assert run.returncode == 2, f"--device cuda without CUDA: exit {run.returncode}"
        assert "torch sees no CUDA device" in run.stderr, run.stderr


def test_telemetry_overhead_refuses_settings_it_cannot_pair() -> None:
    """Case 5's settings from the command line: ratios are against ``off``, so it comes first."""
    run = run_benchmark("benchmarks.telemetry_overhead", "--settings", "on,attribution", timeout=120)
    assert run.returncode == 2, f"--settings on,attribution: exit {run.returncode}\n{run.stderr[-2000:]}"
    want = "want off first, then on and any of off, on, diagnostics, attribution"
    assert want in run.stderr, run.stderr


def test_origin_checks_own_time_counts_outermost_calls_once_and_restores_exactly() -> None:
    """``benchmarks.origin_checks``' own-time timer: a check made inside a timed hook is counted
    with the hook, not again; every entry point is the original again afterwards."""
    from fsdp_patch.telemetry import semconv
    from fsdp_patch.telemetry.diagnostics.probes import ProbeLog

    from benchmarks.origin_checks import _OwnTime

    originals = {(owner, name): owner.__dict__[name] for owner, name in _OwnTime.ENTRY_POINTS}
    calls: list[str] = []
    with _OwnTime() as own:
        log = ProbeLog()
        timed_check = ProbeLog.check
        assert timed_check is not originals[(ProbeLog, "check")], "ProbeLog.check is not timed inside the timer"
        nested = own._timed(lambda: (calls.append("outer"), log.check(semconv.ORIGIN_LOSS, "loss", torch.ones(3))))
        nested()
        got = (calls, len(log), own._depth, own.seconds > 0.0)
    assert got == (["outer"], 1, 0, True), f"calls, checks logged, depth after, time counted: {got}"
    restored = {key: key[0].__dict__[key[1]] is original for key, original in originals.items()}
    assert all(restored.values()), f"entry points not restored: {[k[1] for k, ok in restored.items() if not ok]}"


def test_origin_checks_host_bound_runs_escalated_to_the_end_and_writes_its_figures(tmp_path: Path) -> None:
    """``benchmarks.origin_checks --host-bound`` on 1 rank: both kinds measured (finite ratios, the
    checks' own time), the escalated model still escalated after its last measured step (an
    escalation no NaN/Inf began is not ended by the next report), the width-16 shape recorded."""
    out = tmp_path / "origin.json"
    args = ["--host-bound", "--world-size", "1", "--steps", "3", "--warmup", "1", "--json", str(out)]
    run = run_benchmark("benchmarks.origin_checks", *args, timeout=300)
    assert run.returncode == 0, f"exit {run.returncode}:\n{run.stderr[-3000:]}"
    document = json.loads(out.read_text())
    got = {
        kind: (
            math.isfinite(r["ratio_checks_off"]),
            math.isfinite(r["ratio_escalated_off"]),
            r["own_s"] > 0.0,
            r["escalated_to_the_end"],
            r["ops"].get("aminmax", 0) > 0,
            r["ops_per_step"] == sum(r["ops"].values()),
            r["calls_per_step"] > r["ops_per_step"],
        )
        for kind in ("fully_shard", "fsdp2")
        if (r := document[kind])
    }
    want = {kind: (True,) * 7 for kind in ("fully_shard", "fsdp2")}
    assert got == want, (
        "(finite ratio, finite escalated ratio, own time > 0, escalated to the end, aminmax counted, operators "
        f"summed, more Python calls than operators): {got}"
    )
    rows = [
        line for line in run.stdout.splitlines() if line.startswith("| fully_shard |") or line.startswith("| fsdp2 |")
    ]
    assert len(rows) == 2, f"want a table row per sharding in the output:\n{run.stdout}"
    shape = (document["host_bound"], document["config"]["dim"], document["config"]["layers"])
    assert shape == (True, 16, 6), f"(host_bound, dim, layers): {shape}"


def test_op_audit_cost_measures_both_kinds_and_writes_its_figures(tmp_path: Path) -> None:
    """``benchmarks.op_audit_cost --small`` on 1 rank: per kind, the plain, audited, shadowed and
    audited-and-shadowed steps, their ratios to the plain one and what the last amortizes to at one
    in 1000 iterations, in the table and the JSON."""
    out = tmp_path / "audit.json"
    args = ["--small", "--world-size", "1", "--steps", "2", "--json", str(out)]
    run = run_benchmark("benchmarks.op_audit_cost", *args, timeout=300)
    assert run.returncode == 0, f"exited {run.returncode}:\n{run.stderr[-3000:]}"
    results = json.loads(out.read_text(encoding="utf-8"))
    for kind in ("fully_shard", "fsdp2"):
        row = results[kind]
        keys = [f"step_s_{s}" for s in ("plain", "audited", "shadowed", "both")]
        keys += [f"ratio_{s}_plain" for s in ("audited", "shadowed", "both")] + ["amortized_at_default"]
        values = [row[k] for k in keys]
        assert all(math.isfinite(v) and v > 0 for v in values), f"{kind}: {row}"
        assert row["amortized_at_default"] == 1 + (row["ratio_both_plain"] - 1) / 1000, row
        assert f"| {kind} |" in run.stdout, f"no row for {kind} in:\n{run.stdout}"


def test_origin_checks_host_bound_is_refused_on_a_gpu() -> None:
    run = run_benchmark("benchmarks.origin_checks", "--host-bound", "--device", "cuda", timeout=120)
    assert run.returncode == 2, f"--host-bound --device cuda: exit {run.returncode}\n{run.stderr[-2000:]}"
    assert "--host-bound measures on the CPU: leave --device out" in run.stderr, run.stderr


def test_determinism_soak_names_the_runs_whose_state_differs() -> None:
    """``benchmarks.determinism_soak``'s summary: one state when every run's digests agree; a run
    whose digest differs on any rank is named."""
    from benchmarks.determinism_soak import summarize

    same = [
        {"run": r, "setting": s, "digests": ["a", "b"]} for r in range(2) for s in ("telemetry_off", "telemetry_on")
    ]
    assert summarize(same) == {"runs": 4, "distinct_states": 1, "differ_from_first": []}, summarize(same)
    differing = [*same[:3], {"job": 1, "run": 1, "setting": "telemetry_on", "digests": ["a", "c"]}]
    got = summarize(differing)
    assert got == {"runs": 4, "distinct_states": 2, "differ_from_first": ["job 1 run 1 telemetry_on"]}, got


@pytest.mark.long
def test_determinism_soak_runs_and_every_run_holds_one_state(tmp_path: Path) -> None:
    """Two jobs of one run per setting on 2 ranks (overlap, 2 microbatches, telemetry on and off),
    local and as two torchrun agents (nodes) on the loopback interface: one digest per rank for all
    eight, in the table and the JSON."""
    out = tmp_path / "soak-WORLD.json"
    args = [
        "--jobs",
        "2",
        "--runs",
        "1",
        "--world-sizes",
        "2",
        "--nodes",
        "1",
        "2",
        "--steps",
        "3",
        "--microbatches",
        "2",
        "--json",
        str(out),
    ]
    run = run_benchmark("benchmarks.determinism_soak", *args)
    assert run.returncode == 0, f"determinism_soak exited {run.returncode}:\n{run.stderr[-3000:]}"
    want = "| 2 | 1 and 2 | 8 (2 x 2 jobs x 1 per setting) | 3 x 2 | all bitwise equal | - |"
    assert want in run.stdout, f"want the row {want!r} in:\n{run.stdout}"
    summary = json.loads((tmp_path / "soak-2.json").read_text())["summary"]
    assert summary == {"runs": 8, "distinct_states": 1, "differ_from_first": []}, summary
