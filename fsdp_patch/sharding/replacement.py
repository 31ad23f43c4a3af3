"""Tensors that replaced a sharded parameter in its module, and the values a group takes from them.

``load_state_dict(assign=True)`` and attribute assignment put new tensors where the sharded
parameters were. The group's own sharded parameter stays the module's parameter (optimizers
built earlier keep stepping it) and takes over the replacement's values: a ``Shard(0)`` DTensor
gives its local shard; another DTensor is gathered first (a collective: every rank adopts at
the same forward); a plain tensor is the full value.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from .layout import ParamLayout

__all__ = ["adopted_shard", "check_replacement"]


def check_replacement(name: str, layout: ParamLayout, mesh: DeviceMesh, replacement: object) -> None:
    """Raises if ``replacement`` cannot stand in for the sharded parameter ``name``.

    Raises:
        TypeError: ``replacement`` is not a floating-point tensor.
        ValueError: Its shape differs from the parameter's, or it is a DTensor on another mesh.
    """
    if not isinstance(replacement, torch.Tensor) or not replacement.is_floating_point():
        raise TypeError(
            f"fully_shard: parameter '{name}' was replaced by {type(replacement).__name__}"
            f"{'' if not isinstance(replacement, torch.Tensor) else f' of dtype {replacement.dtype}'}; "
            "expected a floating-point tensor"
        )
    if tuple(replacement.shape) != tuple(layout.global_shape):
        raise ValueError(
            f"fully_shard: parameter '{name}' was replaced by a tensor of shape {tuple(replacement.shape)}; "
            f"expected its global shape {tuple(layout.global_shape)}"
        )
    if isinstance(replacement, DTensor) and replacement.device_mesh != mesh:
        raise ValueError(
            f"fully_shard: parameter '{name}' was replaced by a DTensor on {replacement.device_mesh}; "
            f"expected one on the unit's mesh {mesh}"
        )


def adopted_shard(layout: ParamLayout, replacement: torch.Tensor) -> torch.Tensor:
    """This rank's rows of ``replacement`` (checked by :func:`check_replacement`)."""
    with torch.no_grad():
        if isinstance(replacement, DTensor):
            # Sharded as the group shards (on the group's mesh, checked): this rank's rows are local.
            *outer, last = tuple(replacement.placements)
            if last == Shard(0) and all(p == Replicate() for p in outer):
                return replacement.to_local()
            return replacement.full_tensor()[layout.local_rows_slice]
        return replacement.detach()[layout.local_rows_slice]
