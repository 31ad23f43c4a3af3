"""Which ATen operations the operation audit (:mod:`.op_audit`) measures, and which it passes through.

Operations that compute nothing (views and metadata), read uninitialized memory, only move values
or create zeros and ones are never judged, though shadows pass through them; random operations are
not re-run (their shadow is their result). Selections along a dimension are judged for ties.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["is_selection", "measured"]

# Operations that compute nothing (views and metadata), read uninitialized memory, or only move
# values: never judged, though shadows pass through them.
_MOVES = frozenset(
    {
        "detach",
        "alias",
        "lift_fresh",
        "lift_fresh_copy",
        "_local_scalar_dense",
        "set_",
        "resize_",
        "_unsafe_view",
        "clone",
        "contiguous",
        "_to_dense",
        "cat",
        "stack",
        "index",
        "index_select",
        "gather",
        "t",
        "unsqueeze",
        "squeeze",
        "expand",
        "permute",
        "view",
        "reshape",
        "split",
        "split_with_sizes",
        "unbind",
        "select_backward",
        "slice_backward",
        "equal",
        "is_same_size",
        "record_stream",
        "_has_compatible_shallow_copy_type",
        "_pin_memory",
        "_copy_from_and_resize",
    }
)
_UNINITIALIZED = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})
_CREATES = frozenset({"zero_", "zeros", "zeros_like", "ones", "ones_like", "new_zeros", "new_ones"})
_SELECTIONS = frozenset({"topk", "max", "min", "argmax", "argmin"})


def is_selection(func: Any, name: str) -> bool:
    """Whether the operation selects along a dimension (``topk``, ``max``/``argmax`` with a ``dim``)."""
    if name in ("max", "min"):
        return bool(func._overloadname == "dim")
    return name in _SELECTIONS


def measured(func: Any, name: str) -> bool:
    """Whether the audit measures the operation ``func`` (``name``: its name without overload):
    not a view, a move, a read of uninitialized memory, a creation of zeros or ones, or a random
    operation (which is not re-run)."""
    random = torch.Tag.nondeterministic_seeded in func.tags
    return not (func.is_view or name in _MOVES or name in _UNINITIALIZED or name in _CREATES or random)
