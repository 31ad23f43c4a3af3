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
whose shape differs across the supported releases: ``fsdp_patch.torch_interop.torch_compat`` reads them (a
torch without them gives no groups, and the adapter then sees plain parameters).

Where torch's policy sets the compute dtype per parameter (``param_dtype_override_fn``), the
parameters of one FSDP2 group that are cast to different dtypes form one :class:`FSDP2Group`
each, so that every group here has a single compute dtype.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.tensor import Shard

from .torch_compat import fsdp2_param_dtype, fsdp2_state_param_groups, fsdp2_tensor_parallel_spec

__all__ = ["FSDP2Group", "fsdp2_groups"]


@dataclass(eq=False)
class FSDP2Group:
    """The parameters of one FSDP2 parameter group that an optimizer holds.

    Attributes:
        params: Sharded ``DTensor`` parameters, in the optimizer's order.
        compute_dtype: The dtype FSDP2 casts them to at its next all-gather (the module's
            ``MixedPrecisionPolicy.param_dtype``); ``None`` when FSDP2 does not cast them.
        process_group: The group the parameters are sharded over.
        others: The group's other sharded parameters, which the optimizer does not hold (they
            train like the rest, but nothing steps them), in FSDP2's order.
        fsdp_params: FSDP2's ``FSDPParam`` of each of :attr:`members`, for their names.
        fsdp_group: FSDP2's ``FSDPParamGroup``, for the name of its module.
    """

    params: list[nn.Parameter]
    compute_dtype: torch.dtype | None
    process_group: Any
    others: list[nn.Parameter] = field(default_factory=list)
    fsdp_params: list[Any] = field(default_factory=list, repr=False)
    fsdp_group: Any = field(default=None, repr=False)

    @property
    def members(self) -> list[nn.Parameter]:
        """Every sharded parameter of the group: the optimizer's, then :attr:`others`."""
        return [*self.params, *self.others]

    @property
    def tensor_parallel_split(self) -> list[bool]:
        """Per member, whether tensor parallelism splits it over its ranks (``Shard``) rather than
        copying it on each."""
        specs = [fsdp2_tensor_parallel_spec(p) for p in self.fsdp_params]
        return [spec is not None and isinstance(spec.placements[0], Shard) for spec in specs]

    @property
    def replicate_group(self) -> Any:
        """HSDP's group of this rank's replicas (ranks that hold the same shard), or ``None``."""
        mesh_info = getattr(self.fsdp_group, "mesh_info", None)
        return getattr(mesh_info, "replicate_process_group", None)

    @property
    def tensor_parallel_group(self) -> Any:
        """The process group of the TP mesh of the members tensor parallelism placed, or ``None``."""
        specs = (fsdp2_tensor_parallel_spec(p) for p in self.fsdp_params)
        return next((spec.mesh.get_group() for spec in specs if spec is not None), None)

    @property
    def main_weights(self) -> list[torch.Tensor]:
        """This rank's shards of :attr:`members`, without padding."""
        return [p._local_tensor for p in self.members]  # type: ignore[attr-defined]

    @property
    def main_grads(self) -> list[torch.Tensor]:
        """This rank's grad shards of the members that have a grad."""
        return [g for g in self.local_grads if g is not None]

    @property
    def local_grads(self) -> list[torch.Tensor | None]:
        """This rank's grad shard of each of :attr:`members` (``None`` where it has none)."""
        return [None if (g := p.grad) is None else getattr(g, "_local_tensor", g) for p in self.members]

    @property
    def unit_name(self) -> str:
        """The fully qualified name of the module FSDP2 sharded into this group (``""`` for the root)."""
        return getattr(self.fsdp_group, "_module_fqn", None) or ""

    @property
    def names(self) -> list[str]:
        """Fully qualified names of :attr:`members`, as FSDP2 records them at its lazy initialization
        (before the first forward: the unit's name and the parameter's own)."""
        names = []
        for index, fsdp_param in enumerate(self.fsdp_params):
            name = getattr(fsdp_param, "_param_fqn", None)
            if not name:
                info = getattr(fsdp_param, "_module_info", None)
                own = getattr(info, "param_name", None) or f"param{index}"
                name = f"{self.unit_name}.{own}" if self.unit_name else own
            names.append(name)
        return names


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
            found = groups[(id(group), compute_dtype)] = FSDP2Group(
                [], compute_dtype, _process_group(group), fsdp_group=group
            )
        if not any(p is param for p in found.params):
            found.params.append(cast(nn.Parameter, param))  # FSDP2 manages it: a sharded parameter
            found.fsdp_params.append(fsdp_param)
    # The group's parameters the optimizer does not hold join the part of that group with their
    # compute dtype, or a part of their own (nothing in it is stepped).
    held = {id(p) for found in groups.values() for p in found.params}
    for found in list(groups.values()):
        group = found.fsdp_group
        for fsdp_param in group.fsdp_params:
            other = fsdp_param.sharded_param
            if id(other) in held:
                continue
            held.add(id(other))
            dtype = fsdp2_param_dtype(group, fsdp_param)
            compute_dtype = None if dtype in (None, other.dtype) else dtype
            part = groups.get((id(group), compute_dtype))
            if part is None:
                part = groups[(id(group), compute_dtype)] = FSDP2Group(
                    [], compute_dtype, _process_group(group), fsdp_group=group
                )
            part.others.append(other)
            part.fsdp_params.append(fsdp_param)
    return list(groups.values())
