"""Whether tensors a process-wide call was given are a model's parameters (a ``clip_grad_norm_``
of one model among several), known without Python per parameter on the steps that ask again.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

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


def _holds(refs: dict[int, weakref.ref[torch.Tensor]], tensor: torch.Tensor) -> bool:
    held = refs.get(id(tensor))
    return held is not None and held() is tensor
