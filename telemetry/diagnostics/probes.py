"""The checks of an iteration: one reduction per checked tensor, kept on the device, read once.

A :class:`ProbeLog` takes the checks of one iteration in the order they run: each tensor's least
and greatest element (``torch.aminmax``: NaN propagates through it, an Inf is its min or max), or,
for a list of tensors, what its :class:`~.probe_plans.ReductionPlan` makes of them in a few calls
(one reduction per flat buffer, or one fused reduction per list). Nothing is read on the host
until the iteration's log is stacked and read after the optimizer step, as :class:`Checked`
values, one per :class:`Probe` (what was checked: its stage, where, dtype and microbatch).
:class:`PreparedChecks` plans a list checked at every step, and makes its probes, once.

What the checks mean (where a NaN/Inf began) is :mod:`.origin`'s. No OpenTelemetry here.
"""

from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Container, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from .. import semconv
from .probe_plans import CONCATENATED, LOCATED, ReductionPlan

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


@dataclass(frozen=True)
class Checked:
    """A probe and what its tensor held: its least and greatest element (NaN if any was NaN)."""

    probe: Probe
    low: float
    high: float

    @property
    def finite(self) -> bool:
        return math.isfinite(self.low) and math.isfinite(self.high)

    @property
    def nan(self) -> bool:
        return math.isnan(self.low) or math.isnan(self.high)

    @property
    def magnitude(self) -> float:
        """The largest absolute value (meaningful when :attr:`finite`)."""
        return max(abs(self.low), abs(self.high))


@functools.cache
def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def floating_tensors(value: Any, limit: int = 64) -> Iterator[torch.Tensor]:
    """The floating-point tensors in a module's output (tensors, tuples, lists, dicts, dataclasses
    such as Hugging Face's ``ModelOutput``), depth first, at most ``limit``."""
    if isinstance(value, torch.Tensor):  # most modules return one tensor
        if value.is_floating_point() and value.numel() > 0:
            yield value
        return
    stack = [value]
    seen = 0
    while stack and seen < limit:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            if item.is_floating_point() and item.numel() > 0:
                seen += 1
                yield item
        elif isinstance(item, dict):
            stack.extend(reversed(list(item.values())))
        elif isinstance(item, list | tuple):
            stack.extend(reversed(item))
        elif hasattr(item, "__dataclass_fields__"):
            stack.extend(reversed([getattr(item, name, None) for name in item.__dataclass_fields__]))


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
            data = _checkable(tensor)
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
        self.grads_at_step = any(_grads_at_step(stage, where) for where, _, _, _ in self._keys)
        self._probes: dict[int, list[Probe]] = {}

    @property
    def parts(self) -> list[list[torch.Tensor]]:
        """The tensors of each dtype and device."""
        return [plan.tensors for plan in self.plans]

    def retarget(self, tensors: Sequence[torch.Tensor]) -> None:
        """Check ``tensors`` from now on: new tensors standing for the same items (the same
        places, dtypes and sizes: the caller knows), each a plain tensor as :attr:`tensors` holds."""
        self.tensors = [tensors[i] for i in self._kept]
        for indices, plan in zip(self.part_indices, self.plans, strict=True):
            plan.retarget([self.tensors[i] for i in indices])

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


class _Values:
    """The values of one dtype and device in an iteration's log: single checks' 0-d results
    (stacked at the end) and lists' 1-d chunks, after them."""

    __slots__ = ("scalars", "chunks", "chunk_width")

    def __init__(self) -> None:
        self.scalars: list[torch.Tensor] = []
        self.chunks: list[torch.Tensor] = []
        self.chunk_width = 0

    def joined(self) -> torch.Tensor:
        parts = [torch.stack(self.scalars)] if self.scalars else []
        parts.extend(self.chunks)
        return parts[0] if len(parts) == 1 else torch.cat(parts)


