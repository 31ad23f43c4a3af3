"""Where shards live: the device mesh of a ``fully_shard`` call, its dimensions and device.

A 1-D mesh shards every parameter over its ranks (FSDP). A 2-D mesh is FSDP2's HSDP: dim 0
replicates, dim 1 shards; parameters are DTensors placed ``(Replicate(), Shard(0))``, gathered
over the shard dimension, their grads reduce-scattered over it and then all-reduced over the
replicate dimension (:class:`MeshDims`).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate, Shard

__all__ = ["MeshDims", "resolve_mesh", "mesh_device", "separate_group", "post_forward_group"]


@dataclass(frozen=True)
class MeshDims:
    """A unit's mesh as its collectives see it.

    Attributes:
        mesh: The mesh ``fully_shard`` was given (1-D, or 2-D for HSDP).
        shard_group: The process group parameters are sharded over (the mesh's last dim).
        shard_size: Its size.
        shard_rank: This rank's index in it.
        replicate_group: HSDP's group of this rank's replicas (the mesh's dim 0), or ``None``.
        replicate_size: Its size (1 without one).
        placements: The sharded parameters' DTensor placements on ``mesh``.
    """

    mesh: DeviceMesh
    shard_group: Any
    shard_size: int
    shard_rank: int
    replicate_group: Any
    replicate_size: int
    placements: tuple[Any, ...]

    @classmethod
    def of(cls, mesh: DeviceMesh) -> MeshDims:
        if mesh.ndim == 1:
            return cls(mesh, mesh.get_group(), mesh.size(), mesh.get_local_rank(), None, 1, (Shard(0),))
        return cls(
            mesh,
            mesh.get_group(1),
            mesh.size(1),
            mesh.get_local_rank(1),
            mesh.get_group(0),
            mesh.size(0),
            (Replicate(), Shard(0)),
        )


# One separate group per process group, shared by every unit over it (FSDP2 makes one per distinct
# set of ranks likewise); weak, so that it goes with its process group.
_SEPARATE_GROUPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# Per process group and size, this rank's post-forward group and its position in it.
_POST_FORWARD_GROUPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def resolve_mesh(mesh: DeviceMesh | None) -> DeviceMesh:
    """Returns the mesh to shard over (1-D, or 2-D for HSDP), building a 1-D one over the
    default group if ``None``.

    Raises:
        RuntimeError: torch.distributed is not initialized.
        NotImplementedError: ``mesh`` has more than two dimensions.
        TypeError: ``mesh`` is not a DeviceMesh.
    """
    if mesh is None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "fully_shard needs an initialized torch.distributed process group "
                "(torchrun, or dist.init_process_group('gloo'|'nccl')) or an explicit mesh; "
                "got neither"
            )
        backend = dist.get_backend()
        device_type = "cuda" if "nccl" in str(backend) else "cpu"
        return init_device_mesh(device_type, (dist.get_world_size(),))
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"fully_shard expected mesh to be a DeviceMesh or None, got {type(mesh)!r}")
    if mesh.ndim > 2:
        raise NotImplementedError(
            f"fully_shard supports 1-D meshes (FSDP) and 2-D meshes (HSDP: dim 0 replicates, dim 1 shards, as "
            f"FSDP2); got a {mesh.ndim}-D mesh of shape {tuple(mesh.shape)}: flatten the data-parallel dimensions "
            "into those two"
        )
    return mesh


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """The device that holds this rank's shards; the CPU path never touches ``torch.cuda``."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    module = getattr(torch, mesh.device_type)
    return torch.device(mesh.device_type, module.current_device())


def separate_group(process_group: dist.ProcessGroup) -> dist.ProcessGroup:
    """A process group of its own over ``process_group``'s ranks (made once per process group;
    collective over its ranks the first time)."""
    if process_group not in _SEPARATE_GROUPS:
        ranks = dist.get_process_group_ranks(process_group)
        _SEPARATE_GROUPS[process_group] = dist.new_group(ranks, use_local_synchronization=True)
    return _SEPARATE_GROUPS[process_group]


def post_forward_group(dims: MeshDims, size: int) -> tuple[dist.ProcessGroup, int]:
    """The group of ``size`` consecutive ranks of the shard dimension holding this rank
    (FSDP2's ``mesh.view(-1, size)`` rows) and this rank's position in it; made once per shard
    group and size (each rank creates its own group only)."""
    by_size = _POST_FORWARD_GROUPS.setdefault(dims.shard_group, {})
    if size not in by_size:
        ranks = dist.get_process_group_ranks(dims.shard_group)
        local = dims.shard_rank
        start = local - local % size
        by_size[size] = (dist.new_group(ranks[start : start + size], use_local_synchronization=True), local % size)
    return by_size[size]
