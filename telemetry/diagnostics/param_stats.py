"""Per-parameter precision rows of one diagnosed step, computed from the flat buffers by segment.

No OpenTelemetry here: :func:`local_rows` turns one diagnosed step into this rank's rows
(:mod:`~fsdp_patch.telemetry.diagnostics.rows` holds their layout, and how ranks combine them).

Where a parameter is: a ``fully_shard`` group's flat buffers hold each parameter's local shard at
the offset its layout gives (``ParamLayout.offset``, ``local_numel`` elements; the padding after
it is zero in every buffer and contributes nothing); a torch FSDP2 group holds one local tensor
per parameter. Each parameter is one segment of one main tensor, and every pass runs over whole
segments, in chunks of at most ``kernels.CHUNK_ELEMENTS`` elements: a Python loop over parameters
and chunks, never over elements.

Two rounds, with one device-to-host copy between them:

1. **What every step needs**, chunk by chunk, each chunk's passes one after another while it is
   in cache: the changed and lost counts, the underflow count, the squared norms of the main
   weight, of the refresh difference and of the update; the min/max of each grad and of each
   ``exp_avg_sq``, and one fused L2 norm of the other state tensors. These are written as if no
   element were NaN or Inf (no finite masks): a NaN or an Inf anywhere in a segment makes one of
   its sums or probes NaN or Inf, so the copy to the host tells which segments hold one.
2. **Only what the first round flagged**: for those segments, the NaN/Inf counts, the overflow
   count and the squared norms over the elements finite in both weights (replacing round 1's);
   the NaN/Inf counts of flagged grads and state tensors; the flushed-to-zero count where an
   ``exp_avg_sq`` holds a zero. A healthy step runs nothing here but those flushed counts.

Alternatives considered:
    - A first round of probes alone (norms, min/max), then each segment's passes knowing whether
      it is healthy: reads every main weight from memory twice, once for the probe and once for
      the passes, where the sums of round 1 are the probe.
    - Segmented reductions over a whole chunk of the flat buffer (``segment_reduce``, prefix sums
      of the masks) instead of a loop over parameters: ``segment_reduce`` runs at about 3.6 ns
      per element on a CPU, ten times a pass, and prefix sums of masks at about a pass of 4 bytes
      per element; the loop costs a few microseconds per parameter.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, overload

import torch

from . import kernels
from .groups import PrecisionSnapshot, weights_of
from .rows import (
    CHANGED,
    COMPUTE_INF,
    COMPUTE_NAN,
    DIFF_SQ,
    GRAD_AMAX,
    GRAD_AMAX_NONFINITE,
    GRAD_INF,
    GRAD_NAN,
    GRAD_TINY,
    GRAD_ZERO,
    LOST,
    MAIN_INF,
    MAIN_NAN,
    MAIN_SQ,
    NUMEL,
    OVERFLOW,
    ROW,
    SECOND_MOMENT_KEY,
    STATE_FLUSHED,
    STATE_INF,
    STATE_NAN,
    UNDERFLOW,
    UPDATE_SQ,
    ParamSlot,
    StateTensor,
)

_SUMS = (DIFF_SQ, MAIN_SQ, UPDATE_SQ)
"""The slots round 1 sums without finite masks, which round 2 replaces where a segment is flagged."""


class _Rows:
    """Rows being computed: host-known values, and device scalars added once at the end (counts
    and sums kept apart, so that counts stay exact integers until they become float64)."""

    def __init__(self, count: int, device: torch.device) -> None:
        self.device = device
        self.host = [[0.0] * ROW for _ in range(count)]
        self._count_index: list[int] = []
        self._counts: list[torch.Tensor] = []
        self._sum_index: list[int] = []
        self._sums: list[torch.Tensor] = []

    def count(self, row: int, slot: int, value: torch.Tensor) -> None:
        self._count_index.append(row * ROW + slot)
        self._counts.append(value)

    def sum(self, row: int, slot: int, value: torch.Tensor) -> None:
        self._sum_index.append(row * ROW + slot)
        self._sums.append(value)

    def matrix(self) -> torch.Tensor:
        rows = torch.tensor(self.host, dtype=torch.float64).to(self.device).view(-1)
        for index, values in ((self._count_index, self._counts), (self._sum_index, self._sums)):
            if values:
                stacked = torch.stack(values).to(torch.float64)
                rows.index_add_(0, torch.tensor(index, dtype=torch.long, device=self.device), stacked)
        return rows.view(len(self.host), ROW)


@dataclass
class _Segment:
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
def _narrow(t: torch.Tensor, start: int, length: int) -> torch.Tensor: ...
@overload
def _narrow(t: None, start: int, length: int) -> None: ...
def _narrow(t: torch.Tensor | None, start: int, length: int) -> torch.Tensor | None:
    """Elements ``start:start + length`` of a flat tensor (a view, or the tensor itself when that is
    all of it: most parameters are one chunk); ``None`` (no such tensor) passes through."""
    if t is None or (start == 0 and length == t.numel()):
        return t
    return t.narrow(0, start, length)


def _segments(
    snapshot: PrecisionSnapshot,
    groups: Sequence[Any],
    table: Sequence[ParamSlot],
    states: Sequence[Sequence[StateTensor]] | None,
) -> list[_Segment]:
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
            _Segment(
                slot,
                _narrow(w.mains[slot.tensor], start, length),
                _narrow(snapshot.main_weights[slot.group][slot.tensor], start, length),
                None if w.computes is None else _narrow(w.computes[slot.tensor], start, length),
                None if computes_before is None else _narrow(computes_before[slot.tensor], start, length),
                w.compute_dtype,
                _narrow(w.grads[slot.tensor], start, length),
                () if states is None else states[index],
            )
        )
    return out


# -- round 1: every step ---------------------------------------------------------------------------


def _compute_pair(m: torch.Tensor, mb: torch.Tensor, s: _Segment, start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A chunk's compute weight after and before the step: the materialized copy, or the main
    weight cast to the compute dtype as each all-gather casts it."""
    if s.compute is not None:
        assert s.compute_before is not None  # _segments refuses a materialized copy without it
        return _narrow(s.compute, start, m.numel()), _narrow(s.compute_before, start, m.numel())
    assert s.derived_dtype is not None
    n = m.numel()
    c = kernels.scratch.get("compute", m, s.derived_dtype, n).copy_(m)
    cb = kernels.scratch.get("compute_before", m, s.derived_dtype, n).copy_(mb)
    return c, cb


