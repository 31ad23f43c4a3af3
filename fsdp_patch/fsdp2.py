"""torch FSDP2's parameter groups, seen from an optimizer's parameters.

An optimizer over a model sharded by ``torch.distributed.fsdp.fully_shard`` (FSDP2) holds the
sharded ``DTensor`` parameters; FSDP2 keeps them in fp32 (or whatever dtype the module had) and
casts them to its ``MixedPrecisionPolicy.param_dtype`` at every all-gather. Nothing needs casting
or refreshing around the optimizer step, so the adapter only observes these parameters; this
module finds, for each, the FSDP2 parameter group (``FSDPParamGroup``, one per ``fully_shard``
call) it belongs to, the compute dtype that group casts to, and the process group it is sharded
over.

torch keeps no link from a sharded parameter back to its group: FSDP2 registers each module's
``FSDPState`` in ``torch.distributed._composable_state._module_state_mapping`` (what
``_get_module_fsdp_state`` reads), and each state's parameter groups list their ``FSDPParam``
objects, whose ``sharded_param`` is what the optimizer holds. Those are private names of torch,
whose shape differs across the supported releases: ``fsdp_patch.torch_compat`` reads them (a
torch without them gives no groups, and the adapter then sees plain parameters).

Where torch's policy sets the compute dtype per parameter (``param_dtype_override_fn``), the
parameters of one FSDP2 group that are cast to different dtypes form one :class:`FSDP2Group`
each, so that every group here has a single compute dtype.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .torch_compat import fsdp2_param_dtype, fsdp2_state_param_groups

__all__ = ["FSDP2Group", "fsdp2_groups"]


@dataclass(eq=False)
class FSDP2Group:
    """The parameters of one FSDP2 parameter group that an optimizer holds.

    Attributes:
        params: Sharded ``DTensor`` parameters, in the optimizer's order.
        compute_dtype: The dtype FSDP2 casts them to at its next all-gather (the module's
            ``MixedPrecisionPolicy.param_dtype``); ``None`` when FSDP2 does not cast them.
        process_group: The group the parameters are sharded over.
    """

    params: list[nn.Parameter]
    compute_dtype: torch.dtype | None
    process_group: Any

    @property
    def main_weights(self) -> list[torch.Tensor]:
        """This rank's shards (the tensors the optimizer updates), without padding."""
        return [p._local_tensor for p in self.params]

    @property
    def main_grads(self) -> list[torch.Tensor]:
        """This rank's grad shards of the parameters that have a grad."""
        return [p.grad._local_tensor if hasattr(p.grad, "_local_tensor") else p.grad
                for p in self.params if p.grad is not None]  # fmt: skip


def _fsdp2_params() -> dict[int, tuple[Any, Any]]:
    """``id(sharded_param) -> (FSDPParamGroup, FSDPParam)`` over every live FSDP2 module."""
    try:
        from torch.distributed._composable_state import _module_state_mapping
        from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
    except ImportError:  # pragma: no cover - torch built without distributed, or renamed internals
        return {}
    found: dict[int, tuple[Any, Any]] = {}
    for state_ref in list(_module_state_mapping.values()):
        state = state_ref()
        if not isinstance(state, FSDPState):
            continue
        for group in fsdp2_state_param_groups(state):
            for fsdp_param in group.fsdp_params:
                found[id(fsdp_param.sharded_param)] = (group, fsdp_param)
    return found


def _process_group(group: Any) -> Any:
    mesh_info = group.mesh_info
    pg = getattr(mesh_info, "shard_process_group", None)
    return pg if pg is not None else mesh_info.mesh.get_group()


def fsdp2_groups(params: Iterable[torch.Tensor]) -> list[FSDP2Group]:
    """The FSDP2 parameter groups among ``params``, in first-seen order.

    Args:
        params: Parameters, for example every parameter of an optimizer's param groups.

    Returns:
        One :class:`FSDP2Group` per FSDP2 parameter group with a parameter in ``params``;
        parameters FSDP2 does not manage are left out.
    """
    params = list(params)
    if not params:
        return []
    managed = _fsdp2_params()
    if not managed:
        return []
    groups: dict[tuple[int, torch.dtype | None], FSDP2Group] = {}
    for param in params:
        entry = managed.get(id(param))
        if entry is None:
            continue
        group, fsdp_param = entry
        dtype = fsdp2_param_dtype(group, fsdp_param)
        compute_dtype = None if dtype in (None, param.dtype) else dtype
        found = groups.get((id(group), compute_dtype))
        if found is None:
            found = groups[(id(group), compute_dtype)] = FSDP2Group([], compute_dtype, _process_group(group))
        if not any(p is param for p in found.params):
            found.params.append(param)
    return list(groups.values())

