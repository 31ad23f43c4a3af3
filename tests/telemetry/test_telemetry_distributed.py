"""Two gloo ranks: cross-rank reduction, per-rank tracing, flush on destroy_process_group.

Each rank observes two fake steps on its own shards (``rank_groups``), chosen so that local and
global diagnostics differ; the test process compares every rank's metrics with a numpy reference
computed from all ranks' shards together.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from fsdp_patch.telemetry import semconv
from telemetry_testing import Group, in_memory_telemetry, metric_points, reference_stats, run_fake_step

from tests.integration.otel_training import environment, reset_otel

WORLD_SIZE = 2


# -- on the ranks ---------------------------------------------------------------------------------


def rank_groups(rank: int) -> tuple[list[Group], list[list[torch.Tensor]]]:
    """Different shards per rank, so that local and global diagnostics differ.

    Rank 0 overflows fp16 in its refresh; rank 1 has a NaN grad and mostly lost updates.
    Returns the groups and, per step, the main weights the "optimizer" writes.
    """
    g = torch.Generator().manual_seed(100 + rank)
    n = 64
    main = torch.randn(n, generator=g) * (1 + rank)
    fp16 = Group(
        main.clone(), main.to(torch.float16), (torch.randn(n, generator=g) * (3 + 5 * rank)).to(torch.bfloat16)
    )
    frozen_main = torch.randn(n, generator=g)
    frozen = Group(frozen_main.clone(), frozen_main.to(torch.bfloat16), None)
    step_size = 1e-1 if rank == 0 else 1e-6
    first = main + step_size * torch.randn(n, generator=g)
    if rank == 0:
        first[3] = 7e4  # beyond fp16's range
    else:
        fp16.main_grad[5] = math.nan
    second = first + 1e-1 * torch.randn(n, generator=g)
    return [fp16, frozen], [[first, frozen_main], [second, frozen_main]]


def two_rank_run(trace_dir: str, rendezvous: str) -> dict[str, Any]:
    """Two fake steps on this rank's shards with the embedded default trace files, then
    ``destroy_process_group`` (which must flush them) and a new default group for the pool."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    settings = dict(
        FSDP_PATCH_PRECISION_EVERY="1",
        FSDP_PATCH_TRACE_RANKS="1",
        FSDP_PATCH_TRACE_DIR=trace_dir,
        FSDP_PATCH_SUMMARY="none",
        OTEL_BSP_SCHEDULE_DELAY="600000",  # nothing is exported until a flush
        OTEL_TRACES_EXPORTER=None,
        OTEL_METRICS_EXPORTER=None,
        OTEL_SDK_DISABLED=None,
    )
    reset_otel()
    try:
        with environment(**settings):
            return _observed_steps(rank, world_size, rendezvous)
    finally:
        reset_otel()


def _observed_steps(rank: int, world_size: int, rendezvous: str) -> dict[str, Any]:
    from fsdp_patch.telemetry import OptimizerObserver
    from fsdp_patch.telemetry.export import providers

    memory = in_memory_telemetry()
    observer = OptimizerObserver(
        torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1),
        precision_aware=False,
        meter_provider=memory.meter_provider,  # spans go through the package's own installed provider
    )
    groups, steps = rank_groups(rank)
    for group in groups:
        group.process_group = dist.group.WORLD
    history = []
    for new_mains in steps:
        before = [(g.main_weight.clone(), g.compute_weight.clone()) for g in groups]
        run_fake_step(observer, groups, new_mains, cast_bytes=10 * (rank + 1))
        history.append(
            [
                {
                    "main_before": b[0].tolist(),
                    "compute_before": b[1].float().tolist(),
                    "compute_dtype": str(g.compute_weight.dtype),
                    "main_after": g.main_weight.tolist(),
                    "compute_after": g.compute_weight.float().tolist(),
                    "grad": None if g.main_grad is None else g.main_grad.float().tolist(),
                }
                for b, g in zip(before, groups, strict=True)
            ]
        )
    trace_files_before_destroy = providers.written_trace_files()
    dist.destroy_process_group()  # wrapped by telemetry: flushes spans first
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size)
    trace_files_after_destroy = providers.written_trace_files()
    events = []
    for path in trace_files_after_destroy:
        if path.endswith(".trace.json"):
            with open(path, encoding="utf-8") as f:
                events = json.load(f)["traceEvents"]
    points = metric_points(memory.metric_reader)

    def one(name: str, **attributes: str) -> float:
        (point,) = [p for p in points[name] if all(p.attributes.get(k) == v for k, v in attributes.items())]
        assert point.attributes[semconv.ATTR_RANK] == rank
        return point.value

    return {
        "rank": rank,
        "history": history,
        "nonfinite": {
            f"{t}/{k}": one(semconv.METRIC_NONFINITE, **{semconv.ATTR_TENSOR: t, semconv.ATTR_NONFINITE_KIND: k})
            for t in semconv.TENSORS
            for k in semconv.NONFINITE_KINDS
        },
        "overflow": one(semconv.METRIC_REFRESH_OVERFLOW),
        "underflow": one(semconv.METRIC_REFRESH_UNDERFLOW),
        "refresh_error": one(semconv.METRIC_REFRESH_ERROR),
        "lost_ratio": one(semconv.METRIC_LOST_RATIO),
        "grad_amax": one(semconv.METRIC_GRAD_AMAX),
        "step_durations": points[semconv.METRIC_STEP_DURATION][0].count,
        "trace_files_before_destroy": trace_files_before_destroy,
        "trace_files_after_destroy": trace_files_after_destroy,
        "step_spans": [e["args"] for e in events if e.get("name") == semconv.SPAN_STEP],
    }


