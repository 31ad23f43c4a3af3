"""The instrumentor and the cross-rank settings check on 2 gloo ranks, training the small transformer
sharded by fully_shard (bf16 compute, fp32 main weights, bf16 main grads)."""

from __future__ import annotations

import gc
import json
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests import models
from tests.integration.otel_training import (
    environment,
    in_memory_otel,
    main_weights,
    metric_values,
    reset_otel,
)
from tests.telemetry.telemetry_testing import global_state

WORLD = 2
STEPS_PER_PHASE = 2


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches: list[torch.Tensor]) -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    for tokens in batches:
        models.lm_loss(model, models.rank_slice(tokens, rank, world_size)).backward()
        optimizer.step()
        optimizer.zero_grad()


def instrument_round_trip(trace_dir: str) -> dict[str, Any]:
    """instrument -> train -> uninstrument -> train -> instrument -> train -> uninstrument, against
    a model trained with telemetry off on the same batches."""
    from fsdp_patch.telemetry import FSDPOptimizerInstrumentor

    from fsdp_patch.adapter import adaptation_of
    from fsdp_patch.optimizer import fully_shard_optimizer

    rank = dist.get_rank()
    batches = models.make_batches(3 * STEPS_PER_PHASE)
    phases = [batches[i : i + STEPS_PER_PHASE] for i in range(0, len(batches), STEPS_PER_PHASE)]
    out: dict[str, Any] = {}
    with environment(
        FSDP_PATCH_TELEMETRY=None,
        FSDP_PATCH_PRECISION_EVERY="1",
        FSDP_PATCH_SUMMARY="none",
        FSDP_PATCH_TRACE_DIR=trace_dir,
        OTEL_TRACES_EXPORTER=None,
        OTEL_METRICS_EXPORTER=None,
    ):
        reset_otel()
        gc.collect()  # an earlier test's optimizers (and the wrappers their watches hold) go first
        before = global_state()
        instrumentor = FSDPOptimizerInstrumentor()
        instrumentor.instrument()
        model = models.sharded_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # adapted by the instrumentor
        out["adapted"] = type(getattr(adaptation_of(optimizer), "observer", None)).__name__
        _train(model, optimizer, phases[0])
        instrumentor.uninstrument()
        out["left after uninstrument"] = {k: v for k, v in global_state().items() if v != before[k]}
        out["first trace steps"] = _trace_steps(trace_dir, rank)
        _train(model, optimizer, phases[1])  # telemetry off, the adaptation still casts and refreshes
        out["trace steps while off"] = _trace_steps(trace_dir, rank)
        instrumentor.instrument()
        _train(model, optimizer, phases[2])
        instrumentor.uninstrument()
        out["second trace steps"] = _trace_steps(trace_dir, rank)
        out["left at the end"] = {k: v for k, v in global_state().items() if v != before[k]}
        reset_otel()

        reference = models.sharded_model()
        reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3)
        fully_shard_optimizer(reference_optimizer)  # telemetry off: a NullObserver
        _train(reference, reference_optimizer, batches)
    pairs = zip(main_weights(model), main_weights(reference), strict=True)
    out["groups differing"] = [i for i, (a, b) in enumerate(pairs) if not torch.equal(a, b)]
    return out


def _trace_steps(trace_dir: str, rank: int) -> list[int]:
    path = os.path.join(trace_dir, f"rank{rank}.trace.json")
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        events = json.load(f)["traceEvents"]
    from fsdp_patch.telemetry import semconv

    return sorted(e["args"][semconv.ATTR_STEP] for e in events if e.get("name") == semconv.SPAN_STEP)


def mismatched_settings(per_rank: list[dict[str, str | None]]) -> dict[str, Any]:
    """One adapted step with this rank's settings; returns the error it raised."""
    from fsdp_patch.adapter.settings_check import CollectiveSettingsError
    from fsdp_patch.optimizer import fully_shard_optimizer

    rank, world_size = dist.get_rank(), dist.get_world_size()
    settings = {
        "FSDP_PATCH_SUMMARY": "none",
        "OTEL_TRACES_EXPORTER": "none",
        "OTEL_METRICS_EXPORTER": "none",
        **per_rank[rank],
    }
    with environment(**settings):
        reset_otel()
        model = models.sharded_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        fully_shard_optimizer(optimizer)
        models.lm_loss(model, models.rank_slice(models.make_batches(1)[0], rank, world_size)).backward()
        error = None
        try:
            optimizer.step()
        except CollectiveSettingsError as exc:
            error = str(exc)
        reset_otel()
    return {"error": error}


