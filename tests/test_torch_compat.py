"""fsdp_patch.torch_interop.torch_compat: each shape of torch's internals it papers over, and the shape this torch has.

The stand-in objects below have the attributes of torch FSDP2's private state on each supported
release (one ``_fsdp_param_group`` on 2.11, the list ``_fsdp_param_groups`` from 2.12; the
mixed-precision policy on the group, or on each ``FSDPParam`` on the newest), so every branch runs
on any torch; the rank functions check that this torch's real FSDP2 objects are read right.
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from fsdp_patch.torch_interop import torch_compat
from fsdp_patch.torch_interop.fsdp2 import fsdp2_groups
from tests import models

WORLD = 2


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch_compat, "_warned", set())


class _SingleGroupState:
    """An FSDPState of a torch before per-parameter meshes: one group, or None before sharding."""

    def __init__(self, group: Any) -> None:
        self._fsdp_param_group = group


class _ManyGroupsState:
    """An FSDPState of torch >= 2.12, whose ``_fsdp_param_group`` property refuses several groups."""

    def __init__(self, groups: list[Any]) -> None:
        self._fsdp_param_groups = groups

    @property
    def _fsdp_param_group(self) -> Any:
        raise AssertionError("Expected at most 1 param group for backward compatibility")


def test_param_groups_of_each_state_shape() -> None:
    first, second = object(), object()
    cases = {
        "list of two": (_ManyGroupsState([first, second]), [first, second]),
        "empty list": (_ManyGroupsState([]), []),
        "single": (_SingleGroupState(first), [first]),
        "single, not yet sharded": (_SingleGroupState(None), []),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a known shape warns of nothing
        got = {name: torch_compat.fsdp2_state_param_groups(state) for name, (state, _) in cases.items()}
    want = {name: groups for name, (_, groups) in cases.items()}
    assert got == want, f"want {want}, got {got}"


def test_unknown_state_shape_warns_once_and_gives_no_groups() -> None:
    with pytest.warns(RuntimeWarning, match="neither _fsdp_param_groups nor _fsdp_param_group.*no FSDP2 telemetry"):
        got = torch_compat.fsdp2_state_param_groups(SimpleNamespace())
    assert got == [], f"want no groups from an unknown state, got {got}"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = torch_compat.fsdp2_state_param_groups(SimpleNamespace())
    assert again == [], f"want no groups, and no second warning, got {again}"


def test_param_dtype_prefers_the_parameters_own_policy() -> None:
    bf16, fp16 = SimpleNamespace(param_dtype=torch.bfloat16), SimpleNamespace(param_dtype=torch.float16)
    cases = {
        "per parameter (newest torch, no group policy)": (
            SimpleNamespace(),
            SimpleNamespace(mp_policy=fp16),
            torch.float16,
        ),
        "per parameter, resolved for it over the group's": (
            SimpleNamespace(mp_policy=bf16),
            SimpleNamespace(mp_policy=fp16),
            torch.float16,
        ),
        "per group only": (SimpleNamespace(mp_policy=bf16), SimpleNamespace(), torch.bfloat16),
        "no cast": (SimpleNamespace(), SimpleNamespace(mp_policy=SimpleNamespace(param_dtype=None)), None),
    }
    got = {name: torch_compat.fsdp2_param_dtype(group, param) for name, (group, param, _) in cases.items()}
    want = {name: dtype for name, (_, _, dtype) in cases.items()}
    assert got == want, f"want {want}, got {got}"
    with pytest.warns(RuntimeWarning, match="no mp_policy on FSDPParam nor on FSDPParamGroup"):
        unknown = torch_compat.fsdp2_param_dtype(SimpleNamespace(), SimpleNamespace())
    assert unknown is None, f"want no cast assumed where no policy is found, got {unknown}"


def test_tensor_parallel_spec_of_each_fsdp_param_shape() -> None:
    spec = object()
    cases = {
        "torch >= 2.13: _unsharded_dtensor_spec": (
            SimpleNamespace(is_dtensor=True, _unsharded_dtensor_spec=spec),
            spec,
        ),
        "torch 2.11-2.12: _tp_spec": (SimpleNamespace(is_dtensor=True, _tp_spec=spec), spec),
        "plain parameter": (SimpleNamespace(is_dtensor=False, _tp_spec=spec), None),
    }
    got = {name: torch_compat.fsdp2_tensor_parallel_spec(param) for name, (param, _) in cases.items()}
    want = {name: found for name, (_, found) in cases.items()}
    assert got == want, f"want {want}, got {got}"


def test_foreach_clone_copies_into_new_storage() -> None:
    tensors = [torch.arange(4.0), torch.ones(2, 3, dtype=torch.bfloat16)]
    clones = torch_compat.foreach_clone(tensors)
    got = [
        (torch.equal(c, t), c.dtype == t.dtype, c.data_ptr() != t.data_ptr())
        for c, t in zip(clones, tensors, strict=True)
    ]
    assert got == [(True, True, True)] * 2, f"want equal values and dtype in new storage, got {got}"


def flat_collectives_on_ranks() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    shard = torch.arange(3.0) + 10 * rank
    gathered = torch.empty(3 * world)
    torch_compat.all_gather_flat(gathered, shard)
    want = torch.cat([torch.arange(3.0) + 10 * r for r in range(world)])
    assert torch.equal(gathered, want), f"rank {rank}: all_gather_flat gave {gathered.tolist()}, want {want.tolist()}"
    full = torch.arange(2.0 * world) * (rank + 1)
    out = torch.empty(2)
    work = torch_compat.reduce_scatter_flat(out, full, async_op=True)
    work.wait()
    total = sum(r + 1 for r in range(world))
    want_out = torch.arange(2.0 * rank, 2.0 * rank + 2) * total
    assert torch.equal(out, want_out), f"rank {rank}: reduce_scatter_flat gave {out.tolist()}, want {want_out.tolist()}"


def test_flat_collectives_on_this_torch(dist_pool) -> None:
    dist_pool(WORLD).run(flat_collectives_on_ranks)


def fsdp2_internals_on_ranks() -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    rank = dist.get_rank()
    model = models.make_model(0)
    for block in model.blocks:
        fully_shard(block, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    fully_shard(model)  # the root: no param_dtype, nothing cast
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # this torch's shape is a known one
        groups = fsdp2_groups(model.parameters())
    got = [(len(g.params), g.compute_dtype) for g in groups]
    root_params = [p for name, p in model.named_parameters() if not name.startswith("blocks.")]
    want = [(len(list(block.parameters())), torch.bfloat16) for block in model.blocks] + [(len(root_params), None)]
    assert sorted(got, key=str) == sorted(want, key=str), (
        f"rank {rank}, torch {torch.__version__}: want FSDP2 groups (params, compute dtype) {want}, got {got}"
    )
    in_groups = sorted(id(p) for g in groups for p in g.params)
    assert in_groups == sorted(id(p) for p in model.parameters()), (
        f"rank {rank}: groups do not hold exactly the model's parameters"
    )


def test_fsdp2_groups_of_this_torch(dist_pool) -> None:
    dist_pool(WORLD).run(fsdp2_internals_on_ranks)


def _has_param_dtype_override() -> bool:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return "param_dtype_override_fn" in getattr(MixedPrecisionPolicy, "__dataclass_fields__", {})


def fsdp2_override_on_ranks() -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    rank = dist.get_rank()
    model = models.make_model(0)
    norms = {id(p) for name, p in model.named_parameters() if "norm" in name or name.endswith("bias")}

    def keep_norms_fp32(param: torch.nn.Parameter) -> torch.dtype | None:
        return torch.float32 if id(param) in norms else None

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, param_dtype_override_fn=keep_norms_fp32)
    fully_shard(model, mp_policy=policy)
    got = sorted((len(g.params), str(g.compute_dtype)) for g in fsdp2_groups(model.parameters()))
    count = len(list(model.parameters()))
    want = sorted([(count - len(norms), str(torch.bfloat16)), (len(norms), "None")])
    assert got == want, f"rank {rank}: want one group per compute dtype (params, dtype) {want}, got {got}"


@pytest.mark.skipif(
    not _has_param_dtype_override(),
    reason="this torch's MixedPrecisionPolicy sets one param_dtype per group (no param_dtype_override_fn)",
)
def test_fsdp2_per_parameter_dtype_splits_the_group(dist_pool) -> None:
    dist_pool(WORLD).run(fsdp2_override_on_ranks)


def fsdp2_tensor_parallel_on_ranks() -> None:
    """A 1 x 2 ("dp", "tp") mesh: colwise fc1 and rowwise fc2 split their weights (and fc1 its
    bias) over the TP ranks; fc2's bias is replicated on them; FSDP2 shards over "dp"."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (1, WORLD), mesh_dim_names=("dp", "tp"))
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 4))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    [group] = fsdp2_groups(model.parameters())
    names = {id(p): name for name, p in model.named_parameters()}
    got = {names[id(p)]: split for p, split in zip(group.members, group.tensor_parallel_split, strict=True)}
    want = {"0.weight": True, "0.bias": True, "2.weight": True, "2.bias": False}
    assert got == want, f"rank {rank}, torch {torch.__version__}: want TP splits {want}, got {got}"
    got_ranks = dist.get_process_group_ranks(group.tensor_parallel_group)
    assert got_ranks == [0, 1], f"rank {rank}: want the TP group's ranks [0, 1], got {got_ranks}"

    plain = torch.nn.Linear(4, 4)
    fully_shard(plain, mesh=init_device_mesh("cpu", (WORLD,)))
    [plain_group] = fsdp2_groups(plain.parameters())
    got_plain = (plain_group.tensor_parallel_split, plain_group.tensor_parallel_group)
    assert got_plain == ([False, False], None), f"rank {rank}: want no TP split nor group, got {got_plain}"


