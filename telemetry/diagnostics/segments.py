"""What one diagnosed step's per-parameter passes run over: each parameter's segment of its
group's flat buffers (or FSDP2's local tensor), the rows being filled, and the probes read back.

:mod:`.param_stats` runs the passes; this module holds the data they share.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, overload

import torch

from . import kernels
from .groups import PrecisionSnapshot, weights_of
from .rows import ROW, ParamSlot, StateTensor


class Rows:
    """Rows being computed: host-known values, and device values added once at the end (counts
    and sums kept apart, so that counts stay exact integers until they become float64): 0-d
    values one row's slot each, 1-d ones a slot of several rows (a pack's, :mod:`.packed_stats`)."""

    def __init__(self, count: int, device: torch.device) -> None:
        self.device = device
        self.host = [[0.0] * ROW for _ in range(count)]
        self._count_index: list[int] = []
        self._counts: list[torch.Tensor] = []
        self._sum_index: list[int] = []
        self._sums: list[torch.Tensor] = []
        self._vector_index: list[int] = []
        self._vectors: list[torch.Tensor] = []

    def count(self, row: int, slot: int, value: torch.Tensor) -> None:
        self._count_index.append(row * ROW + slot)
        self._counts.append(value)

    def sum(self, row: int, slot: int, value: torch.Tensor) -> None:
        self._sum_index.append(row * ROW + slot)
        self._sums.append(value)

    def add_many(self, rows: Sequence[int], slot: int, values: torch.Tensor) -> None:
        """``values[k]`` (float64, exact for counts below 2**53) into slot ``slot`` of row ``rows[k]``."""
        self._vector_index.extend(row * ROW + slot for row in rows)
        self._vectors.append(values)

    @property
    def pending(self) -> bool:
        """Whether any device value was added (a row of host zeros otherwise)."""
        return bool(self._counts or self._sums or self._vectors)

    def matrix(self) -> torch.Tensor:
        rows = torch.tensor(self.host, dtype=torch.float64).to(self.device).view(-1)
        for index, values in ((self._count_index, self._counts), (self._sum_index, self._sums)):
            if values:
                stacked = torch.stack(values).to(torch.float64)
                rows.index_add_(0, torch.tensor(index, dtype=torch.long, device=self.device), stacked)
        if self._vectors:
            joined = torch.cat([v.to(torch.float64) for v in self._vectors])
            rows.index_add_(0, torch.tensor(self._vector_index, dtype=torch.long, device=self.device), joined)
        return rows.view(len(self.host), ROW)


@dataclass
class Segment:
    """One slot's tensors for this step."""

    slot: ParamSlot
    main: torch.Tensor
    before: torch.Tensor
    compute: torch.Tensor | None
    compute_before: torch.Tensor | None
    derived_dtype: torch.dtype | None
    grad: torch.Tensor | None
    states: Sequence[StateTensor] = field(default_factory=tuple)

    def chunks(self) -> range:
        return range(0, self.slot.length, kernels.CHUNK_ELEMENTS)


@overload
def narrow(t: torch.Tensor, start: int, length: int) -> torch.Tensor: ...
@overload
def narrow(t: None, start: int, length: int) -> None: ...
def narrow(t: torch.Tensor | None, start: int, length: int) -> torch.Tensor | None:
    """Elements ``start:start + length`` of a flat tensor (a view, or the tensor itself when that is
    all of it: most parameters are one chunk); ``None`` (no such tensor) passes through."""
    if t is None or (start == 0 and length == t.numel()):
        return t
    return t.narrow(0, start, length)