def lbfgs_refreshes() -> dict[str, Any]:
    """One LBFGS step (several closure calls) with telemetry on; the refresh bytes it recorded."""
    from fsdp_patch.telemetry import semconv

    from fsdp_patch import parameter_groups
    from fsdp_patch.optimizer import fully_shard_optimizer
    from tests.optimizer.support import EVEN, backward, batches, build_model

    with environment(FSDP_PATCH_TELEMETRY="1", FSDP_PATCH_PRECISION_EVERY="0"), in_memory_otel() as (_, reader):
        model = build_model(**EVEN)
        optimizer = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)
        fully_shard_optimizer(optimizer)
        tokens = batches(1, vocab=EVEN["vocab"], seq=EVEN["seq"])[0]
        calls = 0

        def closure() -> torch.Tensor:
            nonlocal calls
            calls += 1
            optimizer.zero_grad()
            return backward(model, tokens)

        optimizer.step(closure)
        points = metric_values(reader)
    refresh = [
        v
        for attrs, v in points.get(semconv.METRIC_CAST_SIZE, [])
        if attrs[semconv.ATTR_CAST_KIND] == semconv.CAST_KIND_WEIGHT_REFRESH
    ]
    per_refresh = sum(g.compute_weight.numel() * g.compute_weight.element_size() for g in parameter_groups(model))
    return {"closure calls": calls, "refresh bytes": sum(refresh), "bytes per refresh": per_refresh}


def test_instrument_uninstrument_instrument_round_trip(dist_pool, tmp_path) -> None:
    results = dist_pool(WORLD).run(instrument_round_trip, str(tmp_path / "traces"))
    per_phase = STEPS_PER_PHASE
    for rank, result in enumerate(results):
        adapted = result["adapted"]
        assert adapted == "OptimizerObserver", (
            f"rank {rank}: adapted with observer {adapted}, want telemetry's: {result}"
        )
        assert result["left after uninstrument"] == {}, f"rank {rank}: {result['left after uninstrument']}"
        assert result["left at the end"] == {}, f"rank {rank}: {result['left at the end']}"
        first = list(range(1, per_phase + 1))
        assert result["first trace steps"] == first, f"rank {rank}: want steps {first}, got {result}"
        assert result["trace steps while off"] == first, f"rank {rank}: spans while uninstrumented: {result}"
        second = list(range(2 * per_phase + 1, 3 * per_phase + 1))  # numbering continued across the gap
        assert result["second trace steps"] == second, f"rank {rank}: want steps {second}, got {result}"
        differing = result["groups differing"]
        assert differing == [], f"rank {rank}: main weights of groups {differing} differ from telemetry off's"


@pytest.mark.parametrize(
    ("per_rank", "named"),
    [
        ([{"FSDP_PATCH_TELEMETRY": "1"}, {"FSDP_PATCH_TELEMETRY": None}], "rank 0 on, rank 1 off"),
        (
            [
                {"FSDP_PATCH_TELEMETRY": "1", "FSDP_PATCH_PRECISION_EVERY": "1"},
                {"FSDP_PATCH_TELEMETRY": "1", "FSDP_PATCH_PRECISION_EVERY": "5"},
            ],
            "rank 0 1, rank 1 5",
        ),
        (
            [
                {"FSDP_PATCH_TELEMETRY": "1", "FSDP_PATCH_PRECISION_EVERY": "1"},
                {"FSDP_PATCH_TELEMETRY": "1", "FSDP_PATCH_PRECISION_EVERY": "1", "FSDP_PATCH_PRECISION_TOP_K": "0"},
            ],
            "Per-parameter detail (FSDP_PATCH_PRECISION_TOP_K above 0): rank 0 on, rank 1 off",
        ),
    ],
    ids=["telemetry-on-one-rank", "diagnostics-schedules-differ", "per-parameter-detail-differs"],
)
def test_mismatched_settings_raise_the_same_error_on_every_rank(dist_pool, per_rank, named) -> None:
    results = dist_pool(WORLD).run(mismatched_settings, per_rank)
    errors = [r["error"] for r in results]
    assert errors[0] is not None and errors[0] == errors[1], f"want one error on both ranks, got {errors}"
    for variable in ("FSDP_PATCH_TELEMETRY", "FSDP_PATCH_PRECISION_EVERY"):
        assert variable in errors[0], f"the error does not name {variable}: {errors[0]}"
    assert named in errors[0], f"the error does not give each rank's value ({named!r}): {errors[0]}"


def test_equal_settings_pass_the_check(dist_pool) -> None:
    same = {"FSDP_PATCH_TELEMETRY": "1", "FSDP_PATCH_PRECISION_EVERY": "3"}
    results = dist_pool(WORLD).run(mismatched_settings, [same, same])
    assert [r["error"] for r in results] == [None, None]


def test_lbfgs_refreshes_between_closure_calls(dist_pool) -> None:
    for rank, result in enumerate(dist_pool(WORLD).run(lbfgs_refreshes)):
        calls = result["closure calls"]
        assert calls >= 2, f"rank {rank}: LBFGS called the closure {calls} times; the test needs several"
        # one refresh before each later closure call (forward must see the weights being evaluated),
        # and one after the step
        want = calls * result["bytes per refresh"]
        got = result["refresh bytes"]
        assert got == want, f"rank {rank}: want {calls} refreshes ({want} bytes), got {got} bytes"