def test_fsdp2_tensor_parallel_spec_of_this_torch(dist_pool) -> None:
    dist_pool(WORLD).run(fsdp2_tensor_parallel_on_ranks)


def fsdp2_replicate_group_on_ranks() -> None:
    """A 2 x 1 (replicate, shard) mesh: FSDP2's HSDP group reads its replicas' process group."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank = dist.get_rank()
    model = torch.nn.Linear(4, 4)
    fully_shard(model, mesh=init_device_mesh("cpu", (WORLD, 1), mesh_dim_names=("replicate", "shard")))
    [group] = fsdp2_groups(model.parameters())
    got = dist.get_process_group_ranks(group.replicate_group)
    assert got == [0, 1], f"rank {rank}, torch {torch.__version__}: want the replicate group's ranks [0, 1], got {got}"
    plain = torch.nn.Linear(4, 4)
    fully_shard(plain, mesh=init_device_mesh("cpu", (WORLD,)))
    [plain_group] = fsdp2_groups(plain.parameters())
    assert plain_group.replicate_group is None, (
        f"rank {rank}: a 1-D mesh has no replicas, got {plain_group.replicate_group}"
    )


def test_fsdp2_replicate_group_of_this_torch(dist_pool) -> None:
    dist_pool(WORLD).run(fsdp2_replicate_group_on_ranks)
