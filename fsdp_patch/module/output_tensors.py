"""Finding the tensors that require grad in a forward's inputs or outputs, whatever holds them.

A unit's pre-backward hook goes on the tensors its forward returned, so those must be found in
any structure a model returns: tuples, dicts (``OrderedDict``-based model outputs included),
namedtuples, dataclasses, and plain objects that keep them as attributes. Where nothing is
found, the unit keeps its parameters gathered until the end of backward instead (see
:mod:`fsdp_patch.module.unit`), so a structure this misses costs memory, never a wrong gradient.

Alternatives considered:
    - ``torch.utils._pytree.tree_flatten``: sees only registered containers; a dataclass or a
      plain object holding the logits is one opaque leaf.
    - FSDP2's ``collect_grad_tensors``: traverses dataclasses too, but not plain objects.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

__all__ = ["grad_tensors"]

# Deep enough for any model output seen in practice; the visited set guards against cycles.
_MAX_DEPTH = 16


def grad_tensors(obj: Any) -> list[torch.Tensor]:
    """Tensors that require grad in ``obj``, each once, in traversal order."""
    found: list[torch.Tensor] = []
    _collect(obj, found, set(), 0)
    return found


def _collect(obj: Any, found: list[torch.Tensor], seen: set[int], depth: int) -> None:
    if isinstance(obj, torch.Tensor):
        if obj.requires_grad and id(obj) not in seen:
            seen.add(id(obj))
            found.append(obj)
        return
    if depth >= _MAX_DEPTH or obj is None or isinstance(obj, (str, bytes, int, float, bool, nn.Module, type)):
        return
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, dict):
        children: Any = obj.values()
    elif isinstance(obj, (list, tuple, set, frozenset)):
        children = obj
    elif dataclasses.is_dataclass(obj):
        children = (getattr(obj, field.name) for field in dataclasses.fields(obj))
    else:
        children = getattr(obj, "__dict__", {}).values()
    for child in children:
        _collect(child, found, seen, depth + 1)