def _weights_round(rows: _Rows, i: int, s: _Segment, update: bool) -> None:
    """Round 1's passes over one segment's weights, chunk by chunk.

    A compute weight derived by casting the main weight (FSDP2, ``per_gather``) is a function of
    it, which gives two identities a materialized one (a refreshed buffer that might be stale)
    does not: zeros of the main weight stay zero, so underflow = nnz(main) - nnz(compute); and a
    compute element that changed had its main element change, so lost = changed(main) -
    changed(compute).
    """
    for start in s.chunks():
        n = min(kernels.CHUNK_ELEMENTS, s.slot.length - start)
        m, mb = _narrow(s.main, start, n), _narrow(s.before, start, n)
        rows.sum(i, MAIN_SQ, kernels.sq_norm(m))
        if s.compute is None and s.derived_dtype is None:  # the compute weight is the main weight
            rows.count(i, CHANGED, kernels.count_changed(m, mb))
            if update:
                diff = kernels.scratch.get("diff", m, torch.promote_types(m.dtype, torch.float32), n)
                rows.sum(i, UPDATE_SQ, kernels.sq_norm(torch.sub(m, mb, out=diff)))
            continue
        c, cb = _compute_pair(m, mb, s, start)
        wide_dtype = torch.promote_types(torch.promote_types(m.dtype, c.dtype), torch.float32)
        # The compute weight widened once: a subtraction of one dtype runs faster than its
        # mixed-dtype form, which widens element by element.
        wide = kernels.scratch.get("compute_wide", m, wide_dtype, n).copy_(c)
        diff = kernels.scratch.get("diff", m, wide_dtype, n)
        rows.sum(i, DIFF_SQ, kernels.sq_norm(torch.sub(m, wide, out=diff)))
        if update:
            rows.sum(i, UPDATE_SQ, kernels.sq_norm(torch.sub(m, mb, out=diff)))
        if s.compute is None:
            changed = kernels.count_changed(m, mb)
            rows.count(i, CHANGED, changed)
            rows.count(i, LOST, changed - kernels.count_changed(c, cb))
            mask, other = kernels.masks.get("mask", m, n), kernels.masks.get("mask2", m, n)
            rows.count(i, UNDERFLOW, kernels.count_nonzero(mask, m) - kernels.count_nonzero(other, c))
            continue
        mask, kept = kernels.masks.get("mask", m, n), kernels.masks.get("mask2", m, n)
        rows.count(i, CHANGED, kernels.count_true(kernels.changed_mask(mask, m, mb)))
        torch.eq(kernels.bits(c), kernels.bits(cb), out=kept)
        rows.count(i, LOST, kernels.count_true(torch.logical_and(mask, kept, out=kept)))  # mask: changed(main)
        # A comparison with a scalar runs several times slower than a conversion to bool
        # (x != 0) or logical_not (x == 0).
        torch.logical_not(c, out=kept)
        rows.count(i, UNDERFLOW, kernels.count_true(torch.logical_and(mask.copy_(m), kept, out=kept)))


