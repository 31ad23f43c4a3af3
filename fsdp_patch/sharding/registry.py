"""Which parameter group manages a sharded parameter.

A registry rather than an attribute on the parameter, so that copies of a parameter (deepcopy,
pickling of an optimizer) are not mistaken for FSDP-managed ones and do not drag the group's
buffers along. Weak both ways: the group holds its parameters, so a strong value would keep the
keys, and every sharded model, alive.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .parameter_group import ParameterGroup

__all__ = ["contained_in_parameter_group", "parameter_group_of", "register_group"]

_GROUP_OF: WeakIdKeyDictionary = WeakIdKeyDictionary()


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
