"""HSDP: ``fully_shard(module, mesh=<2-D mesh>)`` on 4 gloo ranks, a 2 x 2 mesh (dim 0 replicates,
dim 1 shards), against torch's FSDP2 on the same mesh and against the unsharded model.

Each of the 4 ranks trains on its own rows of every batch (data parallel over all 4), so the
grads, reduce-scattered over the shard dimension and all-reduced over the replicas, are those of
the whole batch: the unsharded model's. Covered: fp32 and bf16 compute, microbatches without
sync, microbatches that reduce-scatter but skip the all-reduce (``set_requires_all_reduce``),
the optimizer adapter with telemetry on and off, DCP save and load, the parameters' placements.
"""

from __future__ import annotations

import tempfile
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from tests.comparison import assert_as_fsdp2_and_reference, full_state, max_abs_difference, whole
from tests.fsdp.pattern_models import BATCH, Net, data, rows
from tests.fsdp.reduction_settings import assert_hook_inputs_alike

WORLD_SIZE = 4
STEPS = 3
LR = 0.05
BF16 = torch.bfloat16
REFERENCE_TOL = 1e-5


def _mesh(shape: tuple[int, ...] = (2, 2)) -> Any:
    names = ("replicate", "shard") if len(shape) == 2 else ("shard",)
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _build(impl: str, precision: str, shape: tuple[int, ...] = (2, 2), seed: int = 0, outer: str = "none") -> Net:
    torch.manual_seed(seed)
    model = Net(norm=True, outer=outer)
    if impl == "reference":
        return model
    if impl == "ours":
        from fsdp_patch import MixedPrecisionPolicy, fully_shard
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # type: ignore[assignment]
    policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32) if precision == "bf16" else None
    kwargs: dict[str, Any] = {"mesh": _mesh(shape), **({"mp_policy": policy} if policy is not None else {})}
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def hsdp_run(
    impl: str, precision: str, microbatches: int, skip: str, telemetry: bool = False, outer: str = "none"
) -> dict[str, Any]:
    """Trains ``STEPS`` steps; ``skip`` on the microbatches before the last: ``"sync"`` (no
    gradient sync), ``"all_reduce"`` (reduce-scatter only) or ``"none"``; ``outer``: activation
    checkpointing of each block (``"none"``, ``"non_reentrant"``, ``"reentrant"``)."""
    from tests.integration.otel_training import environment, in_memory_otel

    rank, world_size = dist.get_rank(), dist.get_world_size()
    settings = {"FSDP_PATCH_TELEMETRY": "1", "FSDP_PATCH_PRECISION_EVERY": "1"} if telemetry else {}
    with environment(**settings), in_memory_otel():
        model = _build(impl, precision, outer=outer)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
        if impl == "ours":
            from fsdp_patch.optimizer import fully_shard_optimizer

            fully_shard_optimizer(optimizer)
        losses = []
        for x, y in data(STEPS):
            if impl != "reference":
                x, y = rows(x, rank, world_size), rows(y, rank, world_size)
            for micro, (xm, ym) in enumerate(zip(x.chunk(microbatches), y.chunk(microbatches), strict=True)):
                last = micro == microbatches - 1
                if impl != "reference" and skip == "sync":
                    model.set_requires_gradient_sync(last)
                if impl != "reference" and skip == "all_reduce":
                    model.set_requires_all_reduce(last)
                loss = F.mse_loss(model(xm).float(), ym) / microbatches
                loss.backward()
                losses.append(loss.item())
            optimizer.step()
            optimizer.zero_grad()
        placements = sorted({str(tuple(p.placements)) for p in model.parameters() if isinstance(p, DTensor)})
        params = {n: whole(p) for n, p in model.named_parameters()}
    return {"losses": losses, "params": params, "placements": placements}


