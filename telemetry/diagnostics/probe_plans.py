"""How a list of tensors checked at every step is reduced: planned once, a few calls a step.

A :class:`ReductionPlan` takes the tensors of one dtype and device that a step checks together
(each parameter's main weight, a group's reduced grads, ``fully_shard``'s flat buffers of main
weights) and decides once how to reduce them:

- ``FUSED``: a list on a GPU, by one ``torch._foreach_norm(tensors, inf)`` (each tensor's largest
  magnitude: NaN when it holds a NaN, Inf when an Inf), read back as ``(-peak, peak)``, with no
  Python per tensor;
- ``CONCATENATED``: a list of small tensors on a CPU whose values may be pooled
  (:class:`~.probes.PreparedChecks`' ``pooled``: the main weights, read only as finite or not; a
  unit's reduced grads), copied by one ``torch.cat`` into a staging buffer the plan keeps and
  reduced by one ``torch.aminmax``: the pool's least and greatest value. Only where that is not
  finite are the tensors told apart, on the host, from the staging buffer, which still holds them
  as they were checked (:meth:`ReductionPlan.each_value`): each reduce copies into a buffer of its
  own, held by the log that keeps its values until that log is read, and given back to the plan
  for a later reduce only once it was read finite ([Note: a staging buffer per reduce]);
- ``EACH``: one ``torch.aminmax`` per tensor (on a CPU, a list not pooled or of large tensors:
  there ``_foreach_norm(inf)`` costs as much per tensor and is about ten times slower per element);
- ``LOCATED``: a flat buffer holding several parameters (where it is not concatenated: there the
  staging buffer places a non-finite element as the host reads it), by ``torch.min`` and ``torch.max``
  along it, which give where the least and greatest values are as well: a NaN's place (both
  reductions propagate it, with its index), an Inf's. So one reduction per buffer still names the
  parameter a non-finite element belongs to (:class:`~.probes.PreparedChecks`' segments), as it
  was when checked: by the time the host reads it, a forward may have spread it to every parameter.

The output is one or two 1-d tensors (the "chunks": the values, and a ``LOCATED`` plan's int64
indices, kept apart so that an index past float32's exact integers stays exact) and, per tensor,
where its least and greatest values are in the first. Finite, NaN, magnitude and all-zero read the
same from every kind.

[Note: one fused reduction per list on a GPU]
On a GPU a step's checks cost host time, not device time: each ``aminmax`` is a launch and the
Python around it (tens of microseconds), against a pass over memory that takes microseconds. A
list of tensors on one CUDA device is therefore checked by one ``_foreach_norm`` call. On a CPU
that call costs about 1.5 us per tensor (an output allocated for each) and is about ten times
slower per element than ``aminmax``, which costs about 2 us a call; a ``torch.cat`` into a kept
buffer costs 0.2 us per tensor of 256 elements and 1.8 us at 4096, and one ``aminmax`` reads them all.

[Note: a staging buffer per reduce]
A log is read an iteration after its checks ran, and by then the same list has been checked again
(the next iteration's weights, FSDP2's reduced grads of the next backward, or of the next
microbatch in the same iteration). A staging buffer kept by the plan and copied into at every
reduce would then hold the later values, and a list found non-finite would be told apart from
values that are not the ones checked. So every reduce takes a buffer of its own
(:attr:`ReductionPlan.staged`), a spare one given back where there is one: the log holding it
gives it back (:meth:`ReductionPlan.give_back`) once it was read and found finite, when nothing
will read it again; a buffer of a log found non-finite goes with that log.

[Note: concatenating a retargeted list]
A list retargeted every iteration (FSDP2's grads) comes as new tensors of their own shapes, which
``torch.cat`` takes only flattened: a view made per tensor, about 0.3 us each on a CPU.
``torch._chunk_cat(tensors, 0, 1)`` (what FSDP2 packs its reduce-scatter input with) flattens as
it copies, and costs less than the views and a ``cat`` together (0.7 against 1 us per tensor of a
few hundred elements); it takes no 0-d tensor, so a list holding one is flattened. A list planned
once (the main weights) is flattened once, and ``cat`` of flat tensors is cheaper still.

Alternatives considered:
    - ``torch.segment_reduce`` over a flat buffer (a value per parameter): on a CPU it costs as
      much as one ``aminmax`` per segment, where ``LOCATED`` costs two reductions per buffer.
    - Naming the parameter of a flat buffer from the main weights as the host reads the check,
      a step later: the forward between has gathered the weight written, and the update spread
      its NaN over every parameter of the model.
"""

from __future__ import annotations

import math
from collections.abc import Container, Sequence

import torch

__all__ = ["ReductionPlan"]

FUSED = "fused"
CONCATENATED = "concatenated"
EACH = "each"
LOCATED = "located"

# Mean elements per tensor up to which a CPU list is concatenated (see the module's note: past
# about 8192, copying costs more than an aminmax call per tensor), and the most elements a staging
# buffer holds.
CPU_SMALL_NUMEL = 4096
CPU_STAGING_NUMEL = 1 << 24

# Staging buffers a plan keeps for its next reduces: one per log in flight (the running
# iteration's, the one read next) and a microbatch's more.
_SPARE_BUFFERS = 4

# A tensor as the 1-d view one reduction along it reads (FSDP2 retargets a list every iteration:
# a C-level map, no Python frame per tensor).
_FLAT = torch.Tensor.ravel
_DIMS = torch.Tensor.dim


