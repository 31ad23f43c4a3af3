"""Precision attribution's export on 2 and 4 gloo ranks, for ``fully_shard`` and torch FSDP2: by
default no series carries a parameter or unit label (per unit with ``FSDP_PATCH_PRECISION_DETAIL=unit``,
adding up to the whole model's), training is bitwise the same with telemetry off, a healthy run
names nothing, and ranks are named globally when the diagnostics gather over some ranks only.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from fsdp_patch.telemetry import semconv

from tests import models
from tests.integration.attribution_scenarios import (
    ALL,
    KINDS,
    SCENARIOS,
    STEPS,
    UNITS,
    WORLDS,
    attributed_training,
    attribution_model,
    span_findings,
)
from tests.integration.otel_training import environment, in_memory_otel


def check_export_and_bitwise_training(kind: str) -> None:
    """Default export: no per-parameter (or unit) label on any series; ``FSDP_PATCH_PRECISION_DETAIL=unit``:
    one series per unit whose counters add up to the default's; training bitwise equal to telemetry off."""
    rank, world = dist.get_rank(), dist.get_world_size()
    where = f"{kind}, {world} ranks, rank {rank}"
    default = attributed_training(kind, "normal", {"FSDP_PATCH_TELEMETRY": "1"})
    by_unit = attributed_training(kind, "normal", {"FSDP_PATCH_TELEMETRY": "1", "FSDP_PATCH_PRECISION_DETAIL": "unit"})
    off = attributed_training(kind, "normal", {"FSDP_PATCH_TELEMETRY": None})
    labels = {key for points in default["points"].values() for attrs, _ in points for key in attrs}
    assert not labels & {semconv.ATTR_PARAM, semconv.ATTR_UNIT}, f"{where}: default series carry {labels}"
    # Counts of steps stay one series per rank (the alert and panels sum them by rank); the
    # diagnostics' values get one series per unit.
    step_counts = {semconv.METRIC_PRECISION_STEPS, semconv.METRIC_NONFINITE_STEPS, semconv.METRIC_SKIPPED_STEPS}
    precision_points = {
        name: points
        for name, points in by_unit["points"].items()
        if name.startswith("fsdp.precision.") and name not in step_counts
    }
    units = {attrs.get(semconv.ATTR_UNIT) for points in precision_points.values() for attrs, _ in points}
    assert units == UNITS, f"{where}: units labelled {units}, want {UNITS}"
    counted = {
        name: {attrs.get(semconv.ATTR_UNIT) for attrs, _ in points}
        for name, points in by_unit["points"].items()
        if name in step_counts
    }
    assert all(got == {None} for got in counted.values()) and semconv.METRIC_PRECISION_STEPS in counted, (
        f"{where}: step counts by unit {counted}, want one series per rank without {semconv.ATTR_UNIT}"
    )
    for name in (semconv.METRIC_NONFINITE, semconv.METRIC_REFRESH_UNDERFLOW, semconv.METRIC_REFRESH_OVERFLOW):
        got, want = sum(v for _, v in by_unit["points"][name]), sum(v for _, v in default["points"][name])
        assert got == want, f"{where}: {name} summed over units {got}, whole model {want}"
    assert off["offenders"] == {} and off["points"] == {}, f"{where}: telemetry off recorded something"
    for name, a, b, c in zip(default["names"], default["local"], by_unit["local"], off["local"], strict=True):
        assert torch.equal(a, c) and torch.equal(b, c), f"{where}: {name} differs with diagnostics on and off"
    # the healthy run names nothing
    for step, diagnostics in default["offenders"].items():
        for diagnostic in (
            semconv.DIAGNOSTIC_STUCK,
            semconv.DIAGNOSTIC_UNSTEPPED,
            semconv.METRIC_NONFINITE,
            semconv.DIAGNOSTIC_STATE_NONFINITE,
            semconv.DIAGNOSTIC_STATE_FLUSHED,
        ):
            assert diagnostic not in diagnostics, f"{where}: step {step}: healthy run names {diagnostics[diagnostic]}"
    assert default["firsts"] == [] and default["contracts"] == [], (
        f"{where}: {default['firsts']} {default['contracts']}"
    )
    assert all(not math.isnan(v) for v in default["attributes"][STEPS].values() if isinstance(v, float))


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("kind", KINDS)
def test_default_export_is_bounded_and_training_is_bitwise_identical(dist_pool, world: int, kind: str) -> None:
    dist_pool(world).run(check_export_and_bitwise_training, kind)


def nan_on_a_sub_mesh(kind: str) -> list[tuple[int, str, list[int]]]:
    """4 ranks as 2 replicas of 2 shards each (the "shard" dimension of a 2 x 2 mesh: ranks 0-1
    and 2-3), each replica training on its own, so the diagnostics gather over 2 ranks only; a
    NaN in global rank 3's grad of the NaN target. The first-NaN events: (step, param, ranks)."""
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_patch.optimizer import fully_shard_optimizer

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replica", "shard"))["shard"]
    with environment(**ALL, FSDP_PATCH_PRECISION_EVERY="1"), in_memory_otel() as (exporter, _):
        model = attribution_model(kind, mesh)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        fully_shard_optimizer(optimizer)
        tokens = models.rank_slice(models.make_batches(1)[0], mesh.get_local_rank(), mesh.size())
        models.lm_loss(model, tokens).backward()
        if dist.get_rank() == 3:
            with torch.no_grad():
                dict(model.named_parameters())[SCENARIOS["nan"].target].grad.to_local().view(-1)[0] = float("nan")
        optimizer.step()
        firsts = span_findings(list(exporter.get_finished_spans()))["firsts"]
    return [(f[semconv.ATTR_STEP], f[semconv.ATTR_PARAM], list(f[semconv.ATTR_RANKS])) for f in firsts]


@pytest.mark.parametrize("kind", KINDS)
def test_ranks_are_named_globally_when_the_diagnostics_gather_over_some_ranks(dist_pool, kind: str) -> None:
    """The first NaN/Inf names the global rank that holds it, not its place among the ranks the
    diagnostics gathered over; the other replica, whose grads are finite, names nothing."""
    got = dist_pool(4).run(nan_on_a_sub_mesh, kind)
    want = [[], [], [(1, SCENARIOS["nan"].target, [3])], [(1, SCENARIOS["nan"].target, [3])]]
    assert got == want, f"{kind}: first-NaN events (step, param, ranks) per rank: want {want}, got {got}"