@pytest.mark.parametrize(
    ("microbatches", "skip", "outer"),
    [(1, "none", "none"), (2, "sync", "none"), (2, "all_reduce", "none"), (1, "none", "non_reentrant")],
)
def test_hsdp_fp32_matches_fsdp2_bitwise_and_the_unsharded_model(run_once, microbatches, skip, outer) -> None:
    ours = run_once(WORLD_SIZE, hsdp_run, "ours", "fp32", microbatches, skip, False, outer)
    fsdp2 = run_once(WORLD_SIZE, hsdp_run, "fsdp2", "fp32", microbatches, skip, False, outer)
    reference = run_once(1, hsdp_run, "reference", "fp32", microbatches, "none", False, outer)[0]
    want_placements = ["(Replicate(), Shard(dim=0))"]
    assert fsdp2[0]["placements"] == ours[0]["placements"] == want_placements, (
        ours[0]["placements"],
        fsdp2[0]["placements"],
    )
    assert_as_fsdp2_and_reference(
        [run["params"] for run in ours], [run["params"] for run in fsdp2], reference["params"], REFERENCE_TOL
    )


def test_hsdp_bf16_compute_matches_fsdp2(run_once) -> None:
    ours = run_once(WORLD_SIZE, hsdp_run, "ours", "bf16", 1, "none")
    fsdp2 = run_once(WORLD_SIZE, hsdp_run, "fsdp2", "bf16", 1, "none")
    for rank in range(WORLD_SIZE):
        diff, where = max_abs_difference(ours[rank]["params"], fsdp2[rank]["params"])
        assert diff == 0.0, f"rank {rank}: ours (bf16) differs from FSDP2 (bf16) by {diff:.3g} at {where}"


def test_hsdp_trains_bitwise_alike_with_telemetry_on_and_off(run_once) -> None:
    off = run_once(WORLD_SIZE, hsdp_run, "ours", "bf16", 2, "sync", False)
    on = run_once(WORLD_SIZE, hsdp_run, "ours", "bf16", 2, "sync", True)
    for rank in range(WORLD_SIZE):
        assert on[rank]["losses"] == off[rank]["losses"], (
            f"rank {rank}: losses {on[rank]['losses']} != {off[rank]['losses']}"
        )
        diff, where = max_abs_difference(on[rank]["params"], off[rank]["params"])
        assert diff == 0.0, f"rank {rank}: weights with telemetry differ by {diff:.3g} at {where}"


def hsdp_reduction_run(impl: str, setting: str, shape: tuple[int, ...], skip: str = "none") -> dict[str, Any]:
    """Trains ``STEPS`` steps of 2 microbatches with one of FSDP2's reduction settings
    (``reduction_settings.REDUCTIONS``) on every unit; ``skip`` on the first microbatch:
    ``"all_reduce"`` (reduce-scatter only) or ``"none"``. Returns each step's grads (before the
    step) and the final weights, whole; the reference trains on its loss times the setting's
    scale of the mean grads."""
    from tests.fsdp.reduction_settings import REDUCTIONS, Seen, apply_reduction

    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = _build("reference" if impl == "reference" else impl, "fp32", shape)
    seen = Seen()
    if impl != "reference":
        apply_reduction([model, *model.blocks], impl, setting, seen)
    scale = REDUCTIONS[setting].scale(WORLD_SIZE) if impl == "reference" else 1.0
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    if impl == "ours":
        from fsdp_patch.optimizer import fully_shard_optimizer

        fully_shard_optimizer(optimizer)
    grads: dict[str, torch.Tensor] = {}
    for step, (x, y) in enumerate(data(STEPS)):
        if impl != "reference":
            x, y = rows(x, rank, world_size), rows(y, rank, world_size)
        for micro, (xm, ym) in enumerate(zip(x.chunk(2), y.chunk(2), strict=True)):
            if impl != "reference" and skip == "all_reduce":
                model.set_requires_all_reduce(micro == 1)
            seen.backward()
            (F.mse_loss(model(xm), ym) * scale / 2).backward()
        grads.update({f"step {step} {n}": whole(p.grad) for n, p in model.named_parameters() if p.grad is not None})
        optimizer.step()
        optimizer.zero_grad()
    params = {n: whole(p) for n, p in model.named_parameters()}
    return {"grads": grads, "params": params, "facts": seen.facts()}


