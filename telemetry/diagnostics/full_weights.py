"""A sharded parameter's whole value, gathered with the collective the sharding itself runs.

The float32 shadow (:mod:`.module_shadow`) needs each unit's main weights whole. A DTensor's
``full_tensor()`` gathers them through torch's functional collectives, which a gloo group already
busy with ``fully_shard``'s and FSDP2's own asynchronous collectives does not serve reliably on
every supported torch release; the one flat all-gather into a tensor that the sharding uses
(:func:`fsdp_patch.torch_interop.torch_compat.all_gather_flat`) does. Parameters sharded on their
first dimension over one mesh dimension (``fully_shard`` and FSDP2, HSDP included) are gathered
that way, padded to ``torch.chunk``'s equal chunks; any other layout (tensor parallelism) falls
back to ``full_tensor()``.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from fsdp_patch.torch_interop.torch_compat import all_gather_flat

__all__ = ["full_weight"]


def full_weight(param: DTensor) -> torch.Tensor:
    """``param``'s whole value on every rank of its mesh, detached (a collective: every rank calls it alike)."""
    placements = list(param.placements)
    sharded = [dim for dim, p in enumerate(placements) if isinstance(p, Shard)]
    if (
        len(sharded) != 1
        or placements[sharded[0]] != Shard(0)
        or not all(isinstance(p, Replicate) for dim, p in enumerate(placements) if dim != sharded[0])
    ):
        return param.full_tensor()
    group = param.device_mesh.get_group(sharded[0])
    world = param.device_mesh.size(sharded[0])
    rows = param.shape[0]
    chunk = -(-rows // world)  # torch.chunk's rows per rank; the last ranks may hold fewer, or none
    with torch.no_grad():
        local = param.to_local().detach()
        padded = torch.zeros((chunk, *param.shape[1:]), dtype=local.dtype, device=local.device)
        padded[: local.shape[0]] = local
        gathered = torch.empty((world * chunk, *param.shape[1:]), dtype=local.dtype, device=local.device)
        all_gather_flat(gathered, padded, group=group)
    return gathered[:rows]
