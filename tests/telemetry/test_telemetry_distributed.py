"""Two real processes over gloo: cross-rank reduction, per-rank tracing, flush on destroy_process_group."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch.multiprocessing as mp
from fsdp_patch.telemetry import semconv
from telemetry_gloo_worker import worker
from telemetry_testing import reference_stats

WORLD_SIZE = 2


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
def results(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("gloo")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("FSDP_PATCH_PRECISION_EVERY", "1")
        env.setenv("FSDP_PATCH_TRACE_RANKS", "1")
        env.setenv("FSDP_PATCH_TRACE_DIR", str(tmp / "traces"))
        env.setenv("FSDP_PATCH_SUMMARY", "none")
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "600000")  # nothing is exported until a flush
        for name in ("OTEL_TRACES_EXPORTER", "OTEL_METRICS_EXPORTER", "OTEL_SDK_DISABLED"):
            env.delenv(name, raising=False)
        mp.spawn(worker, args=(WORLD_SIZE, str(tmp / "init"), str(tmp)), nprocs=WORLD_SIZE, join=True)
    out = []
    for rank in range(WORLD_SIZE):
        with open(tmp / f"rank{rank}.json", encoding="utf-8") as f:
            out.append(json.load(f))
    return out


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
