"""Round 1 of a diagnosed step's rows (:mod:`.param_stats`) over packs of small parameters: a few
operations a pack instead of a few operations a parameter.

Round 1 runs some twenty whole-tensor operations per parameter. For a large parameter they are
passes over memory; for a small one (a bias, a norm's weight, a small model's matrices) each costs
its dispatch, on a GPU a launch, whatever the parameter's size, and a model of many small tensors
spends the diagnosed step issuing them. So consecutive small parameters of one kind
(:func:`signature`: the same dtypes, device and compute-weight form, a grad, the same state) are
packed: each of their tensors copied into one buffer (:func:`_pack`, a ``torch.cat`` into a kept
buffer), every pass run once over the pack, and each parameter's count or sum taken out by one
``index_add_`` over the pack's segment ids (its least and greatest grad by ``scatter_reduce``).
The values are round 1's, parameter by parameter: counts exact, sums accumulated in float64 (the
per-parameter passes square and add in the weight's dtype, float32 at least). What round 1 leaves
to round 2 (a NaN/Inf, found by the sums and probes) is repaired parameter by parameter as before.

Alternatives considered:
    - ``torch.segment_reduce`` for the sums: as costly per element as ``index_add_`` on a CPU,
      and it needs the lengths as a tensor per call.
    - Packing every parameter: a large one's passes are memory-bound already, and its copy
      would add a pass and a buffer of its size.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from . import kernels
from .rows import (
    CHANGED,
    DIFF_SQ,
    GRAD_AMAX,
    GRAD_AMAX_NONFINITE,
    GRAD_TINY,
    GRAD_ZERO,
    LOST,
    MAIN_SQ,
    SECOND_MOMENT_KEY,
    STATE_FLUSHED,
    UNDERFLOW,
    UPDATE_SQ,
)
from .segments import Probes, Rows, Segment

__all__ = ["PACK_MAX_SEGMENT", "packs", "packed_round", "signature"]

PACK_MAX_SEGMENT = 1 << 13
"""The largest parameter (its local elements) packed: past it, a parameter's own passes cost
about what copying it into a pack would."""

# Segment ids of each pack's lengths, kept across steps (a model's packs stay the same), up to
# _KEPT_ID_ELEMENTS ids in all (128 MiB of int64; a model's small parameters hold far fewer).
_IDS: dict[tuple[tuple[int, ...], torch.device], torch.Tensor] = {}
_KEPT_ID_ELEMENTS = 1 << 24


def signature(s: Segment) -> tuple[Any, ...] | None:
    """What a parameter's round 1 depends on besides its values (``None``: not packed)."""
    length = s.slot.length
    if not 0 < length <= PACK_MAX_SEGMENT or s.grad is None or s.grad.numel() != length:
        return None
    moment = [state for state in s.states if state.key == SECOND_MOMENT_KEY]
    if len(moment) > 1 or (moment and moment[0].local.numel() not in (0, length)):
        return None
    form = "main" if s.compute is None and s.derived_dtype is None else "derived" if s.compute is None else "copy"
    compute_dtype = s.derived_dtype if s.compute is None else s.compute.dtype
    states = tuple((state.key, state.index, state.shows_in_weight, state.local.numel() > 0) for state in s.states)
    return (s.main.dtype, s.main.device, form, compute_dtype, s.grad.dtype, states)


def packs(found: Sequence[Segment]) -> tuple[list[list[int]], list[int]]:
    """The packs (each a run of consecutive segments of one :func:`signature`, 2 or more, at most
    ``kernels.CHUNK_ELEMENTS`` elements together) and the segments left to their own passes."""
    runs: list[list[int]] = []
    alone: list[int] = []
    current: list[int] = []
    current_key: tuple[Any, ...] | None = None
    total = 0

    def close() -> None:
        if len(current) > 1:
            runs.append(list(current))
        else:
            alone.extend(current)
        current.clear()

    for i, s in enumerate(found):
        key = signature(s)
        if key is None:
            close()
            current_key, total = None, 0
            alone.append(i)
            continue
        if key != current_key or total + s.slot.length > kernels.CHUNK_ELEMENTS:
            close()
            current_key, total = key, 0
        current.append(i)
        total += s.slot.length
    close()
    alone.sort()
    return runs, alone


def _ids(lengths: tuple[int, ...], device: torch.device) -> torch.Tensor:
    key = (lengths, device)
    ids = _IDS.get(key)
    if ids is None:
        if sum(map(torch.Tensor.numel, _IDS.values())) + sum(lengths) > _KEPT_ID_ELEMENTS:
            _IDS.clear()
        counts = torch.tensor(lengths, dtype=torch.long)
        ids = _IDS[key] = torch.repeat_interleave(torch.arange(len(lengths)), counts).to(device)
    return ids


