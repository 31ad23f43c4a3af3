"""Tensors that replaced a sharded parameter in its module, and the values a group takes from them.

``load_state_dict(assign=True)`` and attribute assignment put new tensors where the sharded
parameters were. The group's own sharded parameter stays the module's parameter (optimizers
built earlier keep stepping it) and takes over the replacement's values: a DTensor placed as the
sharded parameter gives its local shard; another DTensor is gathered first (a collective: every
rank adopts at the same forward); a plain tensor is the full value, of which a parameter that
tensor parallelism placed takes its TP rank's part.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from .all_gather_extension import Float8Weight, check_all_gather_extension
from .layout import ParamLayout
from .tensor_parallel import TensorParallel

__all__ = ["adopted_shard", "check_replacement"]


def check_replacement(
    name: str, layout: ParamLayout, sharded: DTensor, replacement: object, float8: Float8Weight | None = None
) -> None:
    """Raises if ``replacement`` cannot stand in for the sharded parameter ``sharded`` (``name``),
    of a group whose compute copy is torchao's ``float8`` weights' (``None``: a plain one).

    Raises:
        TypeError: ``replacement`` is not a floating-point tensor, or defines FSDP2's
            all-gather extension (see :mod:`.all_gather_extension`).
        ValueError: Its shape differs from the parameter's, or it is a DTensor on another mesh.
    """
    if not isinstance(replacement, torch.Tensor) or not replacement.is_floating_point():
        raise TypeError(
            f"fully_shard: parameter '{name}' was replaced by {type(replacement).__name__}"
            f"{'' if not isinstance(replacement, torch.Tensor) else f' of dtype {replacement.dtype}'}; "
            "expected a floating-point tensor"
        )
    check_all_gather_extension(name, replacement, float8=float8, replacement=True)
    if tuple(replacement.shape) != tuple(sharded.shape):
        raise ValueError(
            f"fully_shard: parameter '{name}' was replaced by a tensor of shape {tuple(replacement.shape)}; "
            f"expected its global shape {tuple(sharded.shape)}"
        )
    if isinstance(replacement, DTensor) and replacement.device_mesh != sharded.device_mesh:
        raise ValueError(
            f"fully_shard: parameter '{name}' was replaced by a DTensor on {replacement.device_mesh}; "
            f"expected one on the unit's mesh {sharded.device_mesh}"
        )


def adopted_shard(
    layout: ParamLayout, sharded: DTensor, tensor_parallel: TensorParallel | None, replacement: torch.Tensor
) -> torch.Tensor:
    """This rank's rows of ``replacement`` (checked by :func:`check_replacement`), as the
    sharded parameter ``sharded`` holds them."""
    with torch.no_grad():
        if isinstance(replacement, DTensor):
            # Placed as the group places (on the group's mesh, checked): this rank's rows are local.
            if tuple(replacement.placements) == tuple(sharded.placements):
                return replacement.to_local()
            replacement = replacement.full_tensor()
        whole = replacement.detach()
        if tensor_parallel is not None:
            whole = tensor_parallel.local_of(whole)
        return whole[layout.local_rows_slice]