# -- the tests ------------------------------------------------------------------------------------


def arrays(step: dict) -> tuple:
    compute_dtype = np.float16 if step["compute_dtype"] == "torch.float16" else np.float32
    return (
        np.array(step["main_before"], dtype=np.float32),
        np.array(step["compute_before"], dtype=compute_dtype),
        np.array(step["main_after"], dtype=np.float32),
        np.array(step["compute_after"], dtype=compute_dtype),
        None if step["grad"] is None else np.array(step["grad"], dtype=np.float32),
    )


def reference_for(results: list[dict], step: int, ranks: list[int]) -> dict:
    """numpy diagnostics of one step over the given ranks' shards, concatenated per group."""
    per_group = []
    for group_index in range(len(results[0]["history"][step])):
        parts = [arrays(results[r]["history"][step][group_index]) for r in ranks]
        per_group.append(
            tuple(None if parts[0][i] is None else np.concatenate([p[i] for p in parts]) for i in range(5))
        )
    return reference_stats(*zip(*per_group, strict=True))


@pytest.fixture(scope="module")
def results(dist_pool, tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("gloo")
    return dist_pool(WORLD_SIZE).run(two_rank_run, str(tmp / "traces"), str(tmp / "rendezvous"))


@pytest.mark.timeout(180)
def test_diagnostics_are_reduced_over_all_ranks(results):
    steps = [reference_for(results, s, list(range(WORLD_SIZE))) for s in range(2)]
    last = steps[-1]
    for result in results:  # identical global values on every rank
        for key, count in result["nonfinite"].items():
            tensor, kind = key.split("/")
            assert count == sum(s["nonfinite"][(tensor, kind)] for s in steps), key
        assert result["overflow"] == sum(s["overflow"] for s in steps)
        assert result["underflow"] == sum(s["underflow"] for s in steps)
        assert result["grad_amax"] == last["grad_amax"]
        assert result["lost_ratio"] == pytest.approx(last["lost_ratio"], rel=1e-12)
        assert result["refresh_error"] == pytest.approx(last["refresh_error"], rel=1e-5)
        assert result["step_durations"] == 2

    # The data makes the reduction observable: no single rank's shard gives these values.
    assert steps[0]["overflow"] == 1 and steps[0]["nonfinite"][(semconv.TENSOR_MAIN_GRAD, semconv.NONFINITE_NAN)] == 1
    for rank in range(WORLD_SIZE):
        local = reference_for(results, 0, [rank])
        assert local["lost_ratio"] != pytest.approx(steps[0]["lost_ratio"], rel=1e-3)
        assert local["grad_amax"] != steps[0]["grad_amax"] or local["refresh_error"] != pytest.approx(
            steps[0]["refresh_error"], rel=1e-3
        )


@pytest.mark.timeout(180)
def test_only_selected_ranks_trace_and_destroy_process_group_flushes(results):
    rank0, rank1 = results
    assert rank0["trace_files_after_destroy"] == [] and rank0["step_spans"] == []
    assert rank1["trace_files_before_destroy"] == []  # nothing exported during the steps
    assert rank1["trace_files_after_destroy"][0].endswith("rank1.trace.json")
    spans = sorted(rank1["step_spans"], key=lambda a: a[semconv.ATTR_STEP])
    assert [(a[semconv.ATTR_STEP], a[semconv.ATTR_RANK], a[semconv.ATTR_WORLD_SIZE]) for a in spans] == [
        (1, 1, 2),
        (2, 1, 2),
    ]
    assert [a[semconv.ATTR_CAST_BYTES] for a in spans] == [20, 20]
