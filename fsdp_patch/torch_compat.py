"""What differs between the torch releases fsdp_patch supports (2.11 and newer), in one place.

Every choice here is made by feature detection (does torch have the function or attribute?),
never by comparing version strings: a nightly, a vendor build or a backport then gets the path
that its features allow.

- Flat collectives: ``all_gather_single`` / ``reduce_scatter_single`` (torch >= 2.13) and
  ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` (every supported torch) take the same
  arguments and issue the same collective; the newer names are preferred where they exist.
  They are looked up at each call, so that a test (or a profiler) that wraps
  ``torch.distributed``'s attributes sees every collective fsdp_patch issues.
- ``torch._foreach_clone`` is missing from some builds; a list of ``clone()`` is equivalent.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["all_gather_flat", "reduce_scatter_flat", "foreach_clone"]


def all_gather_flat(output: torch.Tensor, input: torch.Tensor, **kwargs: Any) -> Any:
    """All-gathers ``input`` of every rank into the flat ``output`` (rank ``r`` at ``r * input.numel()``)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, input, **kwargs)


def reduce_scatter_flat(output: torch.Tensor, input: torch.Tensor, **kwargs: Any) -> Any:
    """Reduces the flat ``input`` over ranks and scatters: rank ``r`` gets slice ``r`` into ``output``."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(output, input, **kwargs)


def foreach_clone(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Clones of ``tensors`` (one fused op where torch has it)."""
    clone = getattr(torch, "_foreach_clone", None)
    if clone is not None:
        return list(clone(list(tensors)))
    return [tensor.clone() for tensor in tensors]
