"""Parameters that tensor parallelism placed already: what FSDP shards of them, and how they look
before and after.

``parallelize_module`` (colwise, rowwise, sequence-parallel plans) makes a parameter a DTensor
on a 1-D tensor-parallel mesh ``tp`` whose ranks each hold a *local* tensor. ``fully_shard``
over a data-parallel mesh ``dp`` (the other dimension of one ``("dp", "tp")`` mesh) shards that
local tensor along dim 0, as it shards a plain parameter; in forward the all-gather gives back
the local tensor, and the unsharded parameter is again the DTensor on ``tp`` that the module's
TP plan expects. The sharded parameter is, as in FSDP2, a DTensor on the two dimensions together
(``dp`` then ``tp``) with the parameter's global shape, placed ``(Shard(0), <tp placement>)``, or
``(_StridedShard(0, split_factor=n), Shard(0))`` where tensor parallelism already split dim 0 in
``n``: FSDP's rows are then rows of each TP rank's block, which DCP and ``full_tensor`` need to
know to put every element back in its place.

Alternatives considered:
    - Sharding the global tensor over both dimensions at once: the all-gather over ``dp`` would
      not give the TP-local tensor the module's plan computes with.
    - Supporting HSDP x TP (a 3-D spmd mesh) and 2-D TP meshes (EP x TP): refused until a test
      on 8 ranks covers them.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from .placement import MeshDims

__all__ = ["TensorParallel", "local_grad", "tensor_parallel_of"]


@dataclass(frozen=True)
class TensorParallel:
    """How tensor parallelism placed one parameter, and the placements FSDP gives it on top.

    Attributes:
        spec: The parameter's DTensor spec as ``parallelize_module`` left it: the TP mesh, its
            placement there and the global shape.
        sharded_mesh: The data-parallel and tensor-parallel dimensions together (``dp``, ``tp``).
        sharded_placements: The sharded parameter's placements on ``sharded_mesh``.
    """

    spec: DTensorSpec
    sharded_mesh: DeviceMesh
    sharded_placements: tuple[Any, ...]

    @property
    def shape(self) -> torch.Size:
        """The parameter's global shape (a TP rank holds a part of it)."""
        assert self.spec.tensor_meta is not None
        return self.spec.tensor_meta.shape

    @property
    def splits(self) -> bool:
        """Whether each TP rank holds other elements of the parameter (``Shard``), not a copy."""
        return isinstance(self.spec.placements[0], Shard)

    @cached_property
    def local_slices(self) -> tuple[slice, ...]:
        """Where this TP rank's local tensor lies in the global parameter."""
        local_shape, offset = compute_local_shape_and_global_offset(self.shape, self.spec.mesh, self.spec.placements)
        return tuple(slice(start, start + size) for start, size in zip(offset, local_shape, strict=True))

    def spec_in(self, dtype: torch.dtype) -> DTensorSpec:
        """The spec of the unsharded parameter (and its grad) in ``dtype``."""
        assert self.spec.tensor_meta is not None
        return DTensorSpec(
            self.spec.mesh,
            self.spec.placements,
            tensor_meta=TensorMeta(self.shape, self.spec.tensor_meta.stride, dtype),
        )

    def sharded_spec(self, dtype: torch.dtype) -> DTensorSpec:
        """The spec of the sharded parameter (and the main weights' and grads' views) in ``dtype``."""
        assert self.spec.tensor_meta is not None
        meta = TensorMeta(self.shape, self.spec.tensor_meta.stride, dtype)
        return DTensorSpec(self.sharded_mesh, self.sharded_placements, tensor_meta=meta)

    def local_of(self, full: torch.Tensor) -> torch.Tensor:
        """This TP rank's part of a whole (global-shape) value of the parameter."""
        return full[self.local_slices]


def _refuse(name: str, param: DTensor, why: str) -> NotImplementedError:
    return NotImplementedError(
        f"fully_shard: parameter '{name}' is a DTensor on {param.device_mesh} placed {tuple(param.placements)}; "
        f"{why}. fully_shard composes with tensor parallelism as FSDP2 does: parallelize_module over mesh['tp'] of "
        "a 2-D ('dp', 'tp') mesh, then fully_shard(..., mesh=mesh['dp'])"
    )


def tensor_parallel_of(name: str, param: DTensor, dims: MeshDims) -> TensorParallel:
    """The :class:`TensorParallel` of a parameter a TP plan made a DTensor, for sharding over ``dims``.

    Raises:
        NotImplementedError: The data-parallel mesh is HSDP's 2-D one; the parameter's mesh is
            not 1-D, not a dimension of the same mesh as the data-parallel one, or overlaps it;
            its placement is not ``Shard`` or ``Replicate``.
    """
    spec = param._spec
    if dims.replicate_group is not None:
        raise _refuse(name, param, "HSDP x tensor parallel (a 3-D mesh) is not supported; use a 1-D data-parallel mesh")
    if spec.mesh.ndim != 1:
        raise _refuse(name, param, "its mesh is not 1-D: one tensor-parallel dimension is supported")
    placement = spec.placements[0]
    if type(placement) not in (Shard, Replicate):
        raise _refuse(name, param, f"placement {placement!r} is not supported (Shard or Replicate are)")
    try:
        sharded_mesh = DeviceMesh._concatenate([dims.mesh, spec.mesh])
    except Exception as error:  # torch's reason (another root mesh, overlapping dimensions) follows
        raise _refuse(
            name, param, f"its mesh and the data-parallel mesh {dims.mesh} are not two dimensions of one mesh ({error})"
        ) from error
    split = spec.num_shards_map[0]
    dp_placement = _StridedShard(0, split_factor=split) if split > 1 else Shard(0)
    return TensorParallel(spec, sharded_mesh, (dp_placement, placement))


def local_grad(grad: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """The local tensor of an unsharded parameter's grad, placed as the parameter is.

    A replicated TP parameter's grad can come back ``Partial`` (each TP rank holding a summand);
    FSDP reduces local tensors, so it is made whole over the TP mesh first, as FSDP2 makes it.
    """
    if not isinstance(grad, DTensor):
        return grad
    if isinstance(param, DTensor) and tuple(grad.placements) != tuple(param.placements):
        grad = grad.redistribute(placements=param.placements)
    return grad._local_tensor