class ReductionPlan:
    """How ``tensors`` (one dtype, one device; plain tensors, none empty) are reduced at each step.

    Args:
        tensors: The tensors, in the order their values are asked for.
        fused_device_types: Device types whose lists are always fused.
        located: Each tensor is a flat buffer whose non-finite elements are to be placed
            (``LOCATED``); else the kind is chosen by device and size.
        concatenate: Whether a finite tensor may read as the whole list's least and greatest
            values (``CONCATENATED``, where the list is small and on a CPU).

    Attributes:
        kind: ``FUSED``, ``CONCATENATED``, ``EACH`` or ``LOCATED``.
        places: Per tensor, ``(low, high, peak)``: the places of its least and greatest values in
            the first chunk; ``peak`` where both are its largest magnitude (its least value is
            then minus it). A ``CONCATENATED`` plan's tensors all share the list's two places.
        widths: The number of values in each chunk :meth:`reduce` makes.
        staged: A ``CONCATENATED`` plan's staging buffer of the last :meth:`reduce` (the values
            as checked; read by :meth:`each_value`), else ``None``.
    """

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        fused_device_types: Container[str],
        located: bool = False,
        concatenate: bool = False,
    ) -> None:
        self.tensors = list(tensors)
        device = self.tensors[0].device
        count = len(self.tensors)
        total = sum(t.numel() for t in self.tensors)
        small = device.type == "cpu" and total <= min(CPU_SMALL_NUMEL * count, CPU_STAGING_NUMEL)
        self.staged: torch.Tensor | None = None
        # Whether :attr:`tensors` are as given, concatenated flattened by ``torch._chunk_cat``
        # ([Note: concatenating a retargeted list]).
        self._chunked = False
        self._numel = total
        self._numels = [t.numel() for t in self.tensors]
        self._spare: list[torch.Tensor] = []  # staging buffers read finite, for the next reduces
        if concatenate and small and count > 1:
            self.kind = CONCATENATED
            self.tensors = list(map(_FLAT, self.tensors))
            self.places = [(0, 1, False)] * count
            self.widths = [2]
        elif located:
            self.kind = LOCATED
            self.tensors = list(map(_FLAT, self.tensors))
            self.places = [(2 * i, 2 * i + 1, False) for i in range(count)]
            self.widths = [2 * count, 2 * count]
        elif device.type in fused_device_types:
            self.kind = FUSED
            self.places = [(i, i, True) for i in range(count)]
            self.widths = [count]
        else:
            self.kind = EACH
            self.places = [(2 * i, 2 * i + 1, False) for i in range(count)]
            self.widths = [2 * count]

    def retarget(self, tensors: Sequence[torch.Tensor]) -> None:
        """Reduce ``tensors`` from now on: new tensors standing for the same ones (same dtypes and
        sizes, so the plan holds)."""
        if self.kind == CONCATENATED and 0 not in map(_DIMS, tensors):
            self.tensors = list(tensors)
            self._chunked = True
        elif self.kind in (LOCATED, CONCATENATED):
            self.tensors = list(map(_FLAT, tensors))
            self._chunked = False
        else:
            self.tensors = list(tensors)

    def reduce(self) -> list[torch.Tensor]:
        """The tensors' values as they are now: 1-d chunks of :attr:`widths` values."""
        if self.kind == FUSED:
            return [torch.stack(torch._foreach_norm(self.tensors, math.inf))]
        if self.kind == CONCATENATED:
            # A buffer of this reduce's own ([Note: a staging buffer per reduce]).
            staging = self._spare.pop() if self._spare else None
            if staging is None:
                staging = torch.empty(self._numel, dtype=self.tensors[0].dtype, device=self.tensors[0].device)
            if self._chunked:
                torch._chunk_cat(self.tensors, 0, 1, out=staging.view(1, -1))
                self.staged = staging
            else:
                self.staged = torch.cat(self.tensors, out=staging)
            return [torch.stack(torch.aminmax(staging))]
        values: list[torch.Tensor] = []
        if self.kind == EACH:
            for t in self.tensors:
                values.extend(torch.aminmax(t))
            return [torch.stack(values)]
        indices: list[torch.Tensor] = []
        for t in self.tensors:
            low, low_at = torch.min(t, 0)
            high, high_at = torch.max(t, 0)
            values += (low, high)
            indices += (low_at, high_at)
        return [torch.stack(values), torch.stack(indices)]

    def give_back(self, staging: torch.Tensor) -> None:
        """``staging`` (a buffer :attr:`staged` once held) was read and will not be again: a later
        :meth:`reduce` may copy into it."""
        if self.kind == CONCATENATED and len(self._spare) < _SPARE_BUFFERS:
            self._spare.append(staging)

    def each_value(self, staging: torch.Tensor) -> list[tuple[float, float, int]]:
        """A ``CONCATENATED`` plan's tensors told apart: each one's least and greatest value as
        the reduce that filled ``staging`` (its :attr:`staged`) copied it, and the place of its
        first NaN (else its first Inf; -1 where it is finite). Read on the host: for a list found
        non-finite only."""
        assert self.kind == CONCATENATED, "each_value() is for a concatenated plan"
        pieces = torch.split(staging, self._numels)
        found = torch.stack([value for piece in pieces for value in torch.aminmax(piece)])
        host = found.double().tolist()
        out: list[tuple[float, float, int]] = []
        for i, piece in enumerate(pieces):
            low, high = host[2 * i], host[2 * i + 1]
            out.append((low, high, -1 if math.isfinite(low) and math.isfinite(high) else first_nonfinite(piece)))
        return out


def first_nonfinite(values: torch.Tensor) -> int:
    """The place of the first NaN in 1-d ``values``, else of the first Inf (-1: none)."""
    for bad in (torch.isnan(values), torch.isinf(values)):
        places = bad.nonzero()
        if places.numel():
            return int(places[0, 0])
    return -1
