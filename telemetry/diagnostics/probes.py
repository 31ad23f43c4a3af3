"""The checks of an iteration: one reduction per checked tensor, kept on the device, read once.

A :class:`ProbeLog` takes the checks of one iteration in the order they run: each tensor's least
and greatest element (``torch.aminmax``: NaN propagates through it, an Inf is its min or max), or,
for a list of tensors, what its :class:`~.probe_plans.ReductionPlan` makes of them in a few calls
(one reduction per flat buffer, or one fused reduction per list). Nothing is read on the host
until the iteration's log is stacked and read after the optimizer step, as :class:`Checked`
values, one per :class:`Probe` (what was checked: its stage, where, dtype and microbatch).
:class:`~.prepared_checks.PreparedChecks` plans a list checked at every step, and makes its probes,
once; :meth:`ProbeLog.hold` keeps a check for a batch made later (:mod:`.held_checks`).

What the checks mean (where a NaN/Inf began) is :mod:`.origin`'s. No OpenTelemetry here.
"""

from __future__ import annotations

import math
from collections.abc import Container, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .. import semconv
from .held_checks import HeldBlock, HeldPlans
from .prepared_checks import (  # noqa: F401 - the names a log's callers make their checks with
    AFTER,
    BEFORE,
    CLIP,
    INPUT,
    POOL_LIST,
    POOL_WHERE,
    PreparedChecks,
    Probe,
    checkable,
    dtype_name,
    grads_at_step,
)
from .probe_plans import CONCATENATED, LOCATED


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

    __slots__ = ("prepared", "probes", "starts", "stagings")

    def __init__(
        self,
        prepared: PreparedChecks,
        probes: list[Probe],
        starts: list[list[tuple[int, int]]],
        stagings: list[torch.Tensor | None],
    ) -> None:
        self.prepared = prepared
        self.probes = probes
        # Per part, per chunk: (values index, place of the chunk among that index's chunks).
        self.starts = starts
        # Per part, a concatenated part's staging buffer of this check (what it is told apart from).
        self.stagings = stagings


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

    def __init__(self, held_plans: HeldPlans | None = None) -> None:
        # In the order checked: a single check's (probe, values index, place among the scalars),
        # a prepared list's block, or a block of held checks (a prepared list's once flushed).
        self._entries: list[tuple[Probe, int, int] | _Block | HeldBlock] = []
        self._held: HeldBlock | None = None  # the block a hold joins (closed by any other check)
        self._unflushed: list[int] = []  # the entries that are held blocks
        # Kept by the owner across its iterations' logs: a repeated forward plans its batch once.
        self.held_plans = held_plans if held_plans is not None else HeldPlans(_prepared_as_held)
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

    def hold(self, stage: str, where: str, tensor: torch.Tensor, when: str = "") -> None:
        """Add ``tensor``'s check, made later with the others held by :meth:`flush`, in this
        place among the checks (:mod:`.held_checks`); skipped as :meth:`check` skips."""
        data = checkable(tensor)
        if data is None:
            return
        block = self._held
        if block is None or block.stage != stage or block.microbatch != self.microbatch:
            block = self._held = HeldBlock(stage, self.microbatch)
            self._unflushed.append(len(self._entries))
            self._entries.append(block)
        block.hold(where, data, when)

    def flush(self) -> list[str]:
        """Check every held tensor now, in one reduction per batch; returns the places of those
        written in place since they were held, which are not checked (see :mod:`.held_checks`)."""
        written: list[str] = []
        self._held = None
        for at in self._unflushed:
            block = self._entries[at]
            assert isinstance(block, HeldBlock)
            items, moved = block.current()
            written += moved
            if items:  # else the empty block stays, read as nothing
                prepared = self.held_plans.prepared(block.stage, items)
                self._entries[at] = self._reduced(prepared, block.microbatch)
                self._count += len(prepared.tensors)
                prepared.let_go()
        self._unflushed = []
        return written

    def check(self, stage: str, where: str, tensor: torch.Tensor, when: str = "", group: str = "") -> None:
        """Add ``tensor``'s check; tensors that are empty or not floating point are skipped."""
        data = checkable(tensor)
        if data is None:
            return
        self._held = None
        index, values = self._values_for(data)
        scalars = values.scalars
        self._entries.append(
            (Probe(stage, where, dtype_name(tensor.dtype), when, self.microbatch, group), index, len(scalars))
        )
        scalars.extend(torch.aminmax(data))
        self._count += 1
        if stage == semconv.ORIGIN_GRAD_WRITE:
            self.grads_at_step = self.grads_at_step or grads_at_step(stage, where)

    def check_all(self, stage: str, items: Sequence[tuple[str, torch.Tensor, str, str]]) -> None:
        """Add the checks of ``(where, tensor, when, group)`` each, in order, as :meth:`check`
        would; reduced as :meth:`check_prepared` reduces a list."""
        prepared = PreparedChecks(stage, items)
        self.check_prepared(prepared)
        prepared.let_go()  # the log keeps its values, not the tensors (grads a zero_grad frees)

    def check_prepared(self, prepared: PreparedChecks) -> None:
        """Add the checks of ``prepared``'s tensors as they are now (see :meth:`check_all`)."""
        if not prepared.tensors:
            return
        self._held = None
        self._entries.append(self._reduced(prepared, self.microbatch))
        self._count += len(prepared.tensors)
        self.grads_at_step = self.grads_at_step or prepared.grads_at_step

    def _reduced(self, prepared: PreparedChecks, microbatch: int) -> _Block:
        """``prepared``'s tensors reduced now, their values joining the log's."""
        starts: list[list[tuple[int, int]]] = []
        stagings: list[torch.Tensor | None] = []
        for plan in prepared.plans:
            part: list[tuple[int, int]] = []
            for chunk, width in zip(plan.reduce(), plan.widths, strict=True):
                index, values = self._values_for(chunk)
                part.append((index, values.chunk_width))
                values.chunks.append(chunk)
                values.chunk_width += width
            starts.append(part)
            stagings.append(plan.staged if plan.kind == CONCATENATED else None)
        return _Block(prepared, prepared.probes(microbatch), starts, stagings)

    def stacked(self) -> torch.Tensor | None:
        """Every check's values as one 1-d float64 tensor on the first check's device (``None``
        when nothing was checked): joined per dtype ([Note: the values kept per dtype]); copies
        nothing to the host unless checks ran on several devices. Held checks are flushed first."""
        if self._unflushed:
            self.flush()
        if not self._values:
            return None
        parts = [values.joined() for values in self._values]
        device = parts[0].device
        if len(parts) == 1:
            return parts[0].to(dtype=torch.float64)
        return torch.cat([part.to(device=device, dtype=torch.float64) for part in parts])

    def release(self) -> None:
        """This log was read and found finite: nothing will tell its lists apart, so their staging
        buffers go back to their plans ([Note: a staging buffer per reduce])."""
        for entry in self._entries:
            if isinstance(entry, _Block):
                for plan, staging in zip(entry.prepared.plans, entry.stagings, strict=True):
                    if staging is not None:
                        plan.give_back(staging)
                entry.stagings = [None] * len(entry.stagings)

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
            if isinstance(entry, HeldBlock):
                continue  # all its tensors written in place since held: nothing checked
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
            staging = block.stagings[part]
            if not (math.isfinite(low) and math.isfinite(high)) and staging is not None:
                each[part] = plan.each_value(staging)
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


def _prepared_as_held(stage: str, items: list[tuple[str, torch.Tensor, str, str]]) -> PreparedChecks:
    """A batch of held checks as a prepared list: each tensor read as its own (not pooled)."""
    return PreparedChecks(stage, items)
