"""``fully_shard``'s arguments and ``FSDPModule``'s methods as FSDP2 takes them: the arguments it
shares with FSDP2 train like FSDP2; those it refuses, and methods that cannot apply, are refused
naming why, the module left as it was; ``fully_shard([a, b])`` makes one unit of several modules
(a wrong list refused).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests.fsdp import pattern_models
from tests.fsdp.fsdp2_api import STEPS, WORLD_SIZE, Api, both, compare, full_copy, net, train
from tests.fsdp.pattern_models import Net, data, rows

# -- scripts (run on the ranks) -------------------------------------------------------------------


def arguments_script(impl: str, argument: str) -> dict[str, Any]:
    """One of ``fully_shard``'s other arguments, as FSDP2 takes it."""
    from torch.distributed.fsdp import OffloadPolicy
    from torch.distributed.tensor import Shard

    api = Api.of(impl)
    model = net()
    ignored = model.blocks[0].norm.weight
    kwargs: dict[str, Any] = {
        "ignored_params": {"ignored_params": {ignored}},
        "shard_placement_fn": {"shard_placement_fn": lambda p: Shard(0) if p.dim() == 2 else None},
        "offload_policy": {"offload_policy": OffloadPolicy()},
    }[argument]
    api.shard(model, **kwargs)
    result = train(api, model)
    result["facts"] = {"ignored": type(ignored).__name__ if argument == "ignored_params" else None}
    return result


# -- tests -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("argument", ["ignored_params", "shard_placement_fn", "offload_policy"])
def test_fully_shard_arguments_train_like_fsdp2(run_once, argument) -> None:
    ours, fsdp2 = both(run_once, arguments_script, argument)
    compare(ours, fsdp2)
    if argument == "ignored_params":
        # Not reduced: each rank's copy followed its own rows' grads, in both.
        key = "blocks.0.norm.weight"
        assert not torch.equal(ours[0]["params"][key], ours[1]["params"][key]), "the ignored parameter was reduced"
        assert ours[0]["facts"]["ignored"] == "Parameter", ours[0]["facts"]


def refused_arguments_script(argument: str) -> dict[str, Any]:
    """``fully_shard`` with an argument it refuses: the error, and the module as it was."""
    import torch.distributed.fsdp as torch_fsdp
    from torch.distributed.fsdp import CPUOffloadPolicy
    from torch.distributed.tensor import Shard

    # FSDP2's class from torch 2.13 on; before, any value stands for it.
    mesh_dims = torch_fsdp.DataParallelMeshDims(shard="dp") if hasattr(torch_fsdp, "DataParallelMeshDims") else "dp"

    from fsdp_patch import fully_shard

    model = net()
    if argument == "tensor_parallel":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, distribute_tensor

        tp_mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        model.inp.weight = nn.Parameter(distribute_tensor(model.inp.weight.detach(), tp_mesh, [Replicate()]))
    kwargs: dict[str, Any] = {
        "tensor_parallel": {},
        "placement_dim_1": {"shard_placement_fn": lambda p: Shard(1) if p.dim() == 2 else None},
        "cpu_offload": {"offload_policy": CPUOffloadPolicy()},
        "dp_mesh_dims": {"dp_mesh_dims": mesh_dims},
        "ignored_not_parameters": {"ignored_params": {"blocks.0.norm.weight"}},
    }[argument]
    before = {name: (type(p).__name__, p.detach().clone()) for name, p in model.named_parameters()}
    try:
        fully_shard(model, **kwargs)
        error = "accepted"
    except (NotImplementedError, TypeError) as caught:
        error = f"{type(caught).__name__}: {caught}"
    after = {name: (type(p).__name__, p.detach().clone()) for name, p in model.named_parameters()}
    unchanged = before.keys() == after.keys() and all(
        before[k][0] == after[k][0] and torch.equal(before[k][1], after[k][1]) for k in before
    )
    return {"error": error, "unchanged": unchanged, "class": type(model).__name__}