class _Probes:
    """Device values read back with round 1's rows: each probe's values, by a key."""

    def __init__(self) -> None:
        self._keys: list[tuple[Any, ...]] = []
        self._widths: list[int] = []
        self._values: list[torch.Tensor] = []

    def add(self, key: tuple[Any, ...], *values: torch.Tensor) -> None:
        self._keys.append(key)
        self._widths.append(len(values))
        self._values.extend(values)

    def add_many(self, keys: Sequence[tuple[Any, ...]], values: Sequence[torch.Tensor]) -> None:
        for key, value in zip(keys, values, strict=True):
            self.add(key, value)

    def read(self, matrix: torch.Tensor) -> tuple[list[list[float]], dict[tuple[Any, ...], list[float]]]:
        """``matrix`` and every probe on the host, with one device-to-host copy."""
        flat = matrix.reshape(-1)
        if self._values:
            flat = torch.cat([flat, torch.stack(self._values).to(torch.float64)])
        host = flat.tolist()
        cells = matrix.numel()
        rows = [host[r : r + ROW] for r in range(0, cells, ROW)]
        found: dict[tuple[Any, ...], list[float]] = {}
        cursor = cells
        for key, n in zip(self._keys, self._widths, strict=True):
            found[key] = host[cursor : cursor + n]
            cursor += n
        return rows, found


def _underflow_round(rows: _Rows, i: int, s: _Segment, below: float) -> None:
    """Grad elements that are 0, and that are not 0 but below ``below`` in magnitude (two counts
    over the segment's grad; only where a float16 backward could have flushed them)."""
    if s.grad is None:
        return
    for start in range(0, s.grad.numel(), kernels.CHUNK_ELEMENTS):
        g = _narrow(s.grad, start, min(kernels.CHUNK_ELEMENTS, s.grad.numel() - start))
        n = g.numel()
        nonzero = kernels.count_nonzero(kernels.masks.get("mask", g, n), g)
        small = kernels.masks.get("mask2", g, n)
        torch.lt(torch.abs(g, out=kernels.scratch.get("grad_abs", g, g.dtype, n)), below, out=small)
        rows.count(i, GRAD_ZERO, n - nonzero)
        rows.count(i, GRAD_TINY, kernels.count_true(small) - (n - nonzero))


