"""The sharded models above an optimizer's parameters: their roots and units.

An optimizer holds parameters, not modules; what happens in a model's forward and backward is
seen on its modules. For parameters that ``fully_shard`` manages (this package's or torch
FSDP2's), this finds each unit (a module ``fully_shard`` was applied to) and, from the units, the
outermost one: the root, whose ``named_modules()`` names every module relative to itself.

The user may hold the root inside a module of their own (a LightningModule's ``self.model``), and
knows the names that module gives. :func:`holder_prefix` is where the root sits in the outermost
module holding it, and :func:`user_name` turns a name relative to a unit's root into the user's.

Alternatives considered (for finding the holder):
    - The module whose forward runs around the root's (a global forward hook): Lightning calls
      ``training_step``, not the LightningModule's forward, so none does.
    - Names relative to the sharded root only: a Lightning user searches ``model.layers.0`` for
      what their module calls ``model.model.layers.0``.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from ..sharding import parameter_group_of
from ..torch_interop.fsdp2 import fsdp2_groups
from .fsdp_module import FSDPModule
from .shard_module import all_units, unit_module_of

__all__ = [
    "ShardedModel",
    "group_prefix",
    "holder_prefix",
    "is_sharded_unit",
    "sharded_models",
    "unit_prefix",
    "user_name",
]


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
        prefix: :func:`holder_prefix` of the root.
    """

    root: nn.Module
    units: tuple[tuple[str, nn.Module], ...]
    # Where the root sits in the module the user holds (holder_prefix): what user_name prepends.
    prefix: str = ""

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
        ShardedModel(
            root, tuple((name, m) for name, m in root.named_modules() if is_sharded_unit(m)), unit_prefix(root)
        )
        for root in roots.values()
    ]


# Wrappers whose attribute name is no part of the names a user knows (``compiled._orig_mod.x``).
_TRANSPARENT_HOLDERS = ("OptimizedModule",)


def _parents() -> dict[int, list[tuple[nn.Module, str]]]:
    """Every live module's holders, by the child's id, with the child's name in each."""
    parents: dict[int, list[tuple[nn.Module, str]]] = {}
    for obj in gc.get_objects():
        if issubclass(type(obj), nn.Module):  # type(): a proxy's __class__ may warn (torch.distributed.reduce_op)
            for name, child in obj._modules.items():
                if child is not None:
                    parents.setdefault(id(child), []).append((obj, name))
    return parents


def holder_prefix(root: nn.Module) -> str:
    """Where ``root`` sits in the outermost module holding it, as a name prefix (``"model."``), or ``""``.

    Modules do not know their parents: they are found among the live modules' children
    (:func:`gc.get_objects`, one pass over the tracked objects per call: callers keep the result).
    The walk goes up while exactly one module holds the current one: a module shared by two
    parents has no one name, and the names stay relative to it.
    """
    parents = _parents()
    names: list[str] = []
    current, seen = root, {id(root)}
    while True:
        holders = [(owner, name) for owner, name in parents.get(id(current), []) if id(owner) not in seen]
        if len(holders) != 1:
            break
        current, name = holders[0]
        seen.add(id(current))
        if type(current).__name__ not in _TRANSPARENT_HOLDERS:
            names.append(name)
    return "".join(f"{name}." for name in reversed(names))


def user_name(prefix: str, name: str) -> str:
    """``name`` (relative to a root; ``""`` is the root) as the holder names it, ``prefix`` from :func:`holder_prefix`."""
    if not prefix:
        return name
    return prefix + name if name else prefix[:-1]


_UNIT_PREFIX: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()


def unit_prefix(unit: nn.Module | None) -> str:
    """The :func:`holder_prefix` of the root of ``unit`` (a module ``fully_shard`` was applied to),
    found once per unit and kept while it lives; ``""`` for ``None``."""
    if unit is None:
        return ""
    try:
        return _UNIT_PREFIX[unit]
    except KeyError:
        pass
    around = [m for m in _every_unit() if any(sub is unit for sub in m.modules())]
    outermost = [
        m for m in around if not any(m is not other and any(s is m for s in other.modules()) for other in around)
    ]
    root = outermost[0] if outermost else unit
    prefix = _UNIT_PREFIX.get(root)  # the units of one root share its walk
    if prefix is None:
        prefix = _UNIT_PREFIX[root] = holder_prefix(root)
    _UNIT_PREFIX[unit] = prefix
    return prefix


def group_prefix(group: object) -> str:
    """The :func:`unit_prefix` of the unit holding ``group``: a ``fully_shard`` parameter group, or
    an :class:`~fsdp_patch.torch_interop.fsdp2.FSDP2Group`; ``""`` for anything else (a stand-in in a test)."""
    fsdp_group = getattr(group, "fsdp_group", None)
    if fsdp_group is not None:
        modules = getattr(fsdp_group, "modules", None) or ()
        return unit_prefix(modules[0]) if modules else ""
    try:
        return unit_prefix(unit_module_of(group))  # type: ignore[arg-type]
    except TypeError:  # not weakly referable: not a ParameterGroup
        return ""
