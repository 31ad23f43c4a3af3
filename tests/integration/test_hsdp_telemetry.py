"""Telemetry on HSDP, on 4 gloo ranks: a 2 x 2 mesh (replicate, shard) against a 1-D mesh of 4.

The precision diagnostics gather over the ranks that shard a parameter, so each replica counts
the model's elements once: every count of a step equals the 1-D mesh's, and ratios agree to the
rounding by which averaging over 2 x 2 ranks differs from averaging over 4. Both ``fully_shard``
and torch's FSDP2.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from tests import models
from tests.integration.otel_training import environment, in_memory_otel, metric_values

WORLD_SIZE = 4
PLANTED_STEP = 2


def _plant_nan(model: torch.nn.Module) -> None:
    """One NaN in the head's main weight, element [0, 0], on every replica: written by the ranks
    whose shard holds row 0 (each replica's first shard rank)."""
    weight = model.head.weight
    local = weight.to_local()
    if weight.device_mesh.get_local_rank(weight.device_mesh.ndim - 1) == 0:
        with torch.no_grad():
            local[0, 0] = float("nan")


def hsdp_telemetry_run(impl: str, shape: tuple[int, ...]) -> dict[str, Any]:
    """Adapted AdamW, bf16 compute, diagnostics every step, a NaN planted in a main weight before
    the step of ``PLANTED_STEP`` (the run ends there): rank 0's precision metric points."""
    from fsdp_patch.optimizer import fully_shard_optimizer

    rank, world_size = dist.get_rank(), dist.get_world_size()
    names = ("replicate", "shard") if len(shape) == 2 else ("shard",)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    with environment(FSDP_PATCH_TELEMETRY="1", FSDP_PATCH_PRECISION_EVERY="1"), in_memory_otel() as (_, reader):
        model = models.make_model(0)
        if impl == "ours":
            from fsdp_patch import MixedPrecisionPolicy

            model = models.shard_model(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        else:
            from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy

            policy = TorchPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
            model = models.fsdp2_shard_model(model, mesh=mesh, mp_policy=policy)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        fully_shard_optimizer(optimizer)
        for step, tokens in enumerate(models.make_batches(PLANTED_STEP), start=1):
            models.lm_loss(model, models.rank_slice(tokens, rank, world_size)).backward()
            if step == PLANTED_STEP:
                _plant_nan(model)
            optimizer.step()
            optimizer.zero_grad()
        points = metric_values(reader)
    return {
        name: sorted(
            (tuple(sorted((k, v) for k, v in attrs.items() if k != "fsdp.rank")), value) for attrs, value in values
        )
        for name, values in points.items()
        if name.startswith("fsdp.precision")
    }


@pytest.mark.parametrize("impl", ["ours", "fsdp2"])
def test_hsdp_counts_each_model_element_once(dist_pool, impl) -> None:
    pool = dist_pool(WORLD_SIZE)
    hsdp = pool.run(hsdp_telemetry_run, impl, (2, 2))[0]
    flat = pool.run(hsdp_telemetry_run, impl, (WORLD_SIZE,))[0]
    assert sorted(hsdp) == sorted(flat), f"metrics on HSDP {sorted(hsdp)}, on a 1-D mesh {sorted(flat)}"
    counts = ("fsdp.precision.nonfinite", "fsdp.precision.steps", "fsdp.precision.nonfinite.steps",
              "fsdp.precision.refresh.overflow", "fsdp.precision.refresh.underflow")  # fmt: skip
    for name in counts:
        assert hsdp[name] == flat[name], f"{impl}: {name} on HSDP {hsdp[name]}, on a 1-D mesh {flat[name]}"
    planted = dict(hsdp["fsdp.precision.nonfinite"])
    key = (("fsdp.nonfinite.kind", "nan"), ("fsdp.tensor", "main_weight"))
    assert planted[key] == 1, f"{impl}: the one NaN planted on both replicas counted {planted[key]} times: {planted}"
    for name in ("fsdp.precision.grad.amax", "fsdp.precision.update.lost_ratio", "fsdp.precision.refresh.error"):
        (_, got), (_, want) = hsdp[name][0], flat[name][0]
        # Averaging over 2 x 2 ranks rounds (in bf16) otherwise than over 4.
        assert abs(got - want) <= 0.05 * abs(want), f"{impl}: {name} on HSDP {got}, on a 1-D mesh {want}"