@pytest.mark.parametrize(
    ("argument", "want"),
    [
        (
            "placement_dim_1",
            "NotImplementedError: fully_shard: shard_placement_fn placed parameter 'inp.weight' as Shard(dim=1)",
        ),
        ("cpu_offload", "NotImplementedError: fully_shard: CPUOffloadPolicy is not supported"),
        ("dp_mesh_dims", "NotImplementedError: fully_shard: dp_mesh_dims="),
        ("ignored_not_parameters", "TypeError: fully_shard expected ignored_params to hold parameters, got ['str']"),
        ("tensor_parallel", "NotImplementedError: fully_shard: parameter 'inp.weight' is a DTensor on DeviceMesh"),
    ],
)
def test_refused_arguments_name_why_and_leave_the_module_as_it_was(run_once, argument, want) -> None:
    got = run_once(WORLD_SIZE, refused_arguments_script, argument)[0]
    assert got["error"].startswith(want), f"want an error starting {want!r}, got {got['error']!r}"
    assert got["unchanged"] and got["class"] == "Net", f"the module changed: {got}"


def refused_methods_script() -> dict[str, str]:
    from fsdp_patch import fully_shard, share_comm_ctx

    model = fully_shard(net())
    errors = {}
    for name, call in {
        "allocation_from_process_group": lambda: model.set_allocate_memory_from_process_group_for_comm(True),
        "symm_mem": lambda: model.set_symm_mem_for_comm(),
        "all_reduce_hook_stream": lambda: model.set_all_reduce_hook(lambda t: None, stream=object()),
        "custom_all_gather_not_a_comm": lambda: model.set_custom_all_gather(object()),
        "share_comm_ctx_plain_module": lambda: share_comm_ctx([nn.Linear(1, 1)]),
        "divide_factor_zero": lambda: model.set_gradient_divide_factor(0),
        "share_comm_ctx": lambda: share_comm_ctx([model]),
    }.items():
        try:
            call()
            errors[name] = "accepted"
        except (NotImplementedError, ValueError, TypeError) as caught:
            errors[name] = type(caught).__name__
    return errors


def test_methods_that_cannot_apply_are_refused_naming_why(run_once) -> None:
    got = run_once(WORLD_SIZE, refused_methods_script)[0]
    want = {
        "allocation_from_process_group": "NotImplementedError",
        "symm_mem": "NotImplementedError",
        "all_reduce_hook_stream": "ValueError",
        "custom_all_gather_not_a_comm": "TypeError",
        "share_comm_ctx_plain_module": "ValueError",
        "divide_factor_zero": "ValueError",
        "share_comm_ctx": "accepted",
    }
    assert got == want, f"want {want}, got {got}"


# -- fully_shard([a, b]): one unit over several modules ---------------------------------------------


def grouped_blocks_script(impl: str, use_aux: bool) -> dict[str, Any]:
    """Both blocks one unit, then the head and the auxiliary head one unit that a forward runs
    wholly (``use_aux``) or in part (the auxiliary head unused), then the root."""
    api = Api.of(impl)
    torch.manual_seed(0)
    model = Net(norm=True, aux=True)
    api.fully_shard([model.blocks[0], model.blocks[1]])
    assert model.aux is not None
    api.fully_shard([model.head, model.aux])
    api.fully_shard(model)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    optimizer = api.optimizer(model)
    losses = []
    for x, y in data(STEPS):
        loss = F.mse_loss(model(rows(x, rank, world_size), use_aux=use_aux), rows(y, rank, world_size))
        loss.backward()
        losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    facts: dict[str, Any] = {"classes": sorted({type(m).__name__ for m in (model.blocks[0], model.head, model.aux)})}
    if impl == "ours":
        from fsdp_patch import parameter_groups
        from fsdp_patch.module.shard_module import unit_name_of

        facts["units"] = sorted({unit_name_of(g) for g in parameter_groups(model)})
        facts["names"] = sorted(
            n for g in parameter_groups(model.blocks[1]) for n in g.names if n.endswith("fc1.weight")
        )
    return {"losses": losses, "params": {n: full_copy(p) for n, p in model.named_parameters()}, "facts": facts}


