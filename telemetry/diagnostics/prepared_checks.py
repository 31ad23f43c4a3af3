"""What a check is (:class:`Probe`) and a list of tensors checked together at every step
(:class:`PreparedChecks`): the data it reads, how it is reduced (:mod:`.probe_plans`) and its
probes, made once for as long as those tensors last. The iteration's log that runs and reads the
checks is :mod:`.probes`'.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Sequence
from typing import NamedTuple

import torch

from .. import semconv
from .probe_plans import ReductionPlan

__all__ = [
    "AFTER",
    "BEFORE",
    "CLIP",
    "FUSED_DEVICE_TYPES",
    "INPUT",
    "POOL_LIST",
    "POOL_WHERE",
    "PreparedChecks",
    "Probe",
    "checkable",
    "dtype_name",
    "grads_at_step",
]

# Which side of a step or a reduce a check was made on (Probe.when), and the model's own input.
BEFORE = "before"
AFTER = "after"
INPUT = "input"
CLIP = semconv.ORIGIN_WHERE_CLIP

# How far a prepared list's tensors may be pooled (PreparedChecks' ``pooled``).
POOL_WHERE = "where"
POOL_LIST = "list"


# The device types whose checks are bound by the host (each a launch): a list of tensors on one
# such device is always checked by one fused reduction ([Note: one fused reduction per list on a GPU]).
FUSED_DEVICE_TYPES = frozenset({"cuda"})


class Probe(NamedTuple):
    """One checked tensor (a named tuple: a step makes hundreds).

    Attributes:
        stage: One of :data:`semconv.ORIGIN_STAGES`; within ``weight``, :attr:`when` tells the
            weights before the update (``before``) from those after it (``after``).
        where: The module, parameter or group it belongs to (a fully qualified name).
        dtype: The checked tensor's dtype (``bfloat16``).
        when: ``before``/``after`` (weights, reduce), ``input``/``output`` (escalated module
            probes), else ``""``.
        microbatch: The backward pass of the iteration it came from (0 before the first one).
        group: For a parameter's check, the group it belongs to (named as group checks are).
    """

    stage: str
    where: str
    dtype: str
    when: str = ""
    microbatch: int = 0
    group: str = ""


@functools.cache
def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class PreparedChecks:
    """A list of tensors checked together at every step (each parameter's main weight, a group's
    main weights): the data it reads, how it is reduced (:class:`~.probe_plans.ReductionPlan`, one
    per dtype and device) and its probes made once, for as long as those tensors last.

    Args:
        stage: The probes' stage.
        items: ``(where, tensor, when, group)`` each; empty and non-floating tensors are left out.
        segments: Per item, where it is a flat buffer holding several parameters: each one's first
            element and name, in order. Such an item is reduced with the place of its least and
            greatest elements (``LOCATED``), and a non-finite one reads as the probe of the
            parameter holding it (named ``where`` when finite, or in no segment).
        pooled: How far a tensor's values may be pooled with others' (``CONCATENATED``, for a
            list of small tensors on a CPU): ``""`` not at all; ``POOL_WHERE``, with the tensors
            of the same ``where`` (exact per place: a unit's reduced grads, whose zeros are read
            unit by unit); ``POOL_LIST``, a finite tensor with the whole list (the main weights,
            read only as finite or not). A pool holding a NaN/Inf is read tensor by tensor.
    """

    def __init__(
        self,
        stage: str,
        items: Sequence[tuple[str, torch.Tensor, str, str]],
        segments: Sequence[Sequence[tuple[int, str]] | None] | None = None,
        pooled: str = "",
    ) -> None:
        self.stage = stage
        self.tensors: list[torch.Tensor] = []
        self._keys: list[tuple[str, str, str, str]] = []
        self._kept: list[int] = []  # the items checked, by index
        self._segments: list[Sequence[tuple[int, str]] | None] = []
        for item_index, (where, tensor, when, group) in enumerate(items):
            data = checkable(tensor)
            if data is not None:
                self.tensors.append(data)
                self._kept.append(item_index)
                self._keys.append((where, dtype_name(tensor.dtype), when, group))
                self._segments.append(segments[item_index] if segments is not None else None)
        # The tensors of each dtype, device and kind (and their places in :attr:`tensors`):
        # reduced together, their values joining the log's values of that dtype
        # ([Note: the values kept per dtype]).
        if pooled not in ("", POOL_WHERE, POOL_LIST):
            raise ValueError(f"pooled={pooled!r}: expected '', {POOL_WHERE!r} or {POOL_LIST!r}")
        parts: dict[tuple[torch.dtype, torch.device, bool, str], list[int]] = {}
        for index, data in enumerate(self.tensors):
            pool = self._keys[index][0] if pooled == POOL_WHERE else ""
            key = (data.dtype, data.device, self._segments[index] is not None, pool)
            parts.setdefault(key, []).append(index)
        self.part_indices = list(parts.values())
        # How :meth:`retarget` takes each part's tensors: a slice where the part is a run of
        # consecutive items (one list's, a unit's), else item by item.
        self._part_takes: list[slice | list[int]] = [
            slice(indices[0], indices[-1] + 1) if indices == list(range(indices[0], indices[-1] + 1)) else indices
            for indices in self.part_indices
        ]
        self._keeps_all = len(self._kept) == len(items)
        self.plans = [
            ReductionPlan([self.tensors[i] for i in indices], FUSED_DEVICE_TYPES, located, bool(pooled))
            for (_, _, located, _), indices in parts.items()
        ]
        # Per probe, in order: its part and its places in that part's first chunk.
        self.places: list[tuple[int, int, int, bool]] = [(0, 0, 0, False)] * len(self.tensors)
        # Per probe, its place among its part's tensors (a concatenated part told apart reads there).
        self.member: list[int] = [0] * len(self.tensors)
        for part, (indices, plan) in enumerate(zip(self.part_indices, self.plans, strict=True)):
            for member, (index, (low, high, peak)) in enumerate(zip(indices, plan.places, strict=True)):
                self.places[index] = (part, low, high, peak)
                self.member[index] = member
        self.grads_at_step = any(grads_at_step(stage, where) for where, _, _, _ in self._keys)
        self._probes: dict[int, list[Probe]] = {}

    def retarget(self, tensors: Sequence[torch.Tensor]) -> None:
        """Check ``tensors`` from now on: new tensors standing for the same items (the same
        places, dtypes and sizes: the caller knows), each a plain tensor as :attr:`tensors` holds."""
        self.tensors = list(tensors) if self._keeps_all else [tensors[i] for i in self._kept]
        for take, plan in zip(self._part_takes, self.plans, strict=True):
            plan.retarget(self.tensors[take] if isinstance(take, slice) else [self.tensors[i] for i in take])

    def let_go(self) -> None:
        """Hold no tensor until :meth:`retarget` gives new ones: a list checked once an
        iteration on new tensors (a held batch of activations, FSDP2's grads) keeps none of them
        alive after its check."""
        self.tensors = []
        for plan in self.plans:
            plan.tensors = []

    def probes(self, microbatch: int) -> list[Probe]:
        """The probes of a check made after ``microbatch`` backward passes."""
        probes = self._probes.get(microbatch)
        if probes is None:
            if len(self._probes) >= 8:  # a count of backward passes per step that keeps changing
                self._probes.clear()
            probes = [
                Probe(self.stage, where, dtype, when, microbatch, group) for where, dtype, when, group in self._keys
            ]
            self._probes[microbatch] = probes
        return probes

    def located(self, index: int, probe: Probe, at: int) -> Probe:
        """Probe ``index`` (a flat buffer found non-finite at its element ``at``) as the probe of
        the parameter holding that element."""
        segments = self._segments[index]
        if not segments or at < 0:
            return probe
        place = bisect.bisect_right([start for start, _ in segments], at) - 1
        return probe if place < 0 else probe._replace(where=segments[place][1])


def grads_at_step(stage: str, where: str) -> bool:
    """Whether a probe checks main grads at the step (a clip's total norm does not)."""
    return stage == semconv.ORIGIN_GRAD_WRITE and where != CLIP


def checkable(tensor: torch.Tensor) -> torch.Tensor | None:
    """The data a check reads (a DTensor's local shard, detached where it records autograd), or
    ``None`` for nothing to check."""
    if not tensor.is_floating_point():
        return None
    data: torch.Tensor = getattr(tensor, "_local_tensor", tensor)  # a DTensor: this rank's shard
    if data.numel() == 0:
        return None
    return data.detach() if data.requires_grad else data
