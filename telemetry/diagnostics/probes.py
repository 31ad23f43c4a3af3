"""The checks of an iteration: one reduction per checked tensor, kept on the device, read once.

A :class:`ProbeLog` takes the checks of one iteration in the order they run: each tensor's least
and greatest element (``torch.aminmax``: NaN propagates through it, an Inf is its min or max), or,
for a list of tensors on a GPU, each one's largest magnitude in one fused reduction. Nothing is read
on the host until the iteration's log is stacked and read after the optimizer step, as
:class:`Checked` values, one per :class:`Probe` (what was checked: its stage, where, dtype and
microbatch). :class:`PreparedChecks` makes the probes of a list checked at every step once.

What the checks mean (where a NaN/Inf began) is :mod:`.origin`'s. No OpenTelemetry here.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Container, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from .. import semconv

# Which side of a step or a reduce a check was made on (Probe.when), and the model's own input.
BEFORE = "before"
AFTER = "after"
INPUT = "input"
CLIP = semconv.ORIGIN_WHERE_CLIP


# The device types whose checks are bound by the host (each a launch): a list of tensors on one
# such device is checked by one fused reduction ([Note: one fused reduction per list on a GPU]).
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
    main weights): the data it reads and its probes made once, for as long as those tensors last.

    Args:
        stage: The probes' stage.
        items: ``(where, tensor, when, group)`` each; empty and non-floating tensors are left out.
    """

    def __init__(self, stage: str, items: Sequence[tuple[str, torch.Tensor, str, str]]) -> None:
        self.stage = stage
        self.tensors: list[torch.Tensor] = []
        self._keys: list[tuple[str, str, str, str]] = []
        self._kept: list[int] = []  # the items checked, by index
        for item_index, (where, tensor, when, group) in enumerate(items):
            data = _checkable(tensor)
            if data is not None:
                self.tensors.append(data)
                self._kept.append(item_index)
                self._keys.append((where, dtype_name(tensor.dtype), when, group))
        # The tensors of each dtype and device (and their places in :attr:`tensors`): one fused
        # reduction each, whose values join the log's list of that dtype ([Note: the values kept per dtype]).
        parts: dict[tuple[torch.dtype, torch.device], list[int]] = {}
        for index, data in enumerate(self.tensors):
            parts.setdefault((data.dtype, data.device), []).append(index)
        self.parts = [[self.tensors[i] for i in indices] for indices in parts.values()]
        self.part_indices = list(parts.values())
        self.grads_at_step = any(_grads_at_step(stage, where) for where, _, _, _ in self._keys)
        self._probes: dict[int, list[Probe]] = {}

    def retarget(self, tensors: Sequence[torch.Tensor]) -> None:
        """Check ``tensors`` from now on: new tensors standing for the same items (the same
        places, dtypes and sizes: the caller knows), each a plain tensor as :attr:`tensors` holds."""
        self.tensors = [tensors[i] for i in self._kept]
        self.parts = [[self.tensors[i] for i in indices] for indices in self.part_indices]

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


