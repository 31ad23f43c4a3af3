"""What optimizers, ``named_parameters()`` and checkpoints see of a ``fully_shard``-ed module.

Parameters are DTensor ``Shard(0)`` parameters over a 1-D mesh, split as ``torch.chunk`` splits
(uneven and tiny dims included: a bias of 3 on 4 ranks leaves rank 3 an empty shard), with the
unwrapped model's FQNs, ``grad_dtype`` set to the main-grad dtype, local data that are views
into the group's flat main-weight buffer, and a link to their group. Groups split by
(dtype, requires_grad); frozen groups have no main-grad buffer.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Shard

from tests.fsdp import rank_fns


@pytest.fixture(scope="module", params=(2, 4), ids=lambda w: f"ws{w}")
def geometry(request: pytest.FixtureRequest, run_once) -> tuple[int, list[dict]]:
    return request.param, run_once(request.param, rank_fns.geometry_run)


def test_parameters_are_shard0_dtensors_split_like_torch_chunk(geometry) -> None:
    world_size, per_rank = geometry
    for rank, facts in enumerate(per_rank):
        for name, shard in facts["shards"].items():
            where = f"ws{world_size} rank {rank} {name}"
            assert shard["is_dtensor"] and shard["is_parameter"], where
            assert shard["placements"] == (Shard(0),), where
            assert shard["mesh_ndim"] == 1, where
            assert shard["local_shape"] == shard["expected_local_shape"], where
            assert shard["local_equal"], f"{where}: local shard is not torch.chunk's piece"
            assert shard["full_equal"], f"{where}: full_tensor() is not the original"
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
            assert grad["in_main_grad"], f"{where}: .grad is not a view of the main-grad buffer"
            # Same input on every rank: the averaged grad equals the single-process one exactly.
            assert grad["equal_reference"], where


def test_uneven_shards_train_like_the_reference(geometry) -> None:
    _, per_rank = geometry
    for facts in per_rank:
        assert facts["step_equal_reference"]
        assert facts["forward_after_step_equal"], "forward after an update does not see the new weights"


def test_local_data_live_in_flat_group_buffers(geometry) -> None:
    _, per_rank = geometry
    for facts in per_rank:
        storage = facts["storage"]
        assert storage["params_in_main_buffers"]
        assert storage["param_storage_bytes"] == storage["main_buffer_bytes"] == storage["shard_bytes_expected"]
        assert storage["unsharded_param_storage_bytes"] == 0


def test_parameters_link_to_their_group(geometry) -> None:
    _, per_rank = geometry
    for facts in per_rank:
        assert facts["group_links"]
        assert facts["group_params_are_module_params"]
        assert facts["plain_tensor_has_no_group"]


def test_groups_split_by_dtype_and_requires_grad(geometry) -> None:
    _, per_rank = geometry
    # (compute dtype, requires_grad, main dtype, compute-copy dtype, main-grad buffer dtype
    #  (none before the first backward), grads_dtype, names, compute copy is the main buffer)
    expected = [
        ("torch.bfloat16", True, "torch.float32", "torch.bfloat16", None, "torch.float32",
         ["bf16.bias", "bf16.weight"], False),
        ("torch.float32", False, "torch.float32", "torch.float32", None, "torch.float32",
         ["frozen.bias", "frozen.weight"], True),
        ("torch.float32", True, "torch.float32", "torch.float32", None, "torch.float32",
         ["f32.bias", "f32.weight"], True),
    ]  # fmt: skip
    for facts in per_rank:
        assert facts["groups"] == expected
        # Optimizers see fp32 main weights, whatever the compute dtype.
        assert set(facts["mixed_param_dtypes"].values()) == {"torch.float32"}
        assert facts["mixed_grad_dtypes"]["frozen.weight"] is None
        assert facts["mixed_grad_dtypes"]["bf16.weight"] == "torch.float32"
