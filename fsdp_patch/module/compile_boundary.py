"""Keeping ``fully_shard``'s hooks out of ``torch.compile``'s graphs.

A unit's hooks all-gather, free storage (``untyped_storage().resize_``), swap parameters in the
module's ``_parameters`` and register autograd hooks: side effects on state that dynamo cannot
put into a graph (``resize_storage_bytes_`` does not lower, and a traced gather leaves a graph
that reads freed storage). FSDP2 runs its hooks outside dynamo for the same reason
(``_dynamo_disable`` in ``torch.distributed.fsdp._fully_shard._fsdp_common``): dynamo breaks the
graph at each hook, runs the hook eagerly and compiles the module code around it, which then
sees the unsharded parameters as ordinary inputs.

Alternatives considered:
    - ``torch._dynamo.disable`` around every call, as FSDP2 does: the disabled wrapper sets and
      restores the frame-evaluation callback at each hook call, also in eager mode, where nothing
      needs it; here eager calls test one flag and go straight to the hook.
    - Decorating at import with ``torch.compiler.disable``: imports ``torch._dynamo`` (about a
      second) for every program that uses ``fully_shard``, compiled or not.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = ["outside_dynamo"]

_F = TypeVar("_F", bound=Callable[..., Any])


def outside_dynamo(fn: _F) -> _F:
    """``fn`` as is in eager mode; while dynamo traces a caller, a graph break and an eager call.

    ``torch.compiler.is_compiling()`` is a constant to dynamo (``True`` while it traces), so a
    traced caller reaches the disabled function and dynamo falls back to running ``fn`` eagerly;
    ``recursive=True`` keeps everything ``fn`` calls eager as well.
    """

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return torch._dynamo.disable(fn, recursive=True, reason="fully_shard hooks run eagerly")(*args, **kwargs)
        return fn(*args, **kwargs)

    return call  # type: ignore[return-value]