class ProbeLog:
    """The probes of one iteration, in the order they ran; their values stay on the device until read.

    Each :meth:`check` launches one reduction (``torch.aminmax``) and keeps its two 0-d results;
    :meth:`check_all` and :meth:`check_prepared` check a list of tensors (a model's parameters,
    their grads) at once, on a GPU in one fused reduction; :meth:`stacked` joins every value in
    a few calls and :meth:`read` gives them back as :class:`Checked`, once on the host.

    [Note: one fused reduction per list on a GPU]
    On a GPU a step's checks cost host time, not device time: each ``aminmax`` is a launch and
    the Python around it (tens of microseconds), against a pass over memory that takes
    microseconds. A list of tensors on one CUDA device is therefore checked by one
    ``torch._foreach_norm(tensors, inf)``, each tensor's largest magnitude (NaN when it holds a
    NaN, Inf when an Inf), read back as the pair ``(-peak, peak)``: finite, NaN, magnitude and
    all-zero read the same as from ``aminmax``. On a CPU that call is 13x slower than one
    ``aminmax`` per tensor, which stays.

    [Note: the values kept per dtype]
    Stacking 0-d tensors of one dtype is one copy; of several dtypes (a bf16 model's outputs
    beside its fp32 main weights) it converts input by input, on a GPU a launch each. So the
    values are kept in one list per dtype and device, each stacked on its own and widened to
    float64, and each probe knows its list and place.
    """

    def __init__(self) -> None:
        self._probes: list[Probe] = []
        # Per probe: its values' list, the place of its first value there, and whether it holds one
        # peak magnitude (a fused list's) rather than a least and a greatest element.
        self._places: list[tuple[int, int, bool]] = []
        self._lists: list[list[torch.Tensor]] = []  # 0-d values, one list per (dtype, device)
        self._list_of: dict[tuple[torch.dtype, torch.device], int] = {}
        self.microbatch = 0
        # Whether main grads were checked at the step (what :func:`zeroed_groups` reads).
        self.grads_at_step = False

    def __len__(self) -> int:
        return len(self._probes)

    def _list(self, data: torch.Tensor) -> tuple[int, list[torch.Tensor]]:
        key = (data.dtype, data.device)
        index = self._list_of.get(key)
        if index is None:
            index = self._list_of[key] = len(self._lists)
            self._lists.append([])
        return index, self._lists[index]

    def check(self, stage: str, where: str, tensor: torch.Tensor, when: str = "", group: str = "") -> None:
        """Add ``tensor``'s check; tensors that are empty or not floating point are skipped."""
        data = _checkable(tensor)
        if data is None:
            return
        index, values = self._list(data)
        self._places.append((index, len(values), False))
        values.extend(torch.aminmax(data))
        self._probes.append(Probe(stage, where, dtype_name(tensor.dtype), when, self.microbatch, group))
        self.grads_at_step = self.grads_at_step or _grads_at_step(stage, where)

    def check_all(self, stage: str, items: Sequence[tuple[str, torch.Tensor, str, str]]) -> None:
        """Add the checks of ``(where, tensor, when, group)`` each, in order, as :meth:`check`
        would; fused on a GPU ([Note: one fused reduction per list on a GPU])."""
        self.check_prepared(PreparedChecks(stage, items))

    def check_prepared(self, prepared: PreparedChecks) -> None:
        """Add the checks of ``prepared``'s tensors as they are now (see :meth:`check_all`)."""
        tensors = prepared.tensors
        if not tensors:
            return
        probes = prepared.probes(self.microbatch)
        self._probes.extend(probes)
        self.grads_at_step = self.grads_at_step or prepared.grads_at_step
        places: list[tuple[int, int, bool]] = [(0, 0, False)] * len(tensors)
        for part, indices in zip(prepared.parts, prepared.part_indices, strict=True):
            index, values = self._list(part[0])
            if part[0].device.type in FUSED_DEVICE_TYPES:
                for place, probe_index in enumerate(indices, start=len(values)):
                    places[probe_index] = (index, place, True)
                values.extend(torch._foreach_norm(part, math.inf))
                continue
            for data, probe_index in zip(part, indices, strict=True):
                places[probe_index] = (index, len(values), False)
                values.extend(torch.aminmax(data))
        self._places.extend(places)

    def stacked(self) -> torch.Tensor | None:
        """Every check's values (an aminmax probe's min and max, a fused probe's peak) as one 1-d
        float64 tensor on the first check's device (``None`` when nothing was checked): one stack
        per dtype ([Note: the values kept per dtype]); copies nothing to the host unless checks
        ran on several devices."""
        if not self._lists:
            return None
        device = self._lists[0][0].device
        parts = [torch.stack(values).to(device=device, dtype=torch.float64) for values in self._lists]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def read(
        self, stacked: torch.Tensor | Sequence[float] | None, stages: Container[str] | None = None
    ) -> list[Checked]:
        """Every probe (of ``stages``, where given) with its values from :meth:`stacked` (on the
        host by now, or as a list), in order."""
        if stacked is None:
            return []
        host = stacked.tolist() if isinstance(stacked, torch.Tensor) else stacked
        offsets = [0]
        for values in self._lists:
            offsets.append(offsets[-1] + len(values))
        checked = []
        for probe, (index, place, peak) in zip(self._probes, self._places, strict=True):
            if stages is not None and probe.stage not in stages:
                continue
            at = offsets[index] + place
            checked.append(Checked(probe, -host[at], host[at]) if peak else Checked(probe, host[at], host[at + 1]))
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
