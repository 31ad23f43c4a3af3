"""Where shards live: the device mesh and the device of a ``fully_shard`` call."""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["resolve_mesh", "mesh_device", "separate_group", "post_forward_group"]

# One separate group per process group, shared by every unit over it (FSDP2 makes one per distinct
# set of ranks likewise); weak, so that it goes with its process group.
_SEPARATE_GROUPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# Per process group and size, this rank's post-forward group and its position in it.
_POST_FORWARD_GROUPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def resolve_mesh(mesh: DeviceMesh | None) -> DeviceMesh:
    """Returns the 1-D mesh to shard over, building one over the default group if ``None``.

    Raises:
        RuntimeError: torch.distributed is not initialized.
        NotImplementedError: ``mesh`` has more than one dimension (HSDP).
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
    if mesh.ndim != 1:
        raise NotImplementedError(
            f"fully_shard supports 1-D meshes only; got a {mesh.ndim}-D mesh of shape "
            f"{tuple(mesh.shape)} (HSDP / 2-D meshes are not implemented)"
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


def post_forward_group(mesh: DeviceMesh, size: int) -> tuple[dist.ProcessGroup, int]:
    """The group of ``size`` consecutive ranks of ``mesh`` holding this rank (FSDP2's
    ``mesh.view(-1, size)`` rows) and this rank's position in it; made once per mesh group and
    size (each rank creates its own group only)."""
    by_size = _POST_FORWARD_GROUPS.setdefault(mesh.get_group(), {})
    if size not in by_size:
        ranks = mesh.mesh.flatten().tolist()
        local = mesh.get_local_rank()
        start = local - local % size
        by_size[size] = (dist.new_group(ranks[start : start + size], use_local_synchronization=True), local % size)
    return by_size[size]