def segments(
    snapshot: PrecisionSnapshot,
    groups: Sequence[Any],
    table: Sequence[ParamSlot],
    states: Sequence[Sequence[StateTensor]] | None,
) -> list[Segment]:
    if len(groups) != len(snapshot.main_weights):
        raise ValueError(f"snapshot holds {len(snapshot.main_weights)} groups, got {len(groups)}")
    weights = [weights_of(g, snapshot.default_compute_dtype) for g in groups]
    for w, before in zip(weights, snapshot.main_weights, strict=True):
        if len(w.mains) != len(before) or any(a.numel() != b.numel() for a, b in zip(w.mains, before, strict=True)):
            raise ValueError("precision diagnostics need equal numel: the snapshot does not match the weights")
    if states is not None and len(states) != len(table):
        raise ValueError(f"optimizer state given for {len(states)} parameters, the table has {len(table)}")
    out = []
    for index, slot in enumerate(table):
        w = weights[slot.group]
        start, length = slot.start, slot.length
        computes_before = snapshot.compute_weights[slot.group]
        if w.computes is not None and computes_before is None:
            raise ValueError("a materialized compute weight needs its copy from before the step: none was given")
        out.append(
            Segment(
                slot,
                narrow(w.mains[slot.tensor], start, length),
                narrow(snapshot.main_weights[slot.group][slot.tensor], start, length),
                None if w.computes is None else narrow(w.computes[slot.tensor], start, length),
                None if computes_before is None else narrow(computes_before[slot.tensor], start, length),
                w.compute_dtype,
                narrow(w.grads[slot.tensor], start, length),
                () if states is None else states[index],
            )
        )
    return out


def compute_pair(m: torch.Tensor, mb: torch.Tensor, s: Segment, start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A chunk's compute weight after and before the step: the materialized copy, or the main
    weight cast to the compute dtype as each all-gather casts it."""
    if s.compute is not None:
        assert s.compute_before is not None  # segments refuses a materialized copy without it
        return narrow(s.compute, start, m.numel()), narrow(s.compute_before, start, m.numel())
    assert s.derived_dtype is not None
    n = m.numel()
    c = kernels.scratch.get("compute", m, s.derived_dtype, n).copy_(m)
    cb = kernels.scratch.get("compute_before", m, s.derived_dtype, n).copy_(mb)
    return c, cb


class Probes:
    """Device values read back with round 1's rows: each probe's values, by a key."""

    def __init__(self) -> None:
        self._keys: list[tuple[Any, ...]] = []
        self._widths: list[int] = []
        self._values: list[torch.Tensor] = []  # 0-d, not yet joined into a chunk
        self._chunks: list[torch.Tensor] = []  # 1-d, in order

    def add(self, key: tuple[Any, ...], *values: torch.Tensor) -> None:
        self._keys.append(key)
        self._widths.append(len(values))
        self._values.extend(values)

    def add_many(self, keys: Sequence[tuple[Any, ...]], values: Sequence[torch.Tensor]) -> None:
        for key, value in zip(keys, values, strict=True):
            self.add(key, value)

    def add_pairs(self, keys: Sequence[tuple[Any, ...]], lows: torch.Tensor, highs: torch.Tensor) -> None:
        """Probe ``keys[k]``'s values ``(lows[k], highs[k])``, for 1-d ``lows`` and ``highs``."""
        self._join()
        self._keys.extend(keys)
        self._widths.extend([2] * len(keys))
        self._chunks.append(torch.stack([lows.to(torch.float64), highs.to(torch.float64)], dim=1).view(-1))

    def _join(self) -> None:
        if self._values:
            self._chunks.append(torch.stack(self._values).to(torch.float64))
            self._values = []

    def __bool__(self) -> bool:
        return bool(self._values or self._chunks)

    def stacked(self, like: torch.Tensor) -> torch.Tensor:
        """Every probe's values in order, as one float64 vector on ``like``'s device."""
        self._join()
        if not self._chunks:
            return torch.zeros(0, dtype=torch.float64, device=like.device)
        return self._chunks[0] if len(self._chunks) == 1 else torch.cat(self._chunks)

    def split(
        self, rows: list[list[float]], values: list[float]
    ) -> tuple[list[list[float]], dict[tuple[Any, ...], list[float]]]:
        """``rows`` and each probe's values by its key, from :meth:`stacked` read on the host."""
        found: dict[tuple[Any, ...], list[float]] = {}
        cursor = 0
        for key, n in zip(self._keys, self._widths, strict=True):
            found[key] = values[cursor : cursor + n]
            cursor += n
        return rows, found
