"""Whether tensors a process-wide call was given are a model's parameters (a ``clip_grad_norm_``
of one model among several), known without Python per parameter on the steps that ask again.
"""

from __future__ import annotations

import itertools
import operator
import weakref
from collections.abc import Callable, Sequence
from typing import cast

import torch
from torch import nn

__all__ = ["ModelParameters"]

# First parameters of other models' clips kept known as foreign: a few, unless re-made each step.
_FOREIGN_KEPT = 64


class ModelParameters:
    """The parameters of the model ``root()`` returns (``None``: gone), read when first asked and
    again whenever a tensor is not found among them (a load may have replaced them). Tensors are
    known by id and a weak reference: a weak set would compare them by value."""

    def __init__(self, root: Callable[[], nn.Module | None]) -> None:
        self._root = root
        self._own: dict[int, weakref.ref[torch.Tensor]] = {}
        self._foreign: dict[int, weakref.ref[torch.Tensor]] = {}
        self._listed: list[weakref.ref[torch.Tensor]] = []

    def listed(self) -> list[torch.Tensor]:
        """The model's parameters, in its order: as last read, read again where one of them is gone."""
        params: list[torch.Tensor | None] = list(map(_DEREF, self._listed))
        if not params or any(map(operator.is_, params, itertools.repeat(None))):
            root = self._root()
            fresh: list[torch.Tensor] = list(root.parameters()) if root is not None else []
            self._listed = list(map(weakref.ref, fresh))
            return fresh
        return cast(list[torch.Tensor], params)

    def hold_any(self, params: Sequence[torch.Tensor]) -> bool:
        """Whether ``params`` are this model's: the first decides (a parameter found foreign stays
        so for as long as it lives)."""
        if not params:
            return False
        first = params[0]
        if _holds(self._own, first):
            return True
        if _holds(self._foreign, first):
            return False
        root = self._root()
        self._own = {id(p): weakref.ref(p) for p in (root.parameters() if root is not None else ())}
        if _holds(self._own, first):
            return True
        if len(self._foreign) >= _FOREIGN_KEPT:
            self._foreign.clear()
        self._foreign[id(first)] = weakref.ref(first)
        return False


_DEREF = weakref.ref.__call__


def _holds(refs: dict[int, weakref.ref[torch.Tensor]], tensor: torch.Tensor) -> bool:
    held = refs.get(id(tensor))
    return held is not None and held() is tensor