class _Block:
    """A prepared list's checks in a log: its probes, and where each part's chunks begin."""

    __slots__ = ("prepared", "probes", "starts")

    def __init__(self, prepared: PreparedChecks, probes: list[Probe], starts: list[list[tuple[int, int]]]) -> None:
        self.prepared = prepared
        self.probes = probes
        # Per part, per chunk: (values index, place of the chunk among that index's chunks).
        self.starts = starts


class ProbeLog:
    """The probes of one iteration, in the order they ran; their values stay on the device until read.

    Each :meth:`check` launches one reduction (``torch.aminmax``) and keeps its two 0-d results;
    :meth:`check_all` and :meth:`check_prepared` check a list of tensors (a model's parameters,
    their grads) at once, as its :class:`~.probe_plans.ReductionPlan` says, with no Python per
    tensor where the plan is fused or per flat buffer; :meth:`stacked` joins every value in a few
    calls and :meth:`read` gives them back as :class:`Checked`, once on the host.

    [Note: the values kept per dtype]
    Stacking 0-d tensors of one dtype is one copy; of several dtypes (a bf16 model's outputs
    beside its fp32 main weights) it converts input by input, on a GPU a launch each. So the
    values are kept per dtype and device, each joined on its own and widened to float64, and each
    probe knows its values and place.
    """

    def __init__(self) -> None:
        # In the order checked: a single check's (probe, values index, place among the scalars),
        # or a prepared list's block.
        self._entries: list[tuple[Probe, int, int] | _Block] = []
        self._count = 0
        self._values: list[_Values] = []  # one per (dtype, device)
        self._values_of: dict[tuple[torch.dtype, torch.device], int] = {}
        self.microbatch = 0
        # Whether main grads were checked at the step (what :func:`zeroed_groups` reads).
        self.grads_at_step = False

    def __len__(self) -> int:
        return self._count

    def _values_for(self, data: torch.Tensor) -> tuple[int, _Values]:
        key = (data.dtype, data.device)
        index = self._values_of.get(key)
        if index is None:
            index = self._values_of[key] = len(self._values)
            self._values.append(_Values())
        return index, self._values[index]

    def check(self, stage: str, where: str, tensor: torch.Tensor, when: str = "", group: str = "") -> None:
        """Add ``tensor``'s check; tensors that are empty or not floating point are skipped."""
        data = _checkable(tensor)
        if data is None:
            return
        index, values = self._values_for(data)
        scalars = values.scalars
        self._entries.append(
            (Probe(stage, where, dtype_name(tensor.dtype), when, self.microbatch, group), index, len(scalars))
        )
        scalars.extend(torch.aminmax(data))
        self._count += 1
        if stage == semconv.ORIGIN_GRAD_WRITE:
            self.grads_at_step = self.grads_at_step or _grads_at_step(stage, where)

    def check_all(self, stage: str, items: Sequence[tuple[str, torch.Tensor, str, str]]) -> None:
        """Add the checks of ``(where, tensor, when, group)`` each, in order, as :meth:`check`
        would; reduced as :meth:`check_prepared` reduces a list."""
        self.check_prepared(PreparedChecks(stage, items))

    def check_prepared(self, prepared: PreparedChecks) -> None:
        """Add the checks of ``prepared``'s tensors as they are now (see :meth:`check_all`)."""
        if not prepared.tensors:
            return
        starts: list[list[tuple[int, int]]] = []
        for plan in prepared.plans:
            part: list[tuple[int, int]] = []
            for chunk, width in zip(plan.reduce(), plan.widths, strict=True):
                index, values = self._values_for(chunk)
                part.append((index, values.chunk_width))
                values.chunks.append(chunk)
                values.chunk_width += width
            starts.append(part)
        self._entries.append(_Block(prepared, prepared.probes(self.microbatch), starts))
        self._count += len(prepared.tensors)
        self.grads_at_step = self.grads_at_step or prepared.grads_at_step

    def stacked(self) -> torch.Tensor | None:
        """Every check's values as one 1-d float64 tensor on the first check's device (``None``
        when nothing was checked): joined per dtype ([Note: the values kept per dtype]); copies
        nothing to the host unless checks ran on several devices."""
        if not self._values:
            return None
        parts = [values.joined() for values in self._values]
        device = parts[0].device
        if len(parts) == 1:
            return parts[0].to(dtype=torch.float64)
        return torch.cat([part.to(device=device, dtype=torch.float64) for part in parts])

    def read(
        self, stacked: torch.Tensor | Sequence[float] | None, stages: Container[str] | None = None
    ) -> list[Checked]:
        """Every probe (of ``stages``, where given) with its values from :meth:`stacked` (on the
        host by now, or as a list), in order."""
        if stacked is None:
            return []
        host = stacked.tolist() if isinstance(stacked, torch.Tensor) else stacked
        # Where each dtype's scalars and chunks begin in the joined values.
        scalars_at: list[int] = []
        chunks_at: list[int] = []
        offset = 0
        for values in self._values:
            scalars_at.append(offset)
            chunks_at.append(offset + len(values.scalars))
            offset += len(values.scalars) + values.chunk_width
        checked: list[Checked] = []
        for entry in self._entries:
            if isinstance(entry, _Block):
                if stages is not None and entry.prepared.stage not in stages:
                    continue
                checked.extend(_read_block(entry, host, chunks_at))
                continue
            probe, index, place = entry
            if stages is not None and probe.stage not in stages:
                continue
            at = scalars_at[index] + place
            checked.append(Checked(probe, host[at], host[at + 1]))
        return checked