# (setting, mesh shape, skip): each reduction setting on the 2 x 2 mesh; force-sum also with the
# all-reduce skipped on the first microbatch (the held reduce-scatter output is divided as the
# all-reduced one is) and on a 4 x 1 mesh (no reduce-scatter: the all-reduce over 4 replicas alone).
HSDP_REDUCTIONS = [
    ("force_sum", (2, 2), "none"),
    ("force_sum", (2, 2), "all_reduce"),
    ("force_sum", (4, 1), "none"),
    ("custom_reduce_scatter", (2, 2), "none"),
    ("custom_reduce_scatter", (2, 2), "all_reduce"),
    ("divide_factor", (2, 2), "none"),
    ("divide_factor_force_sum", (2, 2), "none"),
    ("all_reduce_hook", (2, 2), "none"),
    ("separate_reduce_scatter_group_force_sum", (2, 2), "none"),
]


@pytest.mark.parametrize(
    ("setting", "shape", "skip"), HSDP_REDUCTIONS, ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else v
)
def test_hsdp_reduction_settings_match_fsdp2_and_the_unsharded_model(run_once, setting, shape, skip) -> None:
    """HSDP with a summed reduction, a custom reduce-scatter, a divide factor or an all-reduce
    hook: each step's grads and the final weights as FSDP2's on the same mesh and as the unsharded
    model's (its loss scaled as the setting scales the mean grads). The root unit's head (5 rows
    over a shard dimension of 2) is sharded unevenly, 3 + 2 rows.

    Bitwise FSDP2's where 2 replicas sum (exact in either order); over 4 replicas gloo adds in an
    order that follows the buffer's layout, which differs, so to float32 rounding."""
    ours = run_once(WORLD_SIZE, hsdp_reduction_run, "ours", setting, shape, skip)
    fsdp2 = run_once(WORLD_SIZE, hsdp_reduction_run, "fsdp2", setting, shape, skip)
    reference = run_once(1, hsdp_reduction_run, "reference", setting, shape)[0]
    for what in ("grads", "params"):
        if shape[0] == 2:
            assert_as_fsdp2_and_reference(
                [run[what] for run in ours], [run[what] for run in fsdp2], reference[what], REFERENCE_TOL
            )
            continue
        for rank, (got, control) in enumerate(zip(ours, fsdp2, strict=True)):
            for name, want, tolerance in (
                ("FSDP2", control[what], 1e-6),
                ("the unsharded model", reference[what], REFERENCE_TOL),
            ):
                diff, where = max_abs_difference(got[what], want)
                assert diff <= tolerance, f"rank {rank}: ours ({what}) differs from {name} by {diff:.3g} at {where}"
    for rank, (got, want) in enumerate(zip(ours, fsdp2, strict=True)):
        # FSDP2 calls the hook as each unit's reduce completes in backward (blocks.1, blocks.0,
        # the root); fully_shard as it completes the unit's all-reduce over the replicas, at the
        # end of backward, in forward order: the calls are compared in order of size.
        assert_hook_inputs_alike(got["facts"]["hook_inputs"], want["facts"]["hook_inputs"], f"rank {rank}", True)
        mine, theirs = ({k: v for k, v in run["facts"].items() if k != "hook_inputs"} for run in (got, want))
        assert mine == theirs, f"rank {rank}, {setting}: ours saw {mine}, FSDP2 {theirs}"
    if setting == "custom_reduce_scatter":
        want_sizes = [shape[1]]
        got_facts = ours[0]["facts"]
        assert got_facts["reduce_scatters"] > 0 and got_facts["reduce_scatter_group_sizes"] == want_sizes, (
            f"want the custom reduce-scatter called over the shard dimension ({want_sizes}), got {got_facts}"
        )
    if setting == "all_reduce_hook":
        got_calls = [len(calls) for calls in ours[0]["facts"]["hook_inputs"]]
        assert got_calls == [3] * 2 * STEPS, f"hook calls per backward: want one per unit, got {got_calls}"


def test_the_hsdp_model_shards_the_root_unevenly() -> None:
    """The HSDP tests' model has a parameter whose rows a shard dimension of 2 splits unevenly."""
    model = Net(norm=True)
    uneven = sorted(n for n, p in model.named_parameters() if p.shape[0] % 2)
    assert uneven == ["head.bias", "head.weight"], f"parameters with an odd number of rows: {uneven}"


