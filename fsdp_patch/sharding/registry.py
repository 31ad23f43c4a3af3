"""Which parameter group manages a sharded parameter, and which original parameters sharding replaced.

A registry rather than an attribute on the parameter, so that copies of a parameter (deepcopy,
pickling of an optimizer) are not mistaken for FSDP-managed ones and do not drag the group's
buffers along. Weak both ways: the group holds its parameters, so a strong value would keep the
keys, and every sharded model, alive.
"""

from __future__ import annotations

import weakref

import torch
from torch.distributed.tensor import DTensor
from torch.utils.weak import WeakIdKeyDictionary

from .parameter_group import ParameterGroup

__all__ = [
    "contained_in_parameter_group",
    "parameter_group_of",
    "record_replaced",
    "register_group",
    "replaced_by_sharding",
    "replaced_original",
]

_GROUP_OF: WeakIdKeyDictionary = WeakIdKeyDictionary()
# Original parameter -> what it was, for parameters that a unit replaced; a later unit that still
# finds one of them registered somewhere has found a parameter tied across units.
_REPLACED: WeakIdKeyDictionary = WeakIdKeyDictionary()


def register_group(group: ParameterGroup) -> None:
    """Makes :func:`parameter_group_of` find ``group`` for each of its sharded parameters."""
    ref = weakref.ref(group)
    for param in group.params:
        _GROUP_OF[param] = ref


def parameter_group_of(parameter: torch.Tensor) -> ParameterGroup | None:
    """The group that manages ``parameter``, or ``None`` for a parameter FSDP does not own."""
    ref = _GROUP_OF.get(parameter)
    return None if ref is None else ref()


def contained_in_parameter_group(parameter: torch.Tensor) -> bool:
    """Whether ``parameter`` is a sharded parameter managed by ``fully_shard``."""
    return parameter_group_of(parameter) is not None


def record_replaced(param: torch.Tensor, what: str) -> None:
    """Remember that ``fully_shard`` replaced the original parameter ``param`` (``what`` names it)."""
    _REPLACED[param] = what


def replaced_original(param: torch.Tensor) -> str | None:
    """What ``param`` was, if this package's ``fully_shard`` replaced it; else ``None``."""
    return _REPLACED.get(param)


def replaced_by_sharding(param: torch.Tensor) -> str | None:
    """What ``param`` was, if it is an original parameter that ``fully_shard`` (this package's, or
    torch FSDP2's where its version tags originals) replaced by a sharded one; else ``None``."""
    what = replaced_original(param)
    if what is not None:
        return what
    # torch FSDP2 (2.12 and newer) tags each original parameter with a uid when it shards it; its
    # sharded parameters are DTensors.
    if getattr(param, "_fsdp_orig_uid", None) is not None and not isinstance(param, DTensor):
        return "an original parameter of a module torch FSDP2's fully_shard sharded"
    return None
