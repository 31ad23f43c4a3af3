"""Per-parameter precision rows of one diagnosed step, computed from the flat buffers by segment.

No OpenTelemetry here: :func:`local_rows` turns one diagnosed step into this rank's rows
(:mod:`~fsdp_patch.telemetry.diagnostics.rows` holds their layout, and how ranks combine them).

Where a parameter is: a ``fully_shard`` group's flat buffers hold each parameter's local shard at
the offset its layout gives (``ParamLayout.offset``, ``local_numel`` elements; the padding after
it is zero in every buffer and contributes nothing); a torch FSDP2 group holds one local tensor
per parameter. Each parameter is one segment of one main tensor, and every pass runs over whole
segments, in chunks of at most ``kernels.CHUNK_ELEMENTS`` elements: a Python loop over parameters
and chunks, never over elements.

Small parameters of one kind, one after another, run round 1 as one pack (:mod:`.packed_stats`):
a few operations a pack, where a small parameter's own passes cost their dispatch each.

Two rounds; round 2 only where round 1 found a NaN/Inf:

1. **What every step needs**, chunk by chunk, each chunk's passes one after another while it is
   in cache: the changed and lost counts, the underflow count, the squared norms of the main
   weight, of the refresh difference and of the update; each grad's min/max (its amax goes into
   the row on the device, or the NaN/Inf marker), each ``exp_avg_sq``'s min/max and the elements
   it flushed to zero, and one fused L2 norm of the other state tensors. These are written as if
   no element were NaN or Inf (no finite masks): a NaN or an Inf anywhere in a segment makes one
   of its sums or probes NaN or Inf, which one device flag (:attr:`FirstRound.needs_second`)
   tells, with nothing read on the host (:func:`first_round`).
2. **Only what round 1 flagged**, read on the host (:func:`second_round`): for those segments,
   the NaN/Inf counts, the overflow count and the squared norms over the elements finite in both
   weights (replacing round 1's); the NaN/Inf counts of flagged grads and state tensors. The
   precision recorder reads round 1 with the ranks' reduction of it, one host copy, and runs
   round 2 only where some rank's flag is set (:mod:`.reduced_rows`): a healthy step waits for
   the device once.

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
from dataclasses import dataclass
from typing import Any

import torch

from . import kernels
from .groups import PrecisionSnapshot
from .packed_stats import packed_round, packs
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
    SECOND_MOMENT_KEY,
    STATE_FLUSHED,
    STATE_INF,
    STATE_NAN,
    UNDERFLOW,
    UPDATE_SQ,
    ParamSlot,
    StateTensor,
)
from .segments import Probes, Rows, Segment, compute_pair, narrow, segments

_SUMS = (DIFF_SQ, MAIN_SQ, UPDATE_SQ)
"""The slots round 1 sums without finite masks, which round 2 replaces where a segment is flagged."""

# -- round 1: every step ---------------------------------------------------------------------------


def _weights_round(rows: Rows, i: int, s: Segment, update: bool) -> None:
    """Round 1's passes over one segment's weights, chunk by chunk.

    A compute weight derived by casting the main weight (FSDP2, ``per_gather``) is a function of
    it, which gives two identities a materialized one (a refreshed buffer that might be stale)
    does not: zeros of the main weight stay zero, so underflow = nnz(main) - nnz(compute); and a
    compute element that changed had its main element change, so lost = changed(main) -
    changed(compute).
    """
    for start in s.chunks():
        n = min(kernels.CHUNK_ELEMENTS, s.slot.length - start)
        m, mb = narrow(s.main, start, n), narrow(s.before, start, n)
        rows.sum(i, MAIN_SQ, kernels.sq_norm(m))
        if s.compute is None and s.derived_dtype is None:  # the compute weight is the main weight
            rows.count(i, CHANGED, kernels.count_changed(m, mb))
            if update:
                diff = kernels.scratch.get("diff", m, torch.promote_types(m.dtype, torch.float32), n)
                rows.sum(i, UPDATE_SQ, kernels.sq_norm(torch.sub(m, mb, out=diff)))
            continue
        c, cb = compute_pair(m, mb, s, start)
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


def _underflow_round(rows: Rows, i: int, s: Segment, below: float) -> None:
    """Grad elements that are 0, and that are not 0 but below ``below`` in magnitude (two counts
    over the segment's grad; only where a float16 backward could have flushed them)."""
    if s.grad is None:
        return
    for start in range(0, s.grad.numel(), kernels.CHUNK_ELEMENTS):
        g = narrow(s.grad, start, min(kernels.CHUNK_ELEMENTS, s.grad.numel() - start))
        n = g.numel()
        nonzero = kernels.count_nonzero(kernels.masks.get("mask", g, n), g)
        small = kernels.masks.get("mask2", g, n)
        torch.lt(torch.abs(g, out=kernels.scratch.get("grad_abs", g, g.dtype, n)), below, out=small)
        rows.count(i, GRAD_ZERO, n - nonzero)
        rows.count(i, GRAD_TINY, kernels.count_true(small) - (n - nonzero))


def _probe_round(probes: Probes, rows: Rows, i: int, s: Segment) -> None:
    """Round 1's min/max of the segment's grad (its amax, or the NaN/Inf marker, into the row),
    the min/max of its ``exp_avg_sq`` and that state's elements flushed to zero."""
    if s.grad is not None and s.grad.numel():
        low, high = torch.aminmax(s.grad)
        probes.add(("grad", i), low, high)
        amax = torch.maximum(-low, high).to(torch.float64)
        rows.sum(i, GRAD_AMAX, torch.where(torch.isfinite(amax), amax, GRAD_AMAX_NONFINITE))
    for state in s.states:
        if state.key == SECOND_MOMENT_KEY and state.local.numel() and not state.shows_in_weight:
            probes.add(("state", i, state.index), *torch.aminmax(state.local))
            if s.grad is not None and s.grad.numel() == state.local.numel():
                _count_flushed(rows, i, s, state)


# -- round 2: what round 1 flagged -----------------------------------------------------------------


def _repair_weights(rows: Rows, i: int, s: Segment, update: bool) -> None:
    """Round 2 for a segment with a NaN/Inf in a weight (or a sum too large for its dtype): the
    counts round 1 skipped, and the squared norms over the elements finite in both weights."""
    for start in s.chunks():
        n = min(kernels.CHUNK_ELEMENTS, s.slot.length - start)
        m, mb = narrow(s.main, start, n), narrow(s.before, start, n)
        for slot, value in zip((MAIN_NAN, MAIN_INF), kernels.count_nonfinite(m), strict=True):
            rows.count(i, slot, value)
        if s.compute is None and s.derived_dtype is None:
            for slot, value in zip((COMPUTE_NAN, COMPUTE_INF), kernels.count_nonfinite(m), strict=True):
                rows.count(i, slot, value)
            rows.sum(i, MAIN_SQ, kernels.sq_norm(torch.where(torch.isfinite(m), m, 0.0)))
            if update:
                _update_sq(rows, i, m, mb)
            continue
        c, _ = compute_pair(m, mb, s, start)
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


def _update_sq(rows: Rows, i: int, m: torch.Tensor, mb: torch.Tensor) -> None:
    delta = m - mb
    rows.sum(i, UPDATE_SQ, kernels.sq_norm(torch.where(torch.isfinite(delta), delta, 0.0)))


def _count_state_nonfinite(rows: Rows, i: int, state: StateTensor) -> None:
    nan, inf = kernels.count_nonfinite(state.local)
    rows.count(i, STATE_NAN + 2 * state.index, nan)
    rows.count(i, STATE_INF + 2 * state.index, inf)


def _count_flushed(rows: Rows, i: int, s: Segment, state: StateTensor) -> None:
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


@dataclass
class FirstRound:
    """Round 1 of one diagnosed step on the device, not yet read.

    Attributes:
        matrix: This rank's rows (float64, ``(len(table), ROW)``): every slot as round 1 computed
            it, the grad amax included (its NaN/Inf marker where a grad holds one), and the
            flushed-to-zero counts of ``exp_avg_sq``.
        needs_second: 1.0 where a sum or probe is NaN/Inf (round 2 has something to count or
            repair on this rank), else 0.0: a device scalar, reduced with the rows.
        probe_values: Every probe's values, in :attr:`probes`' order (float64, on the device).
    """

    segments: list[Segment]
    matrix: torch.Tensor
    needs_second: torch.Tensor
    detail: bool
    probes: Probes
    probe_values: torch.Tensor

    def host_tensors(self) -> list[torch.Tensor]:
        """What round 2 reads on the host: the rows and the probes (see :meth:`read`)."""
        return [self.matrix, self.probe_values]

    def read(
        self, host: Sequence[torch.Tensor] | None = None
    ) -> tuple[list[list[float]], dict[tuple[Any, ...], list[float]]]:
        """The rows and each probe's values on the host, from :meth:`host_tensors` as copied there
        (``None``: read them now, one device-to-host copy)."""
        matrix, probes = self.host_tensors() if host is None else host
        return self.probes.split(matrix.tolist(), probes.tolist())


def first_round(
    snapshot: PrecisionSnapshot,
    groups: Sequence[Any],
    table: Sequence[ParamSlot],
    states: Sequence[Sequence[StateTensor]] | None = None,
    detail: bool = True,
    underflow_below: float | None = None,
) -> FirstRound:
    """Round 1 of :func:`local_rows`, with nothing read on the host (arguments and errors as there)."""
    found_segments = segments(snapshot, groups, table, states if detail else None)
    device = found_segments[0].main.device if found_segments else torch.device("cpu")
    with torch.no_grad():
        first, probes = Rows(len(found_segments), device), Probes()
        normed: list[tuple[str, int, int]] = []
        normed_tensors: list[torch.Tensor] = []
        runs, alone = packs(found_segments)
        for run in runs:
            packed_round(first, probes, run, [found_segments[i] for i in run], detail, underflow_below)
        for i in alone:
            s = found_segments[i]
            _weights_round(first, i, s, detail)
            _probe_round(probes, first, i, s)
            if underflow_below is not None:
                _underflow_round(first, i, s, underflow_below)
        for i, s in enumerate(found_segments):
            first.host[i][NUMEL] = float(s.slot.length)
            for state in s.states:
                # Not the second moment: finite iff every element is, which one fused norm tells.
                if state.key != SECOND_MOMENT_KEY and state.local.numel() and not state.shows_in_weight:
                    normed.append(("state", i, state.index))
                    normed_tensors.append(state.local)
        if normed_tensors:
            probes.add_many(normed, list(torch._foreach_norm(normed_tensors)))
        matrix = first.matrix()
        sums = matrix[:, list(_SUMS)].reshape(-1)
        probe_values = probes.stacked(matrix)
        checked = torch.cat([sums, probe_values]) if probes else sums
        needs_second = torch.logical_not(torch.isfinite(checked).all()).to(torch.float64)
    return FirstRound(found_segments, matrix, needs_second, detail, probes, probe_values)


def second_round(first: FirstRound, host: list[list[float]], found: dict[tuple[Any, ...], list[float]]) -> torch.Tensor:
    """This rank's rows: round 1's with round 2 applied where ``host`` and ``found`` (round 1 read,
    :meth:`FirstRound.read`) show a NaN/Inf; round 1's as they are where none does."""
    segments, matrix, detail = first.segments, first.matrix, first.detail
    with torch.no_grad():
        second = Rows(len(segments), matrix.device)
        flagged: list[int] = []
        for i, s in enumerate(segments):
            row = host[i]
            grad = found.get(("grad", i))
            if grad is not None and not _finite(grad):
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
                probed = found.get(("state", i, state.index))
                if probed is not None and not _finite(probed):
                    _count_state_nonfinite(second, i, state)
        if not flagged and not second.pending:
            return matrix
        matrix = matrix.clone()
        if flagged:
            index = torch.tensor(flagged, dtype=torch.long, device=matrix.device)
            matrix[index.unsqueeze(1), torch.tensor(_SUMS, device=matrix.device)] = 0.0
        return matrix + second.matrix()


def local_rows(
    snapshot: PrecisionSnapshot,
    groups: Sequence[Any],
    table: Sequence[ParamSlot],
    states: Sequence[Sequence[StateTensor]] | None = None,
    detail: bool = True,
    underflow_below: float | None = None,
) -> torch.Tensor:
    """This rank's rows, one per slot of ``table`` (float64, ``(len(table), ROW)``, on the
    buffers' device); reads the buffers, writes none. Round 1 read on the host with one copy,
    then round 2 (the precision recorder reads round 1 together with the ranks' reduction
    instead: :func:`first_round`, :func:`second_round`).

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
    first = first_round(snapshot, groups, table, states, detail, underflow_below)
    return second_round(first, *first.read())