def _probe_round(probes: _Probes, i: int, s: _Segment) -> None:
    """Round 1's min/max of the segment's grad and ``exp_avg_sq`` (is some element 0?)."""
    if s.grad is not None and s.grad.numel():
        probes.add(("grad", i), *torch.aminmax(s.grad))
    for state in s.states:
        if state.key == SECOND_MOMENT_KEY and state.local.numel() and not state.shows_in_weight:
            probes.add(("state", i, state.index), *torch.aminmax(state.local))


# -- round 2: what round 1 flagged -----------------------------------------------------------------


def _repair_weights(rows: _Rows, i: int, s: _Segment, update: bool) -> None:
    """Round 2 for a segment with a NaN/Inf in a weight (or a sum too large for its dtype): the
    counts round 1 skipped, and the squared norms over the elements finite in both weights."""
    for start in s.chunks():
        n = min(kernels.CHUNK_ELEMENTS, s.slot.length - start)
        m, mb = _narrow(s.main, start, n), _narrow(s.before, start, n)
        for slot, value in zip((MAIN_NAN, MAIN_INF), kernels.count_nonfinite(m), strict=True):
            rows.count(i, slot, value)
        if s.compute is None and s.derived_dtype is None:
            for slot, value in zip((COMPUTE_NAN, COMPUTE_INF), kernels.count_nonfinite(m), strict=True):
                rows.count(i, slot, value)
            rows.sum(i, MAIN_SQ, kernels.sq_norm(torch.where(torch.isfinite(m), m, 0.0)))
            if update:
                _update_sq(rows, i, m, mb)
            continue
        c, _ = _compute_pair(m, mb, s, start)
        for slot, value in zip((COMPUTE_NAN, COMPUTE_INF), kernels.count_nonfinite(c), strict=True):
            rows.count(i, slot, value)
        m_finite = torch.isfinite(m)
        rows.count(i, OVERFLOW, torch.count_nonzero(m_finite & torch.isinf(c)))
        finite = m_finite & torch.isfinite(c)
        wide = c.to(torch.promote_types(torch.promote_types(m.dtype, c.dtype), torch.float32))
        rows.sum(i, DIFF_SQ, kernels.sq_norm(torch.where(finite, m - wide, 0.0)))
        rows.sum(i, MAIN_SQ, kernels.sq_norm(torch.where(finite, m, 0.0)))
        if update:
            _update_sq(rows, i, m, mb)


def _update_sq(rows: _Rows, i: int, m: torch.Tensor, mb: torch.Tensor) -> None:
    delta = m - mb
    rows.sum(i, UPDATE_SQ, kernels.sq_norm(torch.where(torch.isfinite(delta), delta, 0.0)))


def _count_state_nonfinite(rows: _Rows, i: int, state: StateTensor) -> None:
    nan, inf = kernels.count_nonfinite(state.local)
    rows.count(i, STATE_NAN + 2 * state.index, nan)
    rows.count(i, STATE_INF + 2 * state.index, inf)


def _count_flushed(rows: _Rows, i: int, s: _Segment, state: StateTensor) -> None:
    """Elements of ``exp_avg_sq`` that are 0 while their grad is not."""
    assert s.grad is not None
    numel = state.local.numel()
    for start in range(0, numel, kernels.CHUNK_ELEMENTS):
        length = min(kernels.CHUNK_ELEMENTS, numel - start)
        zero = torch.logical_not(state.local.narrow(0, start, length), out=kernels.masks.get("mask", s.main, length))
        moving = kernels.masks.get("mask2", s.main, length).copy_(s.grad.narrow(0, start, length))
        rows.count(i, STATE_FLUSHED, kernels.count_true(torch.logical_and(zero, moving, out=zero)))


def _finite(values: Sequence[float]) -> bool:
    return all(math.isfinite(v) for v in values)


