"""The sharded models above an optimizer's parameters: their roots and units.

An optimizer holds parameters, not modules; what happens in a model's forward and backward is
seen on its modules. For parameters that ``fully_shard`` manages (this package's or torch
FSDP2's), this finds each unit (a module ``fully_shard`` was applied to) and, from the units, the
outermost one: the root, whose ``named_modules()`` names every module the way the model the
user holds names it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from .fsdp2 import fsdp2_groups
from .fsdp_module import FSDPModule
from .module import all_units, unit_module_of
from .sharding import parameter_group_of

__all__ = ["ShardedModel", "is_sharded_unit", "sharded_models"]


def is_sharded_unit(module: nn.Module) -> bool:
    """Whether ``fully_shard`` (this package's or torch FSDP2's) was applied to ``module``."""
    if isinstance(module, FSDPModule):
        return True
    try:
        from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
    except ImportError:  # pragma: no cover - torch built without distributed
        return False
    return isinstance(module, TorchFSDPModule)


@dataclass(frozen=True, eq=False)
class ShardedModel:
    """One sharded model: its root unit and every unit under it.

    Attributes:
        root: The outermost unit.
        units: ``(fully qualified name, module)`` of every unit, as ``root.named_modules()``
            gives them (``""`` for the root itself), in that order.
    """

    root: nn.Module
    units: tuple[tuple[str, nn.Module], ...]

    def named_modules(self) -> Iterator[tuple[str, nn.Module]]:
        """Every module of the model, named from the root."""
        return self.root.named_modules()


def _unit_modules(params: Iterable[torch.Tensor]) -> list[nn.Module]:
    params = list(params)
    found: dict[int, nn.Module] = {}
    for param in params:
        group = parameter_group_of(param)
        module = unit_module_of(group) if group is not None else None
        if module is not None:
            found.setdefault(id(module), module)
    for fsdp2 in fsdp2_groups(params):
        for module in getattr(fsdp2.fsdp_group, "modules", ()) or ():
            found.setdefault(id(module), module)
    return list(found.values())


def _every_unit() -> list[nn.Module]:
    """Every live unit of this package and of torch FSDP2."""
    units = all_units()
    try:
        from torch.distributed._composable_state import _module_state_mapping
    except ImportError:  # pragma: no cover - torch built without distributed
        return units
    # torch keeps each FSDP2 module's state under the module (what its _get_module_fsdp_state reads).
    units.extend(m for m in list(_module_state_mapping.keys()) if is_sharded_unit(m))
    return units


def sharded_models(params: Iterable[torch.Tensor]) -> list[ShardedModel]:
    """The sharded models holding ``params`` (for example an optimizer's), each once.

    A model's root is the outermost unit containing a unit that holds one of ``params`` (a root
    that owns no parameter of its own is found too); a model whose root was never passed to
    ``fully_shard`` has one per outermost sharded child.
    """
    holding = _unit_modules(params)
    if not holding:
        return []
    candidates = {id(m): m for m in [*_every_unit(), *holding]}
    contained: dict[int, set[int]] = {key: {id(sub) for sub in m.modules()} for key, m in candidates.items()}
    roots: dict[int, nn.Module] = {}
    for module in holding:
        around = [key for key, inner in contained.items() if id(module) in inner]
        outermost = [key for key in around if not any(key in contained[other] for other in around if other != key)]
        root = candidates[outermost[0]] if outermost else module
        roots.setdefault(id(root), root)
    return [
        ShardedModel(root, tuple((name, m) for name, m in root.named_modules() if is_sharded_unit(m)))
        for root in roots.values()
    ]
