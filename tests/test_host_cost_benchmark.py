"""``benchmarks.host_cost``: telemetry's host cost per step by the number of parameter tensors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from fsdp_patch.app.demo.model import GPTConfig

from benchmarks.common import Clock, process_group, training_steps
from benchmarks.host_cost import PRESETS, Shape, _fit, count_synchronizations, measure, quiet_telemetry
from tests.benchmark_runs import run_benchmark


def test_fit_finds_the_fixed_part_and_the_part_per_tensor() -> None:
    got = _fit([10, 100, 1000], [150e-6 + 1e-6 * n for n in (10, 100, 1000)])
    assert math.isclose(got[0], 150e-6, rel_tol=1e-9) and math.isclose(got[1], 1e-6, rel_tol=1e-9), got


def test_host_cost_measures_every_size_and_sharding_and_writes_its_figures(tmp_path: Path) -> None:
    out = tmp_path / "host.json"
    args = ["--rounds", "2", "--layers", "0", "1", "--clip", "1.0", "--json", str(out)]
    run = run_benchmark("benchmarks.host_cost", *args)
    assert run.returncode == 0, f"exited {run.returncode}:\n{run.stderr[-3000:]}"
    document = json.loads(out.read_text(encoding="utf-8"))
    assert document["benchmark"] == "host_cost" and document["rounds"] == 2, document
    assert document["clip"] == 1.0, f"--clip 1.0: want it recorded, got {document['clip']}"
    for kind in ("fully_shard", "fsdp2"):
        sizes = document[kind]["sizes"]
        got = [(s["layers"], s["tensors"]) for s in sizes]
        assert got == [(0, 6), (1, 18)], f"{kind}: (layers, tensors) {got}"
        for s in sizes:
            ratios = (s["ratio_on_off"], s["ratio_diagnosed_off"], s["step_s_off"])
            assert all(math.isfinite(v) and v > 0 for v in ratios), f"{kind}: {s}"
        fit = (document[kind]["added_fixed_s"], document[kind]["added_per_tensor_s"])
        assert all(math.isfinite(v) for v in fit), f"{kind}: fit {fit}"
        assert f"{kind} added per undiagnosed step" in run.stdout, run.stdout


def test_a_clipped_step_clips_the_grads_before_the_update() -> None:
    """``training_steps(..., clip=)``: with SGD at lr 1 the update is the grads, clipped to ``clip``."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    before = [p.detach().clone() for p in model.parameters()]
    step = training_steps(
        {"m": (model, optimizer)}, [torch.ones(2, 4)], Clock("cpu"), lambda m, x: 1000 * m(x).sum(), 0.5
    )
    step("m")
    got = torch.cat([(b - p.detach()).flatten() for b, p in zip(before, model.parameters(), strict=True)]).norm().item()
    assert math.isclose(got, 0.5, rel_tol=1e-4), f"want an update of norm 0.5 (the clip), got {got}"


def test_bad_arguments_are_refused_naming_what_is_expected() -> None:
    run = run_benchmark("benchmarks.host_cost", "--rounds", "60", timeout=120)
    assert run.returncode == 2, f"--rounds 60: exit {run.returncode}"
    assert "--rounds 60: expected 1 to 46 (the measured steps stay undiagnosed)" in run.stderr, run.stderr
    run = run_benchmark("benchmarks.host_cost", "--clip", "0", timeout=120)
    assert run.returncode == 2, f"--clip 0: exit {run.returncode}"
    assert "--clip 0.0: expected a positive total norm" in run.stderr, run.stderr


def test_the_1b_preset_is_a_model_of_a_billion_parameters_in_bf16() -> None:
    shape, layers = PRESETS["1b"]
    params = shape.config(layers[0]).approx_params
    assert 1.0e9 <= params <= 1.1e9, f"the 1b preset: want about 1B parameters, got {params:,}"
    assert shape.compute_dtype == torch.bfloat16, f"the 1b preset: want bf16 compute, got {shape.compute_dtype}"


def test_a_bf16_compute_model_is_measured_under_both_shardings() -> None:
    """The 1b preset's structure and dtypes at a width a CPU runs in seconds."""
    shape = Shape(GPTConfig(vocab=64, dim=16, heads=2, layers=0, seq=8), batch=2, compute_dtype=torch.bfloat16)
    with process_group("cpu"), quiet_telemetry():
        for kind in ("fully_shard", "fsdp2"):
            got = measure(kind, 1, 1, shape)
            assert got["tensors"] == 18 and got["params"] > 0, f"{kind}: {got}"
            ratios = (got["ratio_on_off"], got["ratio_diagnosed_off"])
            assert all(math.isfinite(r) and r > 0 for r in ratios), f"{kind}: ratios {ratios}"
            assert "syncs_on" not in got, f"{kind}: CUDA synchronizations counted on a CPU: {got}"


def test_synchronizations_are_counted_from_the_profiled_calls() -> None:
    names = ["aten::mm", "cudaLaunchKernel", "cudaStreamSynchronize", "cudaMemcpyAsync", "cudaEventSynchronize"]
    got = count_synchronizations(names)
    assert got == 2, f"want the stream and event synchronizations counted (2), got {got} of {names}"