class ChunkedLoss(nn.Module):
    """A body and a final norm; the head is called per chunk of the hidden states outside the
    model's forward, as chunked cross-entropy does (``fully_shard([norm, head])``, FSDP2's
    motivating case)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = Net(norm=True)
        self.norm = nn.LayerNorm(pattern_models.DIM)
        self.head = nn.Linear(pattern_models.DIM, pattern_models.OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.body.inp(x))
        for block in self.body.blocks:
            h = block(h)
        return self.norm(h)


def chunked_loss_script(impl: str) -> dict[str, Any]:
    api = Api.of(impl)
    torch.manual_seed(0)
    model = ChunkedLoss()
    for block in model.body.blocks:
        api.fully_shard(block)
    api.fully_shard([model.norm, model.head])
    api.fully_shard(model)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    optimizer = api.optimizer(model)
    losses = []
    for x, y in data(STEPS):
        hidden = model(rows(x, rank, world_size))
        target = rows(y, rank, world_size)
        loss = sum(
            F.mse_loss(model.head(h), t, reduction="sum") for h, t in zip(hidden.chunk(2), target.chunk(2), strict=True)
        )
        loss = loss / target.numel()
        loss.backward()
        losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    return {"losses": losses, "params": {n: full_copy(p) for n, p in model.named_parameters()}}


@pytest.mark.parametrize("use_aux", [True, False])
def test_a_unit_over_several_modules_trains_like_fsdp2(run_once, use_aux) -> None:
    ours, fsdp2 = both(run_once, grouped_blocks_script, use_aux)
    compare(ours, fsdp2, facts=False)
    facts = ours[0]["facts"]
    assert facts["classes"] == fsdp2[0]["facts"]["classes"] == ["FSDPBlock", "FSDPLinear"], facts
    assert facts["units"] == ["", "blocks.0, blocks.1", "head, aux"], f"unit names: {facts['units']}"
    want = ["blocks.0.ff.fc1.weight", "blocks.1.ff.fc1.weight"]
    assert facts["names"] == want, f"parameter names from the root: {facts['names']}"


def test_chunked_loss_with_the_head_grouped_with_the_norm(run_once) -> None:
    ours, fsdp2 = both(run_once, chunked_loss_script)
    compare(ours, fsdp2, facts=False)


def grouping_refusals_script() -> dict[str, str]:
    from fsdp_patch import fully_shard

    model = net()
    got = {}
    for name, modules in {
        "empty": [],
        "twice": [model.blocks[0], model.blocks[0]],
        "nested": [model.blocks[0], model.blocks[0].ff],
        "not_a_module": [model.blocks[0], "head"],
    }.items():
        try:
            fully_shard(modules)  # type: ignore[arg-type]
            got[name] = "accepted"
        except (TypeError, ValueError) as error:
            got[name] = f"{type(error).__name__}: {error}"
    from fsdp_patch import FSDPModule

    got["untouched"] = str(not any(isinstance(m, FSDPModule) for m in model.modules()))
    return got


def test_a_wrong_list_of_modules_is_refused_naming_why(run_once) -> None:
    got = run_once(WORLD_SIZE, grouping_refusals_script)[0]
    assert got["empty"] == "TypeError: fully_shard expected an nn.Module or a non-empty list of them, got []", got
    assert got["twice"].startswith("ValueError: fully_shard: Block is listed twice"), got
    assert "contain one another" in got["nested"], got
    want = "TypeError: fully_shard expected an nn.Module or a non-empty list of them, got ['Block', 'str']"
    assert got["not_a_module"] == want, got
    assert got["untouched"] == "True", f"a refused call changed the modules: {got}"