def local_rows(
    snapshot: PrecisionSnapshot,
    groups: Sequence[Any],
    table: Sequence[ParamSlot],
    states: Sequence[Sequence[StateTensor]] | None = None,
    detail: bool = True,
    underflow_below: float | None = None,
) -> torch.Tensor:
    """This rank's rows, one per slot of ``table`` (float64, ``(len(table), ROW)``, on the
    buffers' device); reads the buffers, writes none.

    Args:
        snapshot: The weights before the step (:func:`~.groups.take_snapshot` of ``groups``).
        groups: The diagnosed groups, as when the snapshot was taken.
        table: :func:`~.rows.param_table` of ``groups``.
        states: Per slot, its optimizer state tensors (none: no state diagnostics).
        detail: Also compute what only attribution reads (``UPDATE_SQ``, the state slots);
            ``False`` computes the whole-model diagnostics alone.
        underflow_below: Count each grad's zeros and its non-zero elements below this magnitude
            (``GRAD_ZERO``, ``GRAD_TINY``); ``None``: not counted.

    Raises:
        ValueError: ``groups`` does not match the snapshot, or ``states`` the table.
    """
    segments = _segments(snapshot, groups, table, states if detail else None)
    device = segments[0].main.device if segments else torch.device("cpu")
    with torch.no_grad():
        first, probes = _Rows(len(segments), device), _Probes()
        normed: list[tuple[str, int, int]] = []
        normed_tensors: list[torch.Tensor] = []
        for i, s in enumerate(segments):
            first.host[i][NUMEL] = float(s.slot.length)
            _weights_round(first, i, s, detail)
            _probe_round(probes, i, s)
            if underflow_below is not None:
                _underflow_round(first, i, s, underflow_below)
            for state in s.states:
                # Not the second moment: finite iff every element is, which one fused norm tells.
                if state.key != SECOND_MOMENT_KEY and state.local.numel() and not state.shows_in_weight:
                    normed.append(("state", i, state.index))
                    normed_tensors.append(state.local)
        if normed_tensors:
            probes.add_many(normed, list(torch._foreach_norm(normed_tensors)))
        matrix = first.matrix()
        host, found = probes.read(matrix)

        second = _Rows(len(segments), device)
        flagged: list[int] = []
        for i, s in enumerate(segments):
            row = host[i]
            grad = found.get(("grad", i))
            if grad is not None:  # the plan reads a grad only where there is one
                amax = max(-grad[0], grad[1])
                second.host[i][GRAD_AMAX] = amax if math.isfinite(amax) else GRAD_AMAX_NONFINITE
                if not math.isfinite(amax):
                    assert s.grad is not None
                    for slot, value in zip((GRAD_NAN, GRAD_INF), kernels.count_nonfinite(s.grad), strict=True):
                        second.count(i, slot, value)
            if not _finite([row[k] for k in _SUMS]):
                flagged.append(i)
                _repair_weights(second, i, s, detail)
            main_ok = math.isfinite(row[MAIN_SQ])
            for state in s.states:
                if not state.local.numel():
                    continue
                if state.shows_in_weight:
                    if not main_ok:
                        _count_state_nonfinite(second, i, state)
                    continue
                low_high = found.get(("state", i, state.index))
                if low_high is None:
                    continue
                if not _finite(low_high):
                    _count_state_nonfinite(second, i, state)
                low, high = low_high[0], low_high[-1]
                if (
                    state.key == SECOND_MOMENT_KEY
                    and low <= 0.0 <= high
                    and s.grad is not None
                    and s.grad.numel() == state.local.numel()
                ):
                    _count_flushed(second, i, s, state)
        if flagged:
            index = torch.tensor(flagged, dtype=torch.long, device=device)
            matrix[index.unsqueeze(1), torch.tensor(_SUMS, device=device)] = 0.0
        return matrix + second.matrix()
