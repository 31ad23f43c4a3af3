"""What optimizers, ``named_parameters()`` and checkpoints see of a ``fully_shard``-ed module.

Parameters are DTensor ``Shard(0)`` parameters over a 1-D mesh, split as ``torch.chunk`` splits
(uneven and tiny dims included: a bias of 3 on 4 ranks leaves rank 3 an empty shard), with the
unwrapped model's FQNs, ``grad_dtype`` set to the main-grad dtype, local data that are views
into the group's flat main-weight buffer, and a link to their group. Groups split by
(dtype, requires_grad); frozen groups have no main-grad buffer.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from tests.fsdp.sharded_views import difference, shard_storage_facts, world


class Uneven(nn.Module):
    """Parameters whose dim 0 does not divide by 2 or 4, including dims smaller than 4."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.a = nn.Linear(5, 3)  # weight (3, 5), bias (3,)
        self.b = nn.Linear(3, 1)  # weight (1, 3), bias (1,)
        self.c = nn.Parameter(torch.randn(2, 2, 2))
        self.d = nn.Linear(3, 9)  # weight (9, 3), bias (9,)
        self.e = nn.Linear(9, 5)  # weight (5, 9), bias (5,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x)) * self.c.sum()
        return self.e(torch.tanh(self.d(h))).sum(-1) + self.b(h).squeeze(-1)


def geometry_run() -> dict[str, Any]:
    """Sharding geometry, FQNs, grouping, group links and a reference step on uneven shapes."""
    from fsdp_patch import MixedPrecisionPolicy, fully_shard, parameter_group_of, parameter_groups

    rank, world_size = world()
    facts: dict[str, Any] = {}

    # Uneven shapes: DTensor Shard(0), chunked like torch.chunk, one unit, one SGD step.
    model = Uneven()
    reference = Uneven()
    originals = {n: p.detach().clone() for n, p in model.named_parameters()}
    names_before = [n for n, _ in model.named_parameters()]
    fully_shard(model)
    facts["fqns_before"] = names_before
    facts["fqns_after"] = [n for n, _ in model.named_parameters()]
    facts["state_dict_keys"] = list(model.state_dict().keys())
    shards = {}
    for name, p in model.named_parameters():
        chunks = torch.chunk(originals[name], world_size, dim=0)
        expected = chunks[rank] if rank < len(chunks) else originals[name][:0]
        shards[name] = {
            "is_dtensor": isinstance(p, DTensor),
            "is_parameter": isinstance(p, nn.Parameter),
            "placements": tuple(p.placements),
            "mesh_ndim": p.device_mesh.ndim,
            "global_shape": tuple(p.shape),
            "local_shape": tuple(p.to_local().shape),
            "expected_local_shape": tuple(expected.shape),
            "local_diff": difference(p.to_local(), expected),
            "full_diff": difference(p.full_tensor(), originals[name]),
            "grad_dtype": p.grad_dtype,
            "requires_grad": p.requires_grad,
        }
    facts["shards"] = shards
    facts["storage"] = shard_storage_facts(model)
    group = parameter_groups(model)[0]
    facts["params_not_linked"] = [n for n, p in model.named_parameters() if parameter_group_of(p) is not group]
    names = {id(p): n for n, p in model.named_parameters()}
    facts["group_params"] = [names.get(id(p), f"<not a module parameter: {tuple(p.shape)}>") for p in group.params]
    facts["module_params"] = [n for n, _ in model.named_parameters()]
    facts["plain_tensor_group"] = repr(parameter_group_of(torch.zeros(3)))

    x = torch.randn(6, 5, generator=torch.Generator().manual_seed(7))
    model(x).square().mean().backward()
    reference(x).square().mean().backward()
    grads = {}
    for (name, p), (_, ref) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        grads[name] = {
            "is_dtensor": isinstance(p.grad, DTensor),
            "placements": tuple(p.grad.placements),
            "local_shape": tuple(p.grad.to_local().shape),
            "dtype": p.grad.dtype,
            "storage_ptr": p.grad.to_local().untyped_storage().data_ptr(),
            "main_grad_ptr": group.main_grad.untyped_storage().data_ptr(),
            # Every rank saw the same input: the average equals the single-process grad exactly.
            "reference_diff": difference(p.grad.full_tensor(), ref.grad),
        }
    facts["grads"] = grads
    with torch.no_grad():
        for p in list(model.parameters()) + list(reference.parameters()):
            p.sub_(0.1 * p.grad)
    facts["step_diffs"] = {
        name: diff
        for (name, p), r in zip(model.named_parameters(), reference.parameters(), strict=True)
        if (diff := difference(p.full_tensor(), r)) is not None
    }
    facts["forward_after_step_diff"] = difference(model(x), reference(x))

    # Grouping by (dtype, requires_grad); frozen groups have no main grad; buffers per policy.
    mixed = nn.Module()
    mixed.f32 = nn.Linear(4, 3)
    mixed.bf16 = nn.Linear(4, 3).bfloat16()
    mixed.frozen = nn.Linear(4, 3)
    mixed.frozen.requires_grad_(False)
    fully_shard(mixed, mp_policy=MixedPrecisionPolicy(main_grads_dtype=torch.float32))
    facts["groups"] = sorted(
        (
            str(g.compute_dtype),
            g.requires_grad,
            str(g.main_weight.dtype),
            str(g.compute_weight.dtype),
            None if g.main_grad is None else str(g.main_grad.dtype),
            None if g.grads_dtype is None else str(g.grads_dtype),
            sorted(g.names),
            g.compute_weight is g.main_weight,
        )
        for g in mixed.fsdp_parameter_groups
    )
    facts["mixed_param_dtypes"] = {n: str(p.dtype) for n, p in mixed.named_parameters()}
    facts["mixed_grad_dtypes"] = {
        n: (str(p.grad_dtype) if p.requires_grad else None) for n, p in mixed.named_parameters()
    }
    return facts


