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
- torch FSDP2's private state (read by ``fsdp_patch.torch_interop.fsdp2`` only): an ``FSDPState`` holds its
  parameter groups as the list ``_fsdp_param_groups`` where torch supports a mesh per parameter
  (2.12 on), before that as the single ``_fsdp_param_group`` (or ``None``). The mixed-precision
  policy is kept per ``FSDPParam`` (``FSDPParam.mp_policy``, resolved for that parameter on
  torches whose policy can override the dtype per parameter, 2.15 on); ``FSDPParamGroup.mp_policy``
  is the older, per-group place and is gone on the newest torch. Where neither shape is found
  (a torch newer than this module), FSDP2 parameters are treated as torch would without
  fsdp_patch, and a warning says once what is missing rather than telemetry going quiet.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "all_gather_flat",
    "foreach_clone",
    "fsdp2_param_dtype",
    "fsdp2_state_param_groups",
    "fsdp2_tensor_parallel_spec",
    "reduce_scatter_flat",
]

_warned: set[str] = set()


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


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def fsdp2_state_param_groups(state: Any) -> list[Any]:
    """The ``FSDPParamGroup`` objects of one torch FSDP2 ``FSDPState`` (none before its module is sharded)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    try:
        group = state._fsdp_param_group
    except AttributeError:
        _warn_once(
            "param_groups",
            f"fsdp_patch: torch {torch.__version__}'s FSDP2 state has neither _fsdp_param_groups nor "
            "_fsdp_param_group; fsdp_patch cannot find FSDP2's parameter groups, so FSDP2 parameters get "
            "no FSDP2 telemetry (training is unaffected)",
        )
        return []
    return [] if group is None else [group]


def fsdp2_param_dtype(group: Any, fsdp_param: Any) -> torch.dtype | None:
    """The ``MixedPrecisionPolicy.param_dtype`` FSDP2 applies to one parameter (``None``: no cast)."""
    policy = getattr(fsdp_param, "mp_policy", None)
    if policy is None:
        policy = getattr(group, "mp_policy", None)
    if policy is None:
        _warn_once(
            "mp_policy",
            f"fsdp_patch: torch {torch.__version__}'s FSDP2 keeps no mp_policy on FSDPParam nor on "
            "FSDPParamGroup; fsdp_patch takes FSDP2's parameters as computing in their own dtype",
        )
        return None
    return policy.param_dtype


def fsdp2_tensor_parallel_spec(fsdp_param: Any) -> Any:
    """The DTensor spec tensor parallelism gave an FSDP2 parameter before FSDP2 sharded it
    (``FSDPParam._unsharded_dtensor_spec`` from torch 2.13 on, ``_tp_spec`` before), or ``None``
    for a plain parameter."""
    if not getattr(fsdp_param, "is_dtensor", False):
        return None
    spec = getattr(fsdp_param, "_unsharded_dtensor_spec", None)
    return spec if spec is not None else getattr(fsdp_param, "_tp_spec", None)