def hsdp_checkpoint_run() -> dict[str, Any]:
    """DCP: save model and optimizer state of an HSDP model after a step, train on, load, and
    train the same step again: the reloaded run repeats the first bitwise."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from fsdp_patch.optimizer import fully_shard_optimizer, init_optimizer_state

    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = _build("ours", "bf16")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    fully_shard_optimizer(optimizer)
    batches = [(rows(x, rank, world_size), rows(y, rank, world_size)) for x, y in data(3)]

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        loss = F.mse_loss(model(x).float(), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.item()

    step(*batches[0])
    directory = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(directory, src=0)
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=directory[0])
    first = [step(*batches[1]), step(*batches[2])]
    after_first = {n: whole(p) for n, p in model.named_parameters()}
    init_optimizer_state(optimizer)
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=directory[0])
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    again = [step(*batches[1]), step(*batches[2])]
    diff, where = max_abs_difference({n: whole(p) for n, p in model.named_parameters()}, after_first)
    return {"first": first, "again": again, "diff": diff, "where": where}


def test_hsdp_checkpoint_round_trip_is_bitwise(run_once) -> None:
    for rank, got in enumerate(run_once(WORLD_SIZE, hsdp_checkpoint_run)):
        assert got["again"] == got["first"], f"rank {rank}: losses after reloading {got['again']} != {got['first']}"
        assert got["diff"] == 0.0, f"rank {rank}: weights after reloading differ by {got['diff']:.3g} at {got['where']}"


def reshard_checkpoint_run(saved_on: tuple[int, ...], loaded_on: tuple[int, ...]) -> dict[str, Any]:
    """DCP: a model and its AdamW state saved after two steps on one mesh shape, loaded into a
    model of another seed on another shape: every tensor, whole, as saved; one more step on each
    agrees too."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from fsdp_patch.optimizer import fully_shard_optimizer, init_optimizer_state

    rank, world_size = dist.get_rank(), dist.get_world_size()
    batches = [(rows(x, rank, world_size), rows(y, rank, world_size)) for x, y in data(3)]

    def trained(shape: tuple[int, ...], seed: int, steps: int) -> tuple[Net, torch.optim.Optimizer]:
        model = _build("ours", "bf16", shape, seed)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        fully_shard_optimizer(optimizer)
        for x, y in batches[:steps]:
            F.mse_loss(model(x).float(), y).backward()
            optimizer.step()
            optimizer.zero_grad()
        return model, optimizer

    directory = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(directory, src=0)
    model, optimizer = trained(saved_on, 0, 2)
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=directory[0])
    saved = full_state(model, optimizer)

    other, other_optimizer = trained(loaded_on, 1, 0)
    init_optimizer_state(other_optimizer)
    model_state, optim_state = get_state_dict(other, other_optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=directory[0])
    set_state_dict(other, other_optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    loaded = full_state(other, other_optimizer)
    placements = sorted({str(tuple(p.placements)) for p in other.parameters()})
    losses = []
    for net, opt in ((model, optimizer), (other, other_optimizer)):
        x, y = batches[2]
        loss = F.mse_loss(net(x).float(), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    diff, where = max_abs_difference(loaded, saved)
    return {
        "keys": sorted(saved) == sorted(loaded),
        "diff": diff,
        "where": where,
        "placements": placements,
        "losses": losses,
    }


@pytest.mark.parametrize(("saved_on", "loaded_on"), [((4,), (2, 2)), ((2, 2), (4,)), ((2, 2), (4, 1))], ids=str)
def test_dcp_reshards_between_mesh_shapes_bitwise(run_once, saved_on, loaded_on) -> None:
    for rank, got in enumerate(run_once(WORLD_SIZE, reshard_checkpoint_run, saved_on, loaded_on)):
        assert got["keys"], f"rank {rank}: the loaded state has other tensors than the saved one"
        assert got["diff"] == 0.0, f"rank {rank}: loaded on {loaded_on}, differs by {got['diff']:.3g} at {got['where']}"
        want = "((Shard(dim=0),)" if len(loaded_on) == 1 else "((Replicate(), Shard(dim=0))"
        assert got["placements"] == [want[1:]], f"rank {rank}: placements after loading {got['placements']}"
        # The next step: the same loss from the same weights; the update then follows the same
        # reduction only on equal mesh shapes, so only the loss is compared.
        assert got["losses"][0] == got["losses"][1], f"rank {rank}: next-step losses {got['losses']}"


def three_d_mesh_run() -> str:
    from fsdp_patch import fully_shard

    mesh = init_device_mesh("cpu", (1, 2, 2))
    try:
        fully_shard(nn.Linear(4, 4), mesh=mesh)
    except NotImplementedError as error:
        return str(error)
    return "accepted"


def test_a_3d_mesh_is_refused_naming_what_is_supported(run_once) -> None:
    got = run_once(WORLD_SIZE, three_d_mesh_run)[0]
    assert got.startswith("fully_shard supports 1-D meshes (FSDP) and 2-D meshes (HSDP"), got
    assert "got a 3-D mesh of shape (1, 2, 2)" in got, got


def test_batch_splits_over_four_ranks() -> None:
    assert BATCH % WORLD_SIZE == 0, f"the pattern batch of {BATCH} rows does not split over {WORLD_SIZE} ranks"


class _RecordedAllReduces:
    """``torch.distributed`` as ``fsdp_patch.sharding.collectives`` sees it, with each
    ``all_reduce`` it starts and each wait on it recorded in ``log``."""

    def __init__(self, log: list[tuple[str, int]]) -> None:
        self._log = log

    def __getattr__(self, name: str) -> Any:
        return getattr(dist, name)

    def all_reduce(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        index = sum(1 for event, _ in self._log if event == "issue")
        self._log.append(("issue", index))
        work = dist.all_reduce(tensor, *args, **kwargs)
        log = self._log

        class Recorded:
            def wait(self) -> Any:
                log.append(("wait", index))
                return work.wait() if work is not None else True

        return Recorded() if kwargs.get("async_op") else work


def all_reduce_overlap_run() -> list[tuple[str, Any]]:
    """One backward of the 2 x 2 HSDP model with no reduce-scatter left in flight: the order in
    which the all-reduces over the replicas start and complete, and blocks.0's backward begins."""
    from fsdp_patch.sharding import collectives

    model = _build("ours", "fp32")
    model.set_overlap_limits(reduce_scatters_in_flight=0)
    log: list[tuple[str, Any]] = []
    model.blocks[0].register_full_backward_pre_hook(lambda module, grad: log.append(("backward", "blocks.0")))
    x, y = data(1)[0]
    x, y = rows(x, dist.get_rank(), WORLD_SIZE), rows(y, dist.get_rank(), WORLD_SIZE)
    original = collectives.dist
    collectives.dist = _RecordedAllReduces(log)  # type: ignore[assignment]
    try:
        F.mse_loss(model(x), y).backward()
    finally:
        collectives.dist = original
    return log


def test_the_all_reduce_over_replicas_overlaps_the_rest_of_backward(run_once) -> None:
    """blocks.1's grads, reduce-scattered as its backward ends, start their all-reduce over the
    replicas before blocks.0's backward begins and complete after it: the all-reduce runs while
    backward goes on, as the reduce-scatter does (here none is left in flight, so only the
    all-reduce can overlap)."""
    for rank, log in enumerate(run_once(WORLD_SIZE, all_reduce_overlap_run)):
        got = [log.index(("issue", 0)), log.index(("backward", "blocks.0")), log.index(("wait", 0))]
        assert got == sorted(got), (
            f"rank {rank}: want blocks.1's all-reduce started, blocks.0's backward, then the all-reduce "
            f"completed; got the log {log}"
        )
        issued = sum(1 for event, _ in log if event == "issue")
        waited = sum(1 for event, _ in log if event == "wait")
        assert issued == waited == 3, f"rank {rank}: want 3 units' all-reduces started and completed, got {log}"