@pytest.fixture(scope="module", params=(2, 4), ids=lambda w: f"ws{w}")
def geometry(request: pytest.FixtureRequest, run_once) -> tuple[int, list[dict]]:
    return request.param, run_once(request.param, geometry_run)


def test_parameters_are_shard0_dtensors_split_like_torch_chunk(geometry) -> None:
    world_size, per_rank = geometry
    for rank, facts in enumerate(per_rank):
        for name, shard in facts["shards"].items():
            where = f"ws{world_size} rank {rank} {name}"
            assert shard["is_dtensor"] and shard["is_parameter"], where
            assert shard["placements"] == (Shard(0),), where
            assert shard["mesh_ndim"] == 1, where
            assert shard["local_shape"] == shard["expected_local_shape"], where
            assert shard["local_diff"] is None, (
                f"{where}: local shard is not torch.chunk's piece: {shard['local_diff']}"
            )
            assert shard["full_diff"] is None, f"{where}: full_tensor() is not the original: {shard['full_diff']}"
            assert shard["requires_grad"], where
    if world_size == 4:
        # bias of 3 rows on 4 ranks: 1, 1, 1, 0 rows; weight of 1 row: only rank 0 holds it.
        assert [f["shards"]["a.bias"]["local_shape"] for f in per_rank] == [(1,), (1,), (1,), (0,)]
        assert [f["shards"]["b.weight"]["local_shape"] for f in per_rank] == [(1, 3), (0, 3), (0, 3), (0, 3)]
        assert [f["shards"]["d.weight"]["local_shape"][0] for f in per_rank] == [3, 3, 3, 0]
        assert [f["shards"]["e.weight"]["local_shape"][0] for f in per_rank] == [2, 2, 1, 0]


def test_fqns_are_those_of_the_unwrapped_model(geometry) -> None:
    _, per_rank = geometry
    for facts in per_rank:
        assert facts["fqns_after"] == facts["fqns_before"]
        assert facts["state_dict_keys"] == facts["fqns_before"]


def test_grad_dtype_is_main_grad_dtype_and_grads_are_main_grad_views(geometry) -> None:
    world_size, per_rank = geometry
    for rank, facts in enumerate(per_rank):
        for name, shard in facts["shards"].items():
            assert shard["grad_dtype"] == torch.float32, name
        for name, grad in facts["grads"].items():
            where = f"ws{world_size} rank {rank} {name}"
            assert grad["is_dtensor"] and grad["placements"] == (Shard(0),), where
            assert grad["local_shape"] == facts["shards"][name]["local_shape"], where
            assert grad["dtype"] == torch.float32, where
            got, want = grad["storage_ptr"], grad["main_grad_ptr"]
            assert got == want, f"{where}: .grad's storage at {got:#x}, not in the main-grad buffer at {want:#x}"
            # Same input on every rank: the averaged grad equals the single-process one exactly.
            assert grad["reference_diff"] is None, f"{where}: grad differs: {grad['reference_diff']}"


def test_uneven_shards_train_like_the_reference(geometry) -> None:
    _, per_rank = geometry
    for facts in per_rank:
        assert facts["step_diffs"] == {}, f"parameters after the step differ from the reference: {facts['step_diffs']}"
        diff = facts["forward_after_step_diff"]
        assert diff is None, f"forward after an update does not see the new weights: {diff}"


def test_local_data_live_in_flat_group_buffers(geometry) -> None:
    _, per_rank = geometry
    for facts in per_rank:
        storage = facts["storage"]
        outside = storage["params_outside_main_buffers"]
        assert outside == [], f"parameters whose local data are outside their group's buffer: {outside}"
        assert storage["param_storage_bytes"] == storage["main_buffer_bytes"] == storage["shard_bytes_expected"]
        assert storage["unsharded_param_storage_bytes"] == 0


def test_parameters_link_to_their_group(geometry) -> None:
    _, per_rank = geometry
    for facts in per_rank:
        assert facts["params_not_linked"] == [], f"parameters not linked to their group: {facts['params_not_linked']}"
        got, want = facts["group_params"], facts["module_params"]
        assert got == want, f"the group's params: got {got}, want the module's parameters {want}"
        assert facts["plain_tensor_group"] == "None", f"a plain tensor's group: got {facts['plain_tensor_group']}"


def test_groups_split_by_dtype_and_requires_grad(geometry) -> None:
    _, per_rank = geometry
    # (compute dtype, requires_grad, main dtype, compute-copy dtype, main-grad buffer dtype
    #  (none before the first backward), grads_dtype, names, compute copy is the main buffer)
    expected = [
        (
            "torch.bfloat16",
            True,
            "torch.float32",
            "torch.bfloat16",
            None,
            "torch.float32",
            ["bf16.bias", "bf16.weight"],
            False,
        ),
        (
            "torch.float32",
            False,
            "torch.float32",
            "torch.float32",
            None,
            "torch.float32",
            ["frozen.bias", "frozen.weight"],
            True,
        ),
        (
            "torch.float32",
            True,
            "torch.float32",
            "torch.float32",
            None,
            "torch.float32",
            ["f32.bias", "f32.weight"],
            True,
        ),
    ]
    for facts in per_rank:
        assert facts["groups"] == expected
        # Optimizers see fp32 main weights, whatever the compute dtype.
        assert set(facts["mixed_param_dtypes"].values()) == {"torch.float32"}
        assert facts["mixed_grad_dtypes"]["frozen.weight"] is None
        assert facts["mixed_grad_dtypes"]["bf16.weight"] == "torch.float32"
