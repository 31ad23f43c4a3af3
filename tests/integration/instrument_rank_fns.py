"""Rank functions of the instrumentation tests: the instrumentor round trip, settings that differ
across ranks, and an LBFGS step's refreshes. Each returns plain data."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from tests import models
from tests.integration.rank_fns import (
    _bf16_model,
    _main_weights,
    _reset_otel,
    environment,
    in_memory_otel,
    metric_points,
)
from tests.telemetry.telemetry_testing import global_state

STEPS_PER_PHASE = 2


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches: list[torch.Tensor]) -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    for tokens in batches:
        models.lm_loss(model, models.rank_slice(tokens, rank, world_size)).backward()
        optimizer.step()
        optimizer.zero_grad()


def instrument_round_trip(trace_dir: str) -> dict[str, Any]:
    """instrument -> train -> uninstrument -> train -> instrument -> train -> uninstrument, against
    a model trained with torch's hook attachment (telemetry off) on the same batches."""
    from fsdp_patch.telemetry import FSDPOptimizerInstrumentor

    from fsdp_patch.adapter import adaptation_of
    from fsdp_patch.optimizer import fully_shard_optimizer

    rank = dist.get_rank()
    batches = models.make_batches(3 * STEPS_PER_PHASE)
    phases = [batches[i : i + STEPS_PER_PHASE] for i in range(0, len(batches), STEPS_PER_PHASE)]
    out: dict[str, Any] = {}
    with environment(FSDP_PATCH_TELEMETRY=None, FSDP_PATCH_PRECISION_EVERY="1", FSDP_PATCH_SUMMARY="none",
                     FSDP_PATCH_TRACE_DIR=trace_dir, OTEL_TRACES_EXPORTER=None, OTEL_METRICS_EXPORTER=None):  # fmt: skip
        _reset_otel()
        before = global_state()
        instrumentor = FSDPOptimizerInstrumentor()
        instrumentor.instrument()
        model = _bf16_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # adapted by the instrumentor
        out["adapted"] = getattr(adaptation_of(optimizer), "kind", None)
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
        _reset_otel()

        reference = _bf16_model()
        reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3)
        fully_shard_optimizer(reference_optimizer)  # telemetry off: torch's step hooks
        _train(reference, reference_optimizer, batches)
    out["bitwise equal"] = all(
        torch.equal(a, b) for a, b in zip(_main_weights(model), _main_weights(reference), strict=True)
    )
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
    """One adapted step with this rank's settings; returns the error it raised and how long it took."""
    from fsdp_patch.adapter.settings_check import CollectiveSettingsError
    from fsdp_patch.optimizer import fully_shard_optimizer

    rank, world_size = dist.get_rank(), dist.get_world_size()
    settings = {"FSDP_PATCH_SUMMARY": "none", "OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "none",
                **per_rank[rank]}  # fmt: skip
    with environment(**settings):
        _reset_otel()
        model = _bf16_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        fully_shard_optimizer(optimizer)
        models.lm_loss(model, models.rank_slice(models.make_batches(1)[0], rank, world_size)).backward()
        started = time.perf_counter()
        error = None
        try:
            optimizer.step()
        except CollectiveSettingsError as exc:
            error = str(exc)
        seconds = time.perf_counter() - started
        _reset_otel()
    return {"error": error, "seconds": seconds}


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
        points = metric_points(reader)
    refresh = [v for attrs, v in points.get(semconv.METRIC_CAST_SIZE, [])
               if attrs[semconv.ATTR_CAST_KIND] == semconv.CAST_KIND_WEIGHT_REFRESH]  # fmt: skip
    per_refresh = sum(g.compute_weight.numel() * g.compute_weight.element_size() for g in parameter_groups(model))
    return {"closure calls": calls, "refresh bytes": sum(refresh), "bytes per refresh": per_refresh}