def _pack(role: str, tensors: Sequence[torch.Tensor], total: int) -> torch.Tensor:
    """``tensors`` (flat, one dtype) copied end to end into a kept buffer."""
    first = tensors[0]
    return torch.cat(list(tensors), out=kernels.scratch.get(role, first, first.dtype, total))


class _Segments:
    """Per-segment reductions of a pack's element values."""

    def __init__(self, ids: torch.Tensor, count: int) -> None:
        self.ids = ids
        self.count = count

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """Each segment's sum of ``values`` (float64)."""
        out = torch.zeros(self.count, dtype=torch.float64, device=values.device)
        return out.index_add_(0, self.ids, values.to(torch.float64))

    def squares(self, values: torch.Tensor) -> torch.Tensor:
        wide = values.to(torch.float64)
        return self.sum(wide.mul_(wide) if wide is not values else wide * wide)

    def extreme(self, values: torch.Tensor, reduce: str) -> torch.Tensor:
        """Each segment's least (``"amin"``) or greatest (``"amax"``) value; NaN where it holds one."""
        out = torch.zeros(self.count, dtype=values.dtype, device=values.device)
        return out.scatter_reduce_(0, self.ids, values, reduce, include_self=False)


def packed_round(
    rows: Rows, probes: Probes, indices: Sequence[int], found: Sequence[Segment], update: bool, below: float | None
) -> None:
    """Round 1 of the segments ``found`` (rows ``indices``, one :func:`signature`), as
    ``param_stats``' per-parameter passes make it, over one pack."""
    lengths = tuple(s.slot.length for s in found)
    total = sum(lengths)
    first = found[0]
    seg = _Segments(_ids(lengths, first.main.device), len(found))
    rows_of = list(indices)
    m = _pack("pack_main", [s.main for s in found], total)
    mb = _pack("pack_before", [s.before for s in found], total)
    rows.add_many(rows_of, MAIN_SQ, seg.squares(m))
    main_changed = torch.ne(kernels.bits(m), kernels.bits(mb))
    if update:
        rows.add_many(rows_of, UPDATE_SQ, seg.squares(m.to(torch.float64) - mb.to(torch.float64)))
    if first.compute is None and first.derived_dtype is None:  # the compute weight is the main weight
        rows.add_many(rows_of, CHANGED, seg.sum(main_changed))
    else:
        if first.compute is None:
            assert first.derived_dtype is not None
            c, cb = m.to(first.derived_dtype), mb.to(first.derived_dtype)
        else:
            c = _pack("pack_compute", [s.compute for s in found if s.compute is not None], total)
            cb = _pack("pack_compute_before", [s.compute_before for s in found if s.compute_before is not None], total)
        rows.add_many(rows_of, DIFF_SQ, seg.squares(m.to(torch.float64) - c.to(torch.float64)))
        rows.add_many(rows_of, CHANGED, seg.sum(main_changed))
        # A compute element that kept its bits while its main element changed lost the update; one
        # that is 0 while its main element is not underflowed.
        rows.add_many(rows_of, LOST, seg.sum(main_changed & torch.eq(kernels.bits(c), kernels.bits(cb))))
        rows.add_many(rows_of, UNDERFLOW, seg.sum(torch.ne(m, 0) & torch.eq(c, 0)))
    _packed_probes(rows, probes, rows_of, found, seg, total, below)


def _packed_probes(
    rows: Rows,
    probes: Probes,
    rows_of: list[int],
    found: Sequence[Segment],
    seg: _Segments,
    total: int,
    below: float | None,
) -> None:
    """The grads' least and greatest values (their amax into the rows), the second moments' and
    the elements it flushed to zero; the grads' zero and tiny counts where asked (``below``)."""
    g = _pack("pack_grad", [s.grad for s in found if s.grad is not None], total)
    low, high = seg.extreme(g, "amin"), seg.extreme(g, "amax")
    probes.add_pairs([("grad", i) for i in rows_of], low, high)
    amax = torch.maximum(-low, high).to(torch.float64)
    rows.add_many(rows_of, GRAD_AMAX, torch.where(torch.isfinite(amax), amax, GRAD_AMAX_NONFINITE))
    grad_nonzero = torch.ne(g, 0)
    for k, state in enumerate(found[0].states):
        if state.key != SECOND_MOMENT_KEY or not state.local.numel() or state.shows_in_weight:
            continue
        st = _pack("pack_state", [s.states[k].local for s in found], total)
        probes.add_pairs([("state", i, state.index) for i in rows_of], seg.extreme(st, "amin"), seg.extreme(st, "amax"))
        rows.add_many(rows_of, STATE_FLUSHED, seg.sum(torch.eq(st, 0) & grad_nonzero))
    if below is not None:
        zero = seg.sum(torch.logical_not(grad_nonzero))
        rows.add_many(rows_of, GRAD_ZERO, zero)
        rows.add_many(rows_of, GRAD_TINY, seg.sum(torch.lt(torch.abs(g), below)) - zero)
