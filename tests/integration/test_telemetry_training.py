"""Telemetry on real multi-rank training through the public API (issue: telemetry).

Each test trains the small transformer sharded over 2 gloo ranks, bf16 compute weights, fp32
main weights, bf16 main grads, with the application's in-memory OpenTelemetry providers.
"""

from __future__ import annotations

import math

import torch
from fsdp_patch.telemetry import semconv

from tests.integration import rank_fns

WORLD = 2


def _expected_shard_numel(shapes: list[tuple[int, ...]], world_size: int) -> int:
    # The cast writes the whole padded group buffer: ceil(dim0 / W) rows per parameter.
    return sum(-(-shape[0] // world_size) * math.prod(shape[1:]) for shape in shapes)


def _total(points: dict, name: str, **attributes: str) -> float:
    wanted = dict(attributes)
    return sum(value for attrs, value in points.get(name, []) if all(attrs.get(k) == v for k, v in wanted.items()))


def test_span_tree_attributes_and_exact_metrics(dist_pool) -> None:
    results = dist_pool(WORLD).run(rank_fns.traced_training)
    for rank, result in enumerate(results):
        spans = result["spans"]
        steps = [s for s in spans if s["name"] == semconv.SPAN_STEP]
        assert [s["attributes"][semconv.ATTR_STEP] for s in steps] == list(range(1, rank_fns.STEPS + 1))
        by_id = {s["id"]: s for s in spans}
        for step in steps:
            attrs = step["attributes"]
            assert step["parent"] is None and step["status"] == "UNSET"
            assert attrs[semconv.ATTR_RANK] == rank and attrs[semconv.ATTR_WORLD_SIZE] == WORLD
            assert attrs[semconv.ATTR_OPTIMIZER_CLASS] == "AdamW"
            assert attrs[semconv.ATTR_PARAMS_COUNT] == result["param_count"]
            # FSDP parameter groups the step touched (one per fully_shard unit), not optimizer param groups
            assert result["fsdp_groups"] > 1
            assert attrs[semconv.ATTR_GROUPS_COUNT] == result["fsdp_groups"], (
                f"want {result['fsdp_groups']} FSDP groups, got {attrs[semconv.ATTR_GROUPS_COUNT]}"
            )
            assert attrs[semconv.ATTR_PRECISION_AWARE] is False
            expected_cast = _expected_shard_numel(result["shapes"], WORLD) * 4
            assert attrs[semconv.ATTR_CAST_BYTES] == expected_cast
            children = [s["name"] for s in spans if s["parent"] == step["id"]]
            assert children == [
                semconv.SPAN_CAST_GRADS,
                semconv.SPAN_INNER_STEP,
                semconv.SPAN_RESTORE_GRADS,
                semconv.SPAN_REFRESH,
            ]
        zero_grads = [s for s in spans if s["name"] == semconv.SPAN_ZERO_GRAD]
        assert len(zero_grads) == rank_fns.STEPS and all(s["parent"] is None for s in zero_grads)
        assert all(s["parent"] is None or s["parent"] in by_id for s in spans)

        points = result["points"]
        steps_n = rank_fns.STEPS
        grad_bytes = _total(points, semconv.METRIC_CAST_SIZE, **{semconv.ATTR_CAST_KIND: semconv.CAST_KIND_GRAD})
        assert grad_bytes == steps_n * _expected_shard_numel(result["shapes"], WORLD) * 4
        refresh_bytes = _total(
            points, semconv.METRIC_CAST_SIZE, **{semconv.ATTR_CAST_KIND: semconv.CAST_KIND_WEIGHT_REFRESH}
        )
        assert refresh_bytes == steps_n * result["compute_numel"] * 2
        assert (
            _total(
                points,
                semconv.METRIC_DTYPE_MISMATCHES,
                **{semconv.ATTR_MISMATCH_ACTION: semconv.MISMATCH_CAST},
                **{semconv.ATTR_DTYPE_PARAM: "float32"},
                **{semconv.ATTR_DTYPE_GRAD: "bfloat16"},
            )
            == steps_n * result["param_count"]
        )
        assert _total(points, semconv.METRIC_STEP_DURATION) == steps_n
        assert _total(points, semconv.METRIC_REFRESH_DURATION) == steps_n


def test_failing_step_is_recorded_and_grads_are_restored(dist_pool) -> None:
    for result in dist_pool(WORLD).run(rank_fns.failing_step):
        assert result["raised"] == "planted failure in the closure"
        assert result["same_objects"] and result["same_values"]
        assert result["dtypes"] == ["torch.bfloat16"]
        failed, succeeded = result["step_spans"]
        assert failed["status"] == "ERROR" and "exception" in failed["events"]
        assert succeeded["status"] == "UNSET"


def test_precision_diagnostics_find_planted_bugs(dist_pool) -> None:
    pool = dist_pool(WORLD)
    nan = pool.run(rank_fns.precision_run, "nan", True)[0]["points"]
    assert (
        _total(
            nan,
            semconv.METRIC_NONFINITE,
            **{semconv.ATTR_TENSOR: semconv.TENSOR_MAIN_GRAD},
            **{semconv.ATTR_NONFINITE_KIND: semconv.NONFINITE_NAN},
        )
        == 1
    )
    assert (
        _total(
            nan,
            semconv.METRIC_NONFINITE,
            **{semconv.ATTR_TENSOR: semconv.TENSOR_MAIN_GRAD},
            **{semconv.ATTR_NONFINITE_KIND: semconv.NONFINITE_INF},
        )
        == 0
    )
    assert (
        _total(
            nan,
            semconv.METRIC_NONFINITE,
            **{semconv.ATTR_TENSOR: semconv.TENSOR_MAIN_WEIGHT},
            **{semconv.ATTR_NONFINITE_KIND: semconv.NONFINITE_NAN},
        )
        == 1
    )

    overflow = pool.run(rank_fns.precision_run, "overflow", True)[0]["points"]
    assert _total(overflow, semconv.METRIC_REFRESH_OVERFLOW) == rank_fns.OVERFLOW_ELEMENTS * WORLD
    assert _total(
        overflow,
        semconv.METRIC_NONFINITE,
        **{semconv.ATTR_TENSOR: semconv.TENSOR_COMPUTE_WEIGHT},
        **{semconv.ATTR_NONFINITE_KIND: semconv.NONFINITE_INF},
    ) == (rank_fns.OVERFLOW_ELEMENTS * WORLD)
    assert (
        _total(
            overflow,
            semconv.METRIC_NONFINITE,
            **{semconv.ATTR_TENSOR: semconv.TENSOR_MAIN_WEIGHT},
            **{semconv.ATTR_NONFINITE_KIND: semconv.NONFINITE_INF},
        )
        == 0
    )

    tiny = pool.run(rank_fns.precision_run, "tiny_lr", True)[0]["points"]
    normal_on = pool.run(rank_fns.precision_run, "normal_lr", True)
    normal = normal_on[0]["points"]
    ((_, tiny_ratio),) = tiny[semconv.METRIC_LOST_RATIO]
    ((_, normal_ratio),) = normal[semconv.METRIC_LOST_RATIO]
    assert tiny_ratio > 0.95, tiny_ratio
    assert normal_ratio < 0.2, normal_ratio

    normal_off = pool.run(rank_fns.precision_run, "normal_lr", False)
    assert semconv.METRIC_LOST_RATIO not in normal_off[0]["points"]
    for on, off in zip(normal_on, normal_off, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(on["main"], off["main"], strict=True))


def test_off_means_off(dist_pool) -> None:
    pool = dist_pool(WORLD)
    silent = pool.run(rank_fns.silent_training, True)
    plain = pool.run(rank_fns.silent_training, False)
    for a, b in zip(silent, plain, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_unreachable_collector_keeps_training_and_numerics(dist_pool) -> None:
    pool = dist_pool(WORLD)
    baseline = pool.run(rank_fns.silent_training, False)
    for protocol in ("http/protobuf", "grpc"):
        exported = pool.run(rank_fns.unreachable_collector, protocol)
        for a, b in zip(exported, baseline, strict=True):
            assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
