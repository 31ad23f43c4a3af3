"""Telemetry on tensor parallel x FSDP, on 4 gloo ranks: a 2 x 2 ("dp", "tp") mesh against
``fully_shard`` over a 1-D mesh of 4 without tensor parallelism, the same model and policy.

The precision diagnostics reduce over the ranks that shard a parameter, then over the TP
ranks: a parameter tensor parallelism splits is summed over them, one each TP rank holds alike
(the norms, the input layer, the head, a rowwise bias) counted once. So every count of a step
equals the 1-D mesh's on every rank, whichever TP rank holds a planted NaN. Both ``fully_shard``
and torch's FSDP2.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.fsdp.test_tensor_parallel import BF16, Net, _dp_rows, _mesh, data
from tests.integration.otel_training import environment, in_memory_otel, metric_values

WORLD_SIZE = 4
PLANTED_STEP = 2
# The global rank whose shard of blocks.0.ff.fc1.weight (split by tensor parallelism) gets a NaN:
# on TP rank 1, which rank 0's data-parallel group does not include.
SPLIT_NAN_RANK = 3


def _build(impl: str, layout: str) -> Net:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if impl == "ours":
        from fsdp_patch import MixedPrecisionPolicy, fully_shard
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # type: ignore[assignment]
    torch.manual_seed(0)
    model = Net()
    if layout == "tp":
        mesh = _mesh()
        for block in model.blocks:
            parallelize_module(block.ff, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        dp_mesh = mesh["dp"]
    elif layout == "hsdp-tp":  # FSDP2 only: fully_shard refuses HSDP x TP
        mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("replicate", "shard", "tp"))
        for block in model.blocks:
            parallelize_module(block.ff, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        dp_mesh = mesh["replicate", "shard"]
    else:
        dp_mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=BF16)
    for block in model.blocks:
        fully_shard(block, mesh=dp_mesh, mp_policy=policy)
    fully_shard(model, mesh=dp_mesh, mp_policy=policy)
    return model


def _plant_nans(model: Net, head_too: bool) -> None:
    """NaNs in main weights: one in the first element of ``SPLIT_NAN_RANK``'s shard of a
    parameter tensor parallelism splits (on a 1-D mesh the same rank's shard), and with
    ``head_too`` one in the head's element [0, 0], which the ranks of data-parallel coordinate 0
    hold (on every TP rank alike)."""
    rank = dist.get_rank()
    split, head = model.blocks[0].ff.fc1.weight, model.head.weight
    with torch.no_grad():
        if rank == SPLIT_NAN_RANK:
            split.to_local().view(-1)[0] = float("nan")
        if head_too and head.device_mesh.get_local_rank(0) == 0:
            head.to_local()[0, 0] = float("nan")


def tp_telemetry_run(
    impl: str, layout: str, every: str = "1", steps: int = PLANTED_STEP, head_too: bool = True
) -> dict[str, Any]:
    """Adapted AdamW, bf16 compute, diagnostics every step, the NaNs planted before the step of
    ``PLANTED_STEP``, ``steps`` steps, diagnostics every ``every``: this rank's precision metric
    points, by name, the mesh coordinates its step spans name, and the steps it diagnosed."""
    from fsdp_patch.optimizer import fully_shard_optimizer

    rank = dist.get_rank()
    with environment(FSDP_PATCH_TELEMETRY="1", FSDP_PATCH_PRECISION_EVERY=every), in_memory_otel() as (spans, reader):
        model = _build(impl, layout)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        fully_shard_optimizer(optimizer)
        mesh = _mesh()
        for step, (x, y) in enumerate(data(steps), start=1):
            if layout != "1d":  # the data-parallel coordinate is rank // 2 on either mesh
                x, y = _dp_rows(x, mesh), _dp_rows(y, mesh)
            else:
                x, y = x.chunk(WORLD_SIZE)[rank], y.chunk(WORLD_SIZE)[rank]
            F.mse_loss(model(x).float(), y).backward()
            if step == PLANTED_STEP:
                _plant_nans(model, head_too)
            optimizer.step()
            optimizer.zero_grad()
        points = metric_values(reader)
        step_spans = [s for s in spans.get_finished_spans() if s.name == "fsdp.optimizer.step"]
        coordinates = sorted({str(s.attributes.get("fsdp.mesh.coordinate")) for s in step_spans})
        step_of = {s.context.span_id: s.attributes["fsdp.step"] for s in step_spans}
        diagnosed = sorted(
            step_of[s.parent.span_id] for s in spans.get_finished_spans() if s.name == "fsdp.optimizer.precision"
        )
    metrics = {
        name: sorted(
            (tuple(sorted((k, v) for k, v in attrs.items() if k != "fsdp.rank")), value) for attrs, value in values
        )
        for name, values in points.items()
        if name.startswith("fsdp.precision")
    }
    return {"metrics": metrics, "coordinates": coordinates, "diagnosed": diagnosed}


@pytest.mark.parametrize("impl", ["ours", "fsdp2"])
def test_tp_counts_each_model_element_once_on_every_rank(dist_pool, impl) -> None:
    pool = dist_pool(WORLD_SIZE)
    tp_runs = pool.run(tp_telemetry_run, impl, "tp")
    flat_run = pool.run(tp_telemetry_run, impl, "1d")[0]
    tp, flat = [run["metrics"] for run in tp_runs], flat_run["metrics"]
    got_coordinates = [run["coordinates"] for run in tp_runs]
    want_coordinates = [[f"dp={rank // 2},tp={rank % 2}"] for rank in range(WORLD_SIZE)]
    assert got_coordinates == want_coordinates, f"{impl}: step spans' mesh coordinates {got_coordinates}"
    assert flat_run["coordinates"] == ["None"], f"{impl}: a 1-D mesh names no coordinate: {flat_run['coordinates']}"
    counts = (
        "fsdp.precision.nonfinite",
        "fsdp.precision.steps",
        "fsdp.precision.nonfinite.steps",
        "fsdp.precision.refresh.overflow",
        "fsdp.precision.refresh.underflow",
    )
    key = (("fsdp.nonfinite.kind", "nan"), ("fsdp.tensor", "main_weight"))
    assert dict(flat["fsdp.precision.nonfinite"])[key] == 2, f"the 1-D control: {flat['fsdp.precision.nonfinite']}"
    for rank, got in enumerate(tp):
        assert sorted(got) == sorted(flat), f"{impl} rank {rank}: metrics with TP {sorted(got)}, 1-D {sorted(flat)}"
        for name in counts:
            assert got[name] == flat[name], (
                f"{impl} rank {rank}: {name} with TP {got[name]}, on a 1-D mesh {flat[name]}"
            )
        for name in ("fsdp.precision.grad.amax", "fsdp.precision.refresh.error"):
            (_, value), (_, want) = got[name][0], flat[name][0]
            # Tensor parallelism splits the bf16 matmuls: grads and roundings differ a little.
            assert abs(value - want) <= 0.05 * abs(want), f"{impl} rank {rank}: {name} with TP {value}, 1-D {want}"


@pytest.mark.parametrize("impl", ["ours", "fsdp2"])
def test_every_rank_escalates_together_when_one_tp_rank_sees_a_nan(dist_pool, impl) -> None:
    """At the default interval: the NaN written on rank 3's shard before step 2's update (alone)
    is seen by the checks of the ranks of its data-parallel group alone. Every rank must escalate
    at step 3 (the diagnostics gather over the TP ranks too): each diagnoses the same steps."""
    runs = dist_pool(WORLD_SIZE).run(tp_telemetry_run, impl, "tp", "100", 7, False)
    got = [run["diagnosed"] for run in runs]
    want = [[1, 2, 3, 4, 5]] * WORLD_SIZE  # the window 1-3, step 5; escalation: steps 3-5
    assert got == want, f"{impl}: want every rank diagnosed on {want[0]}, got per rank {got}"


def test_fsdp2_hsdp_x_tp_counts_once_and_escalates_together(dist_pool) -> None:
    """FSDP2 on a 3-D (replicate, shard, tp) = (2, 1, 2) mesh: the rows combined over the TP
    ranks, then over the replicas (the two NaNs lie on different replicas: each is counted once,
    and the replicas differ). Every count equals the 1-D mesh's on every rank; at the default
    interval, a NaN on one rank alone escalates every rank together."""
    pool = dist_pool(WORLD_SIZE)
    runs = pool.run(tp_telemetry_run, "fsdp2", "hsdp-tp")
    flat = pool.run(tp_telemetry_run, "fsdp2", "1d")[0]["metrics"]
    counts = ("fsdp.precision.nonfinite", "fsdp.precision.steps", "fsdp.precision.nonfinite.steps")
    for rank, run in enumerate(runs):
        for name in counts:
            got = run["metrics"][name]
            assert got == flat[name], f"rank {rank}: {name} on (2, 1, 2) {got}, on a 1-D mesh {flat[name]}"
        want = [f"replicate={rank // 2},shard=0,tp={rank % 2}"]
        assert run["coordinates"] == want, f"rank {rank}: mesh coordinate {run['coordinates']}, want {want}"
    diagnosed = [run["diagnosed"] for run in pool.run(tp_telemetry_run, "fsdp2", "hsdp-tp", "100", 7, False)]
    assert diagnosed == [[1, 2, 3, 4, 5]] * WORLD_SIZE, f"per rank, steps diagnosed {diagnosed}"
