"""Rank functions of the torch FSDP2 telemetry tests: the small transformer sharded by
``torch.distributed.fsdp.fully_shard`` with ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)``,
an optimizer adapted with the one line ``fully_shard_optimizer(optimizer)``."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from tests import models
from tests.integration.rank_fns import environment, in_memory_otel, metric_points

COMPUTE_DTYPE = torch.bfloat16
PLANTED_STEP = 2


def fsdp2_model(seed: int = 0) -> torch.nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = models.make_model(seed)  # fp32 parameters: FSDP2 keeps them as the optimizer's main weights
    policy = MixedPrecisionPolicy(param_dtype=COMPUTE_DTYPE, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _lost_counts(before: list[torch.Tensor], after: list[torch.Tensor]) -> tuple[int, int]:
    """This rank's (changed, lost) elements of one step, from the definition in docs/conventions.md: main
    weight bits changed; the bf16 cast FSDP2 gathers did not."""
    changed = lost = 0
    for b, a in zip(before, after, strict=True):
        moved = _bits(a) != _bits(b)
        kept = _bits(a.to(COMPUTE_DTYPE)) == _bits(b.to(COMPUTE_DTYPE))
        changed += int(moved.sum())
        lost += int((moved & kept).sum())
    return changed, lost


def fsdp2_training(scenario: str, telemetry_on: bool, steps: int = 3) -> dict[str, Any]:
    """Trains with Adam; ``scenario``: ``normal`` (lr 1e-2), ``tiny_lr`` (1e-7), ``nan`` (a NaN in
    rank 0's grad at step PLANTED_STEP, after which training stops)."""
    from fsdp_patch.optimizer import fully_shard_optimizer

    rank, world_size = dist.get_rank(), dist.get_world_size()
    lr = 1e-7 if scenario == "tiny_lr" else 1e-2
    telemetry = "1" if telemetry_on else None
    with (
        environment(FSDP_PATCH_TELEMETRY=telemetry, FSDP_PATCH_PRECISION_EVERY="1"),
        in_memory_otel() as (spans, reader),
    ):
        model = fsdp2_model()
        optimizer = torch.optim.Adam(model.parameters(), lr=lr)
        fully_shard_optimizer(optimizer)
        last: tuple[int, int] = (0, 0)
        for step, tokens in enumerate(models.make_batches(steps), start=1):
            models.lm_loss(model, models.rank_slice(tokens, rank, world_size)).backward()
            if scenario == "nan" and step == PLANTED_STEP and rank == 0:
                with torch.no_grad():
                    _local(model.head.weight.grad).view(-1)[3] = float("nan")
            before = [_local(p).detach().clone() for p in model.parameters()]
            optimizer.step()
            last = _lost_counts(before, [_local(p).detach() for p in model.parameters()])
            optimizer.zero_grad()
            if scenario == "nan" and step == PLANTED_STEP:
                break
        finished = [
            {
                "name": s.name,
                "id": s.context.span_id,
                "parent": s.parent.span_id if s.parent else None,
                "attributes": dict(s.attributes),
            }
            for s in spans.get_finished_spans()
        ]
        points = metric_points(reader)
    return {
        "spans": finished,
        "points": points,
        "last_step_changed_lost": last,
        "main": [_local(p).detach().clone() for p in model.parameters()],
        "params": len(list(model.parameters())),
        "fsdp_groups": len(model.blocks) + 1,
    }