def _read_block(block: _Block, host: Sequence[float], chunks_at: list[int]) -> list[Checked]:
    """A prepared list's checks, probe by probe (see :class:`~.probe_plans.ReductionPlan`'s kinds)."""
    prepared = block.prepared
    bases = [[chunks_at[index] + start for index, start in part] for part in block.starts]
    # A concatenated part that held a NaN/Inf is read tensor by tensor from its staging buffer.
    each: dict[int, list[tuple[float, float, int]]] = {}
    for part, plan in enumerate(prepared.plans):
        if plan.kind == CONCATENATED:
            low, high = host[bases[part][0]], host[bases[part][0] + 1]
            if not (math.isfinite(low) and math.isfinite(high)):
                each[part] = plan.each_value()
    checked: list[Checked] = []
    for index, (probe, (part, low_place, high_place, peak)) in enumerate(
        zip(block.probes, prepared.places, strict=True)
    ):
        base = bases[part][0]
        at = -1
        if part in each:
            low, high, at = each[part][prepared.member[index]]
        elif peak:
            low, high = -host[base + low_place], host[base + high_place]
        else:
            low, high = host[base + low_place], host[base + high_place]
        if prepared.plans[part].kind == LOCATED and not (math.isfinite(low) and math.isfinite(high)):
            # A NaN's place (both reductions give one), else the Inf's.
            indices = bases[part][1]
            nan_or_low = math.isnan(low) or (not math.isnan(high) and math.isinf(low))
            at = int(host[indices + (low_place if nan_or_low else high_place)])
        checked.append(Checked(prepared.located(index, probe, at) if at >= 0 else probe, low, high))
    return checked


def _grads_at_step(stage: str, where: str) -> bool:
    """Whether a probe checks main grads at the step (a clip's total norm does not)."""
    return stage == semconv.ORIGIN_GRAD_WRITE and where != CLIP


def _checkable(tensor: torch.Tensor) -> torch.Tensor | None:
    """The data a check reads (a DTensor's local shard, detached where it records autograd), or
    ``None`` for nothing to check."""
    if not tensor.is_floating_point():
        return None
    data: torch.Tensor = getattr(tensor, "_local_tensor", tensor)  # a DTensor: this rank's shard
    if data.numel() == 0:
        return None
    return data.detach() if data.requires_grad else data
