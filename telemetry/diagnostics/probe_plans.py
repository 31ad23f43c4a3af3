"""How a list of tensors checked at every step is reduced: planned once, one call a step.

A :class:`ReductionPlan` takes the tensors of one dtype and device that a step checks together
(each parameter's main weight, a group's reduced grads) and decides once how to reduce them:

- ``FUSED``: a list on a GPU, or of small tensors on a CPU, by one
  ``torch._foreach_norm(tensors, inf)`` (each tensor's largest magnitude: NaN when it holds a NaN,
  Inf when an Inf), read back as ``(-peak, peak)``, with no Python per tensor;
- ``EACH``: one ``torch.aminmax`` per tensor (large tensors on a CPU, where ``_foreach_norm(inf)``
  is about ten times slower than ``aminmax`` per element and a call's Python is small beside it).

Either way the output is one 1-d tensor (a "chunk") and, per tensor, where its least and greatest
values are in it. Finite, NaN, magnitude and all-zero read the same from both.

[Note: one fused reduction per list on a GPU]
On a GPU a step's checks cost host time, not device time: each ``aminmax`` is a launch and the
Python around it (tens of microseconds), against a pass over memory that takes microseconds. A
list of tensors on one CUDA device is therefore checked by one ``_foreach_norm`` call. On a CPU that
call costs about as much per tensor as one ``aminmax`` at 256 elements and is about ten times
slower per element, so it is used there only for lists of tensors that small on average. Slices
of one flat buffer (``fully_shard``'s main weights, parameter by parameter) could be reduced per
buffer by ``torch.segment_reduce``, but on a CPU that costs as much as one ``aminmax`` per slice.
"""

from __future__ import annotations

import math
from collections.abc import Container, Sequence

import torch

__all__ = ["ReductionPlan"]

FUSED = "fused"
EACH = "each"

# Mean elements per tensor up to which a CPU list is fused (see the module's note).
CPU_FUSED_NUMEL = 256


class ReductionPlan:
    """How ``tensors`` (one dtype, one device; plain tensors, none empty) are reduced at each step.

    Args:
        tensors: The tensors, in the order their values are asked for.
        fused_device_types: Device types whose lists are always fused.

    Attributes:
        kind: ``FUSED`` or ``EACH``.
        places: Per tensor, ``(low, high, peak)``: the places of its least and greatest values in
            :meth:`reduce`'s chunks joined; ``peak`` where both are its largest magnitude (its
            least value is then minus it).
        width: The number of values :meth:`reduce` makes.
    """

    def __init__(self, tensors: Sequence[torch.Tensor], fused_device_types: Container[str]) -> None:
        self.tensors = list(tensors)
        device = self.tensors[0].device
        small = device.type == "cpu" and sum(t.numel() for t in self.tensors) <= CPU_FUSED_NUMEL * len(self.tensors)
        self.kind = FUSED if device.type in fused_device_types or small else EACH
        if self.kind == FUSED:
            self.places = [(i, i, True) for i in range(len(self.tensors))]
            self.width = len(self.tensors)
        else:
            self.places = [(2 * i, 2 * i + 1, False) for i in range(len(self.tensors))]
            self.width = 2 * len(self.tensors)

    def retarget(self, tensors: Sequence[torch.Tensor]) -> None:
        """Reduce ``tensors`` from now on: new tensors standing for the same ones (same dtypes and
        sizes, so the plan holds)."""
        self.tensors = list(tensors)

    def reduce(self) -> list[torch.Tensor]:
        """The tensors' values as they are now: 1-d chunks, :attr:`width` values in all."""
        if self.kind == FUSED:
            return [torch.stack(torch._foreach_norm(self.tensors, math.inf))]
        values: list[torch.Tensor] = []
        for t in self.tensors:
            values.extend(torch.aminmax(t))
        return [torch.stack(values)]
