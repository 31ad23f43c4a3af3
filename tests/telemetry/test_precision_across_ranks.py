"""The diagnostics of a real 2-rank step, read where users read them: the precision span's
attributes and the metrics, on every rank, with local values chosen so that each cross-rank
reduction and each attribute shows a value no other reduction or attribute would give.

Rank 0's grads have max |g| 1, rank 1's max |g| 2: the global grad amax is 2 (a sum over ranks
reads 3, a rank's own value 1 or 2 on one rank only). Rank 0 plants 3 main-weight elements past
fp16's range (refresh overflow), rank 1 plants 5 below fp16's smallest subnormal (refresh
underflow): 3 and 5 globally, which swapped attributes would read as 5 and 3.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from fsdp_patch.telemetry import semconv

from tests import models
from tests.integration.otel_training import environment, in_memory_otel, metric_values

WORLD = 2
GRAD_MAX = (1.0, 2.0)  # max |grad| per rank
OVERFLOW, UNDERFLOW = 3, 5  # planted on rank 0 and rank 1


def _planted_model() -> tuple[torch.nn.Module, torch.optim.Optimizer, int]:
    """fp16 compute weights sharded over the ranks, grads and main weights planted as the module says.

    Returns the model, its adapted optimizer (SGD with lr 0: the step leaves the planted main
    weights as they are, and the refresh casts them) and this rank's count of main-weight
    elements that underflow fp16 before planting (0 expected, so that only the plant counts).
    """
    from fsdp_patch.optimizer import fully_shard_optimizer

    rank = dist.get_rank()
    model = models.shard_model(models.make_model(0).half())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    fully_shard_optimizer(optimizer)
    tokens = models.rank_slice(models.make_batches(1)[0], rank, WORLD)
    models.lm_loss(model, tokens).backward()
    with torch.no_grad():
        natural = sum(int(((p.to_local() != 0) & (p.to_local().half() == 0)).sum()) for p in model.parameters())
        for param in model.parameters():
            param.grad.to_local().zero_()
        model.head.weight.grad.to_local().view(-1)[0] = -GRAD_MAX[rank]  # |g| counts, not the sign
        pos = model.pos.to_local().view(-1)
        if rank == 0:
            pos[:OVERFLOW] = 7.0e4  # finite in the fp32 main weight, Inf once refreshed to fp16
        else:
            pos[:UNDERFLOW] = 1.0e-9  # non-zero in the main weight, 0 once refreshed to fp16
    return model, optimizer, natural


def planted_step() -> dict[str, Any]:
    """One adapted, diagnosed step with telemetry on; the precision span's attributes and the metrics."""
    with environment(FSDP_PATCH_TELEMETRY="1", FSDP_PATCH_PRECISION_EVERY="1"), in_memory_otel() as (spans, reader):
        model, optimizer, natural = _planted_model()
        optimizer.step()
        precision_spans = [dict(s.attributes) for s in spans.get_finished_spans() if s.name == semconv.SPAN_PRECISION]
        points = metric_values(reader)
    rank = dist.get_rank()
    own = {
        name: [value for attrs, value in values if attrs.get(semconv.ATTR_RANK) == rank]
        for name, values in points.items()
    }
    return {"natural_underflow": natural, "precision_spans": precision_spans, "points": own}


def test_a_diagnosed_step_reports_global_values_under_the_right_names(dist_pool) -> None:
    results = dist_pool(WORLD).run(planted_step)
    natural = sum(r["natural_underflow"] for r in results)
    assert natural == 0, (
        f"the model's own weights underflow fp16 in {natural} elements: the planted counts would not be exact"
    )
    want = {
        semconv.METRIC_GRAD_AMAX: max(GRAD_MAX),
        semconv.METRIC_REFRESH_OVERFLOW: OVERFLOW,
        semconv.METRIC_REFRESH_UNDERFLOW: UNDERFLOW,
    }
    for rank, result in enumerate(results):
        (span,) = result["precision_spans"]
        got = {key: span[key] for key in want}
        assert got == want, (
            f"rank {rank}: the precision span reads {got}, want {want} (local grad max {GRAD_MAX[rank]})"
        )
        points = result["points"]
        got_metrics = {key: points[key] for key in want}
        want_metrics = {key: [value] for key, value in want.items()}
        assert got_metrics == want_metrics, f"rank {rank}: the metrics read {got_metrics}, want {want_metrics}"
        assert span[semconv.METRIC_NONFINITE] == OVERFLOW, (
            f"rank {rank}: {span[semconv.METRIC_NONFINITE]} non-finite elements, want the {OVERFLOW} overflowed to Inf"
        )


def planted_stats() -> dict[str, float]:
    """The diagnostics' own result for the planted groups: snapshot before the step, stats after it."""
    from fsdp_patch.telemetry.diagnostics import precision
    from fsdp_patch.telemetry.diagnostics.groups import take_snapshot

    from fsdp_patch import parameter_groups

    model, optimizer, _ = _planted_model()
    groups = parameter_groups(model)
    snapshot = take_snapshot(groups)
    optimizer.step()  # telemetry is off here: the adapter refreshes the compute weights
    stats = precision.compute_stats(snapshot, groups)
    return {"grad_amax": stats.grad_amax, "overflow": stats.overflow, "underflow": stats.underflow}


def test_the_stats_of_a_diagnosed_step_take_the_largest_local_grad_max(dist_pool) -> None:
    results = dist_pool(WORLD).run(planted_stats)
    want = {"grad_amax": max(GRAD_MAX), "overflow": OVERFLOW, "underflow": UNDERFLOW}
    for rank, got in enumerate(results):
        assert got == want, f"rank {rank}: compute_stats gives {got}, want {want} (local grad max {GRAD_MAX[rank]})"
