"""``Module._apply`` (``.to()``, ``.float()``, ``.cpu()``, ``to_empty`` and the rest) on a sharded module.

What :meth:`FSDPModule._apply <fsdp_patch.module.fsdp_module.FSDPModule._apply>` runs around
``Module._apply``: a check that refuses, before anything is converted, a conversion that would
change a sharded parameter's dtype or device; then the sharded parameters taken out of their
modules while the buffers are converted, and put back.

Alternatives considered:
    - Converting the sharded parameters in ``Module._apply`` (``.to()``, ``.float()``) as FSDP2
      does: the main-weight dtype is the policy's and the compute dtype is fixed when the flat
      buffers are built, so a conversion that would change them is refused and one that would
      not leaves them alone (buffers are converted as usual).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from ..sharding import ParameterGroup

if TYPE_CHECKING:
    from .unit import UnitState

__all__ = ["inside_conversion", "sharded_parameters_kept"]


class _ApplyDepth(threading.local):
    depth = 0


# Set while an outer FSDP unit runs Module._apply: the units inside it were checked already.
_APPLYING = _ApplyDepth()


def inside_conversion() -> bool:
    """Whether an outer unit's ``Module._apply`` is running: it checked the units inside it."""
    return _APPLYING.depth > 0


@contextmanager
def sharded_parameters_kept(units: list[UnitState], fn: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[None]:
    """Around ``Module._apply(fn)`` of the modules holding ``units``: refuses ``fn`` if it would
    change a sharded parameter's dtype or device, else takes the sharded parameters out of their
    modules (``Module._apply`` skips ``None``) and puts them back afterwards.

    Raises:
        ValueError: ``fn`` would change a sharded parameter's dtype or device.
    """
    for unit in units:
        for group in unit.groups:
            _check_conversion(fn, group)
    _APPLYING.depth += 1
    for unit in units:
        for group_locations in unit.locations:
            for places in group_locations:
                for owner, name in places:
                    owner._parameters[name] = None
    try:
        yield
    finally:
        _APPLYING.depth -= 1
        for unit in units:
            unit.swap(unsharded=False)


def _check_conversion(fn: Callable[[torch.Tensor], torch.Tensor], group: ParameterGroup) -> None:
    # What fn does to a tensor of the sharded parameters' dtype and device: an empty probe
    # costs nothing and tells, without converting the (possibly large) main weights.
    probe = torch.empty(0, dtype=group.main_dtype, device=group.main_weight.device)
    converted = fn(probe)
    if converted.dtype == probe.dtype and converted.device == probe.device:
        return
    raise ValueError(
        f"fully_shard: this conversion would change sharded parameter '{group.names[0]}' from "
        f"{probe.dtype} on {probe.device} to {converted.dtype} on {converted.device}; nothing was converted. "
        "The sharded parameters are the main weights, whose dtype MixedPrecisionPolicy(main_params_dtype=...) "
        f"sets, and the compute dtype ({group.compute_dtype} here) is MixedPrecisionPolicy(param_dtype=...) or the "
        "module's dtype when fully_shard was applied: set param_dtype (or convert the module with model.to(dtype) "
        "before fully_shard), and shard the module on the device it trains on"
    )
