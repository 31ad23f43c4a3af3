"""Telemetry on real multi-rank training through the public API (issue: telemetry).

Each test trains the small transformer sharded over 2 gloo ranks, bf16 compute weights, fp32
main weights, bf16 main grads, with the application's in-memory OpenTelemetry providers.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
import torch.distributed as dist
from fsdp_patch.telemetry import semconv

from tests import models
from tests.integration.otel_training import (
    STEPS,
    adamw_training,
    environment,
    in_memory_otel,
    main_weights,
    metric_values,
    reset_otel,
)

WORLD = 2


def _expected_shard_numel(shapes: list[tuple[int, ...]], world_size: int) -> int:
    # The cast writes the whole padded group buffer: ceil(dim0 / W) rows per parameter.
    return sum(-(-shape[0] // world_size) * math.prod(shape[1:]) for shape in shapes)


def _total(points: dict, name: str, **attributes: str) -> float:
    wanted = dict(attributes)
    return sum(value for attrs, value in points.get(name, []) if all(attrs.get(k) == v for k, v in wanted.items()))


# -- on the ranks --------------------------------------------------------------------------------


def traced_training() -> dict[str, Any]:
    """Trains STEPS steps with telemetry on; returns spans, metric points and expected sizes."""
    from fsdp_patch import parameter_groups

    with environment(FSDP_PATCH_TELEMETRY="1", FSDP_PATCH_PRECISION_EVERY="0"), in_memory_otel() as (spans, reader):
        model = adamw_training()
        finished = [
            {
                "name": s.name,
                "id": s.context.span_id,
                "parent": s.parent.span_id if s.parent else None,
                "attributes": dict(s.attributes),
                "status": s.status.status_code.name,
            }
            for s in spans.get_finished_spans()
        ]
        points = metric_values(reader)
    shapes = [p.shape for p in model.parameters()]
    compute_numel = sum(g.compute_weight.numel() for g in parameter_groups(model))
    return {
        "spans": finished,
        "points": points,
        "shapes": [tuple(s) for s in shapes],
        "compute_numel": compute_numel,
        "param_count": len(shapes),
        "fsdp_groups": len(parameter_groups(model)),
    }


def failing_step() -> dict[str, Any]:
    """A step whose closure raises; reports the span, the grads afterwards, and a next step."""
    from fsdp_patch.optimizer import fully_shard_optimizer

    rank, world_size = dist.get_rank(), dist.get_world_size()
    with environment(FSDP_PATCH_TELEMETRY="1", FSDP_PATCH_PRECISION_EVERY="0"), in_memory_otel() as (spans, reader):
        model = models.sharded_model()
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        fully_shard_optimizer(optimizer)
        tokens = models.rank_slice(models.make_batches(1)[0], rank, world_size)
        models.lm_loss(model, tokens).backward()
        grads_before = [p.grad for p in model.parameters()]
        values_before = [g.to_local().clone() for g in grads_before]

        class Boom(RuntimeError):
            pass

        def closure() -> torch.Tensor:
            raise Boom("planted failure in the closure")

        raised = None
        try:
            optimizer.step(closure)
        except Boom as error:
            raised = str(error)
        after = list(model.parameters())
        replaced = [i for i, (p, g) in enumerate(zip(after, grads_before, strict=True)) if p.grad is not g]
        changed = [
            i
            for i, (p, v) in enumerate(zip(after, values_before, strict=True))
            if not torch.equal(p.grad.to_local(), v)
        ]
        dtypes = sorted({str(p.grad.dtype) for p in after} | {str(p.grad_dtype) for p in after})
        optimizer.step()  # the next step works
        step_spans = [
            {
                "status": s.status.status_code.name,
                "events": [e.name for e in s.events],
                "description": s.status.description,
            }
            for s in spans.get_finished_spans()
            if s.name == semconv.SPAN_STEP
        ]
    return {
        "raised": raised,
        "grads replaced": replaced,
        "grads changed": changed,
        "dtypes": dtypes,
        "step_spans": step_spans,
    }


def precision_run(scenario: str, diagnostics: bool, steps: int = 4) -> dict[str, Any]:
    """Trains with a planted bug; returns the precision metrics and the final main weights.

    Scenarios: ``nan`` (one NaN in rank 0's grad at step 2), ``overflow`` (fp16 compute weights;
    ``OVERFLOW_ELEMENTS`` main-weight elements per rank set past fp16's range at step 2),
    ``tiny_lr`` (lr 1e-7 on bf16 compute weights), ``normal_lr`` (lr 1e-3).
    """
    from fsdp_patch.optimizer import fully_shard_optimizer

    rank, world_size = dist.get_rank(), dist.get_world_size()
    every = "1" if diagnostics else "0"
    compute_dtype = torch.float16 if scenario == "overflow" else torch.bfloat16
    lr = {"tiny_lr": 1e-7, "normal_lr": 1e-2}.get(scenario, 1e-3)
    # Adam moves every element with a grad by about lr, whatever the grad's scale, which makes
    # "too small for bf16" a property of lr alone.
    optimizer_class = torch.optim.Adam if scenario.endswith("_lr") else torch.optim.SGD
    with environment(FSDP_PATCH_TELEMETRY="1", FSDP_PATCH_PRECISION_EVERY=every), in_memory_otel() as (_, reader):
        model = models.sharded_model(dtype=compute_dtype)
        optimizer = optimizer_class(model.parameters(), lr=lr)
        fully_shard_optimizer(optimizer)
        for step, tokens in enumerate(models.make_batches(steps), start=1):
            models.lm_loss(model, models.rank_slice(tokens, rank, world_size)).backward()
            if step == 2 and scenario == "nan" and rank == 0:
                with torch.no_grad():
                    model.head.weight.grad.to_local().view(-1)[3] = float("nan")
            if step == 2 and scenario == "overflow":
                with torch.no_grad():
                    model.head.weight.to_local().view(-1)[:OVERFLOW_ELEMENTS] = 7.0e4
            optimizer.step()
            optimizer.zero_grad()
            if scenario in ("nan", "overflow") and step == 2:
                break  # later steps would only spread the planted values
        points = metric_values(reader)
    return {"points": points, "main": main_weights(model)}


OVERFLOW_ELEMENTS = 5


def silent_training(patched: bool) -> list[torch.Tensor]:
    """Trains with FSDP_PATCH_TELEMETRY unset; with ``patched`` every OpenTelemetry entry point raises."""
    from unittest import mock

    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("OpenTelemetry was called with FSDP_PATCH_TELEMETRY unset")

    targets = [
        "opentelemetry.trace.get_tracer",
        "opentelemetry.trace.get_tracer_provider",
        "opentelemetry.trace.get_current_span",
        "opentelemetry.trace.use_span",
        "opentelemetry.metrics.get_meter",
        "opentelemetry.metrics.get_meter_provider",
        "opentelemetry.context.attach",
        "opentelemetry.context.get_current",
        "opentelemetry.sdk.trace.Tracer.start_span",
        "opentelemetry.sdk.trace.Tracer.start_as_current_span",
        "fsdp_patch.telemetry.instrumentation.observer.OptimizerObserver.__init__",
    ]
    with contextlib.ExitStack() as stack, environment(FSDP_PATCH_TELEMETRY=None):
        if patched:
            for target in targets:
                stack.enter_context(mock.patch(target, forbidden))
        model = adamw_training()
    return main_weights(model)


def unreachable_collector(protocol: str) -> list[torch.Tensor]:
    """Trains with telemetry exporting over OTLP to a closed loopback port."""

    import fsdp_patch.telemetry as telemetry

    endpoint = "http://127.0.0.1:9" if protocol == "http/protobuf" else "127.0.0.1:9"
    reset_otel()
    with environment(
        FSDP_PATCH_TELEMETRY="1",
        FSDP_PATCH_PRECISION_EVERY="1",
        FSDP_PATCH_FLUSH_TIMEOUT="2",
        OTEL_TRACES_EXPORTER="otlp",
        OTEL_METRICS_EXPORTER="otlp",
        OTEL_EXPORTER_OTLP_PROTOCOL=protocol,
        OTEL_EXPORTER_OTLP_ENDPOINT=endpoint,
        OTEL_EXPORTER_OTLP_TIMEOUT="1",
        OTEL_EXPORTER_OTLP_INSECURE="true",
        OTEL_BSP_SCHEDULE_DELAY="50",
        OTEL_METRIC_EXPORT_INTERVAL="100",
    ):
        model = adamw_training()
        telemetry.shutdown()
    reset_otel()
    return main_weights(model)


# -- the tests --------------------------------------------------------------------------------


def test_span_tree_attributes_and_exact_metrics(dist_pool) -> None:
    results = dist_pool(WORLD).run(traced_training)
    for rank, result in enumerate(results):
        spans = result["spans"]
        steps = [s for s in spans if s["name"] == semconv.SPAN_STEP]
        assert [s["attributes"][semconv.ATTR_STEP] for s in steps] == list(range(1, STEPS + 1))
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
        assert len(zero_grads) == STEPS and all(s["parent"] is None for s in zero_grads)
        assert all(s["parent"] is None or s["parent"] in by_id for s in spans)

        points = result["points"]
        steps_n = STEPS
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
    for result in dist_pool(WORLD).run(failing_step):
        assert result["raised"] == "planted failure in the closure"
        assert result["grads replaced"] == [], f"grads of parameters {result['grads replaced']} are other objects"
        assert result["grads changed"] == [], f"grads of parameters {result['grads changed']} changed values"
        assert result["dtypes"] == ["torch.bfloat16"]
        failed, succeeded = result["step_spans"]
        assert failed["status"] == "ERROR" and "exception" in failed["events"]
        assert succeeded["status"] == "UNSET"


def test_precision_diagnostics_find_planted_bugs(dist_pool) -> None:
    pool = dist_pool(WORLD)
    nan = pool.run(precision_run, "nan", True)[0]["points"]
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

    overflow = pool.run(precision_run, "overflow", True)[0]["points"]
    assert _total(overflow, semconv.METRIC_REFRESH_OVERFLOW) == OVERFLOW_ELEMENTS * WORLD
    assert _total(
        overflow,
        semconv.METRIC_NONFINITE,
        **{semconv.ATTR_TENSOR: semconv.TENSOR_COMPUTE_WEIGHT},
        **{semconv.ATTR_NONFINITE_KIND: semconv.NONFINITE_INF},
    ) == (OVERFLOW_ELEMENTS * WORLD)
    assert (
        _total(
            overflow,
            semconv.METRIC_NONFINITE,
            **{semconv.ATTR_TENSOR: semconv.TENSOR_MAIN_WEIGHT},
            **{semconv.ATTR_NONFINITE_KIND: semconv.NONFINITE_INF},
        )
        == 0
    )

    tiny = pool.run(precision_run, "tiny_lr", True)[0]["points"]
    normal_on = pool.run(precision_run, "normal_lr", True)
    normal = normal_on[0]["points"]
    ((_, tiny_ratio),) = tiny[semconv.METRIC_LOST_RATIO]
    ((_, normal_ratio),) = normal[semconv.METRIC_LOST_RATIO]
    assert tiny_ratio > 0.95, tiny_ratio
    assert normal_ratio < 0.2, normal_ratio

    normal_off = pool.run(precision_run, "normal_lr", False)
    assert semconv.METRIC_LOST_RATIO not in normal_off[0]["points"]
    for on, off in zip(normal_on, normal_off, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(on["main"], off["main"], strict=True))


def test_off_means_off(dist_pool) -> None:
    pool = dist_pool(WORLD)
    silent = pool.run(silent_training, True)
    plain = pool.run(silent_training, False)
    for a, b in zip(silent, plain, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_unreachable_collector_keeps_training_and_numerics(dist_pool) -> None:
    pool = dist_pool(WORLD)
    baseline = pool.run(silent_training, False)
    for protocol in ("http/protobuf", "grpc"):
        exported = pool.run(unreachable_collector, protocol)
        for a, b in zip(exported, baseline, strict=True):
            assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
