"""Tensor parallel x FSDP: ``fully_shard(module, mesh=mesh["dp"])`` over modules whose
parameters ``parallelize_module`` made DTensors on ``mesh["tp"]``, on 4 gloo ranks, a 2 x 2
("dp", "tp") mesh, against torch's FSDP2 on the same mesh and against the unsharded model.

The two ranks of a tensor-parallel group see the same rows of each batch; the two
data-parallel groups see different rows, so the grads, reduced over "dp", are those of the
whole batch. The feed-forward's plan covers the three ways a TP parameter is placed:
``fc1`` colwise (``Shard(0)``: FSDP shards dim 0 again, ``_StridedShard``), ``fc2`` rowwise
(weight ``Shard(1)``, bias ``Replicate()``); the norms, input layer and head stay plain
parameters sharded over "dp" alone.
"""

from __future__ import annotations

import tempfile
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from tests.comparison import assert_as_fsdp2_and_reference, full_state, max_abs_difference
from tests.fsdp.pattern_models import FeedForward
from tests.fsdp.reduction_settings import assert_hook_inputs_alike

WORLD_SIZE = 4
IN, DIM, HIDDEN, OUT = 6, 8, 14, 5
BATCH = 8
STEPS = 3
LR = 0.05
BF16 = torch.bfloat16
REFERENCE_TOL = 1e-5


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.ff = FeedForward(DIM, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ff(self.norm(x))


class Net(nn.Module):
    """Input layer, two blocks, head; ``checkpointed``: each block under activation checkpointing."""

    def __init__(self, checkpointed: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(IN, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(DIM, OUT)
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=False) if self.checkpointed else block(h)
        return self.head(h)


def data(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (torch.randn(BATCH, IN, generator=generator), torch.randn(BATCH, OUT, generator=generator))
        for _ in range(steps)
    ]


def _mesh() -> DeviceMesh:
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def _dp_rows(tensor: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """This rank's data-parallel share of a batch: the rows of its "dp" coordinate."""
    return tensor.chunk(mesh.size(0))[mesh.get_local_rank(0)]


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().float().clone()


def _build(impl: str, precision: str, mesh: DeviceMesh | None, seed: int = 0, checkpointed: bool = False) -> Net:
    torch.manual_seed(seed)
    model = Net(checkpointed)
    if impl == "reference":
        return model
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for block in model.blocks:
        parallelize_module(block.ff, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    if impl == "ours":
        from fsdp_patch import MixedPrecisionPolicy, fully_shard
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # type: ignore[assignment]
    policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32) if precision == "bf16" else None
    kwargs: dict[str, Any] = {"mesh": mesh["dp"], **({"mp_policy": policy} if policy is not None else {})}
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def tp_run(
    impl: str, precision: str, microbatches: int, telemetry: bool = False, checkpointed: bool = False
) -> dict[str, Any]:
    """Trains ``STEPS`` SGD steps, ``microbatches`` per step (gradient sync off on all but the
    last), the blocks under activation checkpointing if ``checkpointed``."""
    from tests.integration.otel_training import environment, in_memory_otel

    settings = {"FSDP_PATCH_TELEMETRY": "1", "FSDP_PATCH_PRECISION_EVERY": "1"} if telemetry else {}
    with environment(**settings), in_memory_otel():
        mesh = None if impl == "reference" else _mesh()
        model = _build(impl, precision, mesh, checkpointed=checkpointed)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
        if impl == "ours":
            from fsdp_patch.optimizer import fully_shard_optimizer

            fully_shard_optimizer(optimizer)
        losses = []
        for x, y in data(STEPS):
            if mesh is not None:
                x, y = _dp_rows(x, mesh), _dp_rows(y, mesh)
            for micro, (xm, ym) in enumerate(zip(x.chunk(microbatches), y.chunk(microbatches), strict=True)):
                if impl != "reference":
                    model.set_requires_gradient_sync(micro == microbatches - 1)
                loss = F.mse_loss(model(xm).float(), ym) / microbatches
                loss.backward()
                losses.append(loss.item())
            optimizer.step()
            optimizer.zero_grad()
        placements = {n: str(tuple(p.placements)) for n, p in model.named_parameters() if isinstance(p, DTensor)}
        params = {n: _full(p) for n, p in model.named_parameters()}
    return {"losses": losses, "params": params, "placements": placements}


@pytest.mark.parametrize(("microbatches", "checkpointed"), [(1, False), (2, False), (1, True)])
def test_tp_fsdp_fp32_matches_fsdp2_bitwise_and_the_unsharded_model(run_once, microbatches, checkpointed) -> None:
    ours = run_once(WORLD_SIZE, tp_run, "ours", "fp32", microbatches, False, checkpointed)
    fsdp2 = run_once(WORLD_SIZE, tp_run, "fsdp2", "fp32", microbatches, False, checkpointed)
    reference = run_once(1, tp_run, "reference", "fp32", microbatches, False, checkpointed)[0]
    assert ours[0]["placements"] == fsdp2[0]["placements"], (
        f"placements: ours {ours[0]['placements']}, FSDP2 {fsdp2[0]['placements']}"
    )
    assert_as_fsdp2_and_reference(
        [run["params"] for run in ours], [run["params"] for run in fsdp2], reference["params"], REFERENCE_TOL
    )


def test_tp_fsdp_bf16_compute_matches_fsdp2(run_once) -> None:
    ours = run_once(WORLD_SIZE, tp_run, "ours", "bf16", 1)
    fsdp2 = run_once(WORLD_SIZE, tp_run, "fsdp2", "bf16", 1)
    for rank in range(WORLD_SIZE):
        assert ours[rank]["losses"] == fsdp2[rank]["losses"], (
            f"rank {rank}: losses ours {ours[rank]['losses']}, FSDP2 {fsdp2[rank]['losses']}"
        )
        diff, where = max_abs_difference(ours[rank]["params"], fsdp2[rank]["params"])
        assert diff == 0.0, f"rank {rank}: ours (bf16) differs from FSDP2 (bf16) by {diff:.3g} at {where}"


def test_tp_fsdp_trains_bitwise_alike_with_telemetry_on_and_off(run_once) -> None:
    off = run_once(WORLD_SIZE, tp_run, "ours", "bf16", 2, False)
    on = run_once(WORLD_SIZE, tp_run, "ours", "bf16", 2, True)
    for rank in range(WORLD_SIZE):
        assert on[rank]["losses"] == off[rank]["losses"], (
            f"rank {rank}: losses {on[rank]['losses']} != {off[rank]['losses']}"
        )
        diff, where = max_abs_difference(on[rank]["params"], off[rank]["params"])
        assert diff == 0.0, f"rank {rank}: weights with telemetry differ by {diff:.3g} at {where}"


def tp_reduction_run(impl: str, setting: str) -> dict[str, Any]:
    """Trains ``STEPS`` SGD steps with one of FSDP2's reduction settings
    (``reduction_settings.REDUCTIONS``) on every unit: each step's grads (before the step) and the
    final weights, whole; the reference trains on its loss times the setting's scale of the mean
    grads over the 2 data-parallel ranks."""
    from tests.fsdp.reduction_settings import REDUCTIONS, Seen, apply_reduction

    mesh = None if impl == "reference" else _mesh()
    model = _build(impl, "fp32", mesh)
    seen = Seen()
    if impl != "reference":
        apply_reduction([model, *model.blocks], impl, setting, seen)
    scale = REDUCTIONS[setting].scale(2) if impl == "reference" else 1.0
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    if impl == "ours":
        from fsdp_patch.optimizer import fully_shard_optimizer

        fully_shard_optimizer(optimizer)
    grads: dict[str, torch.Tensor] = {}
    for step, (x, y) in enumerate(data(STEPS)):
        if mesh is not None:
            x, y = _dp_rows(x, mesh), _dp_rows(y, mesh)
        seen.backward()
        (F.mse_loss(model(x), y) * scale).backward()
        grads.update({f"step {step} {n}": _full(p.grad) for n, p in model.named_parameters() if p.grad is not None})
        optimizer.step()
        optimizer.zero_grad()
    params = {n: _full(p) for n, p in model.named_parameters()}
    return {"grads": grads, "params": params, "facts": seen.facts()}


@pytest.mark.parametrize("setting", ["force_sum", "custom_reduce_scatter", "divide_factor", "all_reduce_hook"])
def test_tp_fsdp_reduction_settings_match_fsdp2_and_the_unsharded_model(run_once, setting) -> None:
    """A summed reduction, a custom reduce-scatter, a divide factor or an all-reduce hook under
    TP x FSDP: the grads are reduced over the 2 "dp" ranks only (not the 4 of the world), each step's
    grads and the final weights bitwise FSDP2's and as the unsharded model's (its loss scaled as the
    setting scales the mean grads)."""
    ours = run_once(WORLD_SIZE, tp_reduction_run, "ours", setting)
    fsdp2 = run_once(WORLD_SIZE, tp_reduction_run, "fsdp2", setting)
    reference = run_once(1, tp_reduction_run, "reference", setting)[0]
    for what in ("grads", "params"):
        assert_as_fsdp2_and_reference(
            [run[what] for run in ours], [run[what] for run in fsdp2], reference[what], REFERENCE_TOL
        )
    for rank, (got, want) in enumerate(zip(ours, fsdp2, strict=True)):
        # fully_shard keeps a block's TP-split parameters and its others in two parameter groups,
        # each reduced (and hooked) apart: 5 reduce-scatters per backward where FSDP2 runs one per
        # unit, 3. The hook's inputs are compared per backward, whole.
        assert_hook_inputs_alike(got["facts"]["hook_inputs"], want["facts"]["hook_inputs"], f"rank {rank}", False)
        got_sizes, want_sizes = got["facts"]["reduce_scatter_group_sizes"], want["facts"]["reduce_scatter_group_sizes"]
        assert got_sizes == want_sizes, f"rank {rank}: reduce-scatters over groups of {got_sizes}, FSDP2's {want_sizes}"
    if setting == "custom_reduce_scatter":
        got_facts = ours[0]["facts"]
        got = (got_facts["reduce_scatters"], got_facts["reduce_scatter_group_sizes"])
        assert got == (5 * STEPS, [2]), (
            f"want the custom reduce-scatter called 5 times a step over the 2 dp ranks, got {got}"
        )
    if setting == "all_reduce_hook":
        got_calls = [len(calls) for calls in ours[0]["facts"]["hook_inputs"]]
        assert got_calls == [5] * STEPS, f"hook calls per backward: want one per parameter group, got {got_calls}"


def _build_layout(layout: str, seed: int) -> Net:
    """``"ours-tp"``, ``"fsdp2-tp"``: TP x FSDP on 2 x 2; ``"ours-1d"``: fully_shard over all 4 ranks, no TP."""
    if layout == "ours-1d":
        from fsdp_patch import MixedPrecisionPolicy, fully_shard

        torch.manual_seed(seed)
        model = Net()
        policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, mp_policy=policy)
        return fully_shard(model, mp_policy=policy)
    return _build(layout.removesuffix("-tp"), "bf16", _mesh(), seed)


def checkpoint_run(saved_by: str, loaded_by: str) -> dict[str, Any]:
    """DCP: a model and its AdamW state saved after two steps by one layout, loaded into a model
    of another seed built by another layout: every tensor, whole, as saved; the next step's loss
    is the same."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from fsdp_patch.optimizer import fully_shard_optimizer, init_optimizer_state

    mesh = _mesh()
    batches = [(_dp_rows(x, mesh), _dp_rows(y, mesh)) for x, y in data(3)]

    def trained(layout: str, seed: int, steps: int) -> tuple[Net, torch.optim.Optimizer]:
        model = _build_layout(layout, seed)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if layout.startswith("ours"):
            fully_shard_optimizer(optimizer)
        for x, y in batches[:steps]:
            F.mse_loss(model(x).float(), y).backward()
            optimizer.step()
            optimizer.zero_grad()
        return model, optimizer

    directory = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(directory, src=0)
    model, optimizer = trained(saved_by, 0, 2)
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=directory[0])
    saved = full_state(model, optimizer)

    other, other_optimizer = trained(loaded_by, 1, 0)
    if loaded_by.startswith("ours"):
        init_optimizer_state(other_optimizer)
    else:  # FSDP2's AdamW has its state after a step (the load overwrites what it moved)
        for param in other.parameters():
            param.grad = torch.zeros_like(param)
        other_optimizer.step()
        other_optimizer.zero_grad()
    model_state, optim_state = get_state_dict(other, other_optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=directory[0])
    set_state_dict(other, other_optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    loaded = full_state(other, other_optimizer)
    x, y = batches[2]
    losses = [F.mse_loss(net(x).float(), y).item() for net in (model, other)]
    diff, where = max_abs_difference(loaded, saved)
    return {
        "keys": sorted(saved) == sorted(loaded),
        "diff": diff,
        "where": where,
        "losses": losses,
        "missing": sorted(set(saved) ^ set(loaded)),
    }


@pytest.mark.parametrize(
    ("saved_by", "loaded_by"),
    [
        ("ours-tp", "ours-tp"),
        ("ours-tp", "ours-1d"),
        ("ours-1d", "ours-tp"),
        ("ours-tp", "fsdp2-tp"),
        ("fsdp2-tp", "ours-tp"),
    ],
    ids=str,
)
def test_dcp_round_trips_and_reshards_tp_fsdp_checkpoints_bitwise(run_once, saved_by, loaded_by) -> None:
    for rank, got in enumerate(run_once(WORLD_SIZE, checkpoint_run, saved_by, loaded_by)):
        assert got["keys"], f"rank {rank}: saved and loaded tensors differ in name: {got['missing']}"
        assert got["diff"] == 0.0, (
            f"rank {rank}: saved by {saved_by}, loaded by {loaded_by}: differs by {got['diff']:.3g} at {got['where']}"
        )
        # The same weights give the same loss; bitwise where both compute alike (TP splits the
        # bf16 matmuls, the 1-D layout does not).
        saved_loss, loaded_loss = got["losses"]
        tolerance = 0.0 if saved_by.endswith("-tp") and loaded_by.endswith("-tp") else 1e-2 * abs(saved_loss)
        assert abs(loaded_loss - saved_loss) <= tolerance, (
            f"rank {rank}: next loss {loaded_loss} from the loaded model, want {saved_loss} (within {tolerance:.3g})"
        )


def refusal_run(case: str) -> dict[str, Any]:
    """fully_shard over a TP model it does not support: the error, and the module afterwards."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    from fsdp_patch import fully_shard

    torch.manual_seed(0)
    block = Block()
    if case == "hsdp":
        mesh = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("replicate", "shard", "tp"))
        dp_mesh, tp_mesh = mesh["replicate", "shard"], mesh["tp"]
    else:  # a TP mesh that is not a dimension of the data-parallel mesh's mesh
        dp_mesh = _mesh()["dp"]
        tp_mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    fc1 = block.ff.fc1
    fc1.weight = nn.Parameter(distribute_tensor(fc1.weight.detach(), tp_mesh, [Replicate()]))
    before = {n: (type(p).__name__, _full(p)) for n, p in block.named_parameters()}
    try:
        fully_shard(block, mesh=dp_mesh)
        error = "accepted"
    except NotImplementedError as raised:
        error = str(raised)
    after = {n: (type(p).__name__, _full(p)) for n, p in block.named_parameters()}
    untouched = before.keys() == after.keys() and all(
        before[n][0] == after[n][0] and torch.equal(before[n][1], after[n][1]) for n in before
    )
    return {"error": error, "untouched": untouched, "class": type(block).__name__}


@pytest.mark.parametrize(
    ("case", "want"),
    [
        ("hsdp", "HSDP x tensor parallel (a 3-D mesh) is not supported"),
        ("foreign_mesh", "are not two dimensions of one mesh"),
    ],
)
def test_unsupported_tensor_parallel_layouts_are_refused_before_anything_changes(run_once, case, want) -> None:
    got = run_once(WORLD_SIZE, refusal_run, case)[0]
    assert "parameter 'ff.fc1.weight' is a DTensor" in got["error"] and want in got["error"], got["error"]
    assert "parallelize_module over mesh['tp']" in got["error"], f"the error names no alternative: {got['error']}"
    assert got["untouched"] and got["class"] == "Block", f"the refused module changed: {got}"
