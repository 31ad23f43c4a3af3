"""Per-parameter precision diagnostics, computed from the flat buffers by segment.

No OpenTelemetry here (as in :mod:`fsdp_patch.telemetry.diagnostics.precision`, whose views, snapshot and
definitions this module shares): it turns one diagnosed step into a float64 matrix with one row
per parameter, :data:`ROW` numbers each, which the observer reduces across ranks with one
collective and :mod:`fsdp_patch.telemetry.diagnostics.attribution` reads. The whole-model vector of
:mod:`~fsdp_patch.telemetry.diagnostics.precision` is the sum of the rows (:func:`totals`), so every number
is computed once.

Where a parameter is: a ``fully_shard`` group's flat buffers hold each parameter's local shard at
the offset its layout gives (``ParamLayout.offset``, ``local_numel`` elements; the padding after
it is zero in every buffer and contributes nothing); a torch FSDP2 group holds one local tensor
per parameter. Each parameter is one segment (:class:`ParamSlot`) of one main tensor, and every
pass runs over whole segments, in chunks of at most ``precision.CHUNK_ELEMENTS`` elements: a
Python loop over parameters and chunks, never over elements. A fused pre-pass (``_foreach_norm``
over the segments, a min/max per compute weight, grad and optimizer-state tensor, one
device-to-host copy) tells which segments hold NaN/Inf; only those pay for counting them.

Row slots (the first 13 are precision's whole-model slots, in its order):

* ``GRAD_NAN`` .. ``GRAD_AMAX``: precision's diagnostics of this parameter's segments.
* ``UPDATE_SQ``: ``||main - main_before||²`` (finite elements), where the compute dtype is
  narrower than the main dtype (an update can be lost in it); 0 elsewhere.
* ``NUMEL``: the segment's elements.
* ``STATE_FLUSHED``: elements whose ``exp_avg_sq`` is 0 while their grad is not.
* ``STATE_NAN + 2 i``, ``STATE_INF + 2 i``: NaN and Inf elements of the parameter's i-th
  optimizer state tensor (at most :data:`MAX_STATES`).

Counting a bool mask with ``count_nonzero`` runs at about 1 ns per element on a CPU, slower than
the comparison that made it; :func:`_count_true` sums the mask as 64-bit words instead (eight
lanes of bytes, 128 words at a time so no lane carries), which is memory-bound.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, overload

import torch

from fsdp_patch.torch_compat import all_gather_flat

from . import precision

# -- the row of one parameter ----------------------------------------------------------------

(GRAD_NAN, GRAD_INF, MAIN_NAN, MAIN_INF, COMPUTE_NAN, COMPUTE_INF,
 OVERFLOW, UNDERFLOW, DIFF_SQ, MAIN_SQ, CHANGED, LOST, GRAD_AMAX) = range(13)  # fmt: skip
UPDATE_SQ = 13
NUMEL = 14
STATE_FLUSHED = 15
STATE_NAN = 16
STATE_INF = 17
MAX_STATES = 4
"""State tensors per parameter whose non-finite elements are counted (Adam with amsgrad has 3)."""
ROW = STATE_NAN + 2 * MAX_STATES
_TOTALS = 13

SECOND_MOMENT_KEY = "exp_avg_sq"
"""The state key whose flushed-to-zero elements are counted."""

# Masks shorter than this are counted with count_nonzero (one call, no padding to handle).
_WORD_COUNT_MIN = 1 << 14
_WORD_BLOCK = 8 * 128  # bytes per summed block of 128 int64 words


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter is in the diagnosed groups.

    Attributes:
        name: Its fully qualified name.
        unit: The fully qualified name of the sharded module holding it (``""``: the root).
        param: The sharded parameter (the optimizer's key for its state); ``None`` for groups
            that hold buffers only.
        group: Index of its group in the diagnosed groups.
        tensor: Index of its main tensor in that group (0 for a flat buffer).
        start: First element of its segment in that tensor.
        length: Elements of the segment on this rank (0 where this rank's shard is empty).
        compute_dtype: Dtype of its compute weight; ``None`` when that is the main weight.
        main_dtype: Dtype of its main weight.
    """

    name: str
    unit: str
    param: torch.Tensor | None
    group: int
    tensor: int
    start: int
    length: int
    compute_dtype: torch.dtype | None
    main_dtype: torch.dtype

    @property
    def lossy(self) -> bool:
        """Whether the compute dtype is narrower than the main dtype, so that updates can be lost."""
        return self.compute_dtype is not None and torch.finfo(self.compute_dtype).eps > torch.finfo(self.main_dtype).eps


def _unit_of_flat_group(group: Any) -> str:
    from fsdp_patch.module import unit_name_of

    try:
        return unit_name_of(group)
    except TypeError:  # not weakly referable: a stand-in, not a ParameterGroup
        return ""


def param_table(
    groups: Sequence[Any], default_compute_dtype: torch.dtype | None = None, per_parameter: bool = True
) -> list[ParamSlot]:
    """One :class:`ParamSlot` per parameter of ``groups``, in group order, then parameter order.

    Groups with a ``layout`` (``fully_shard``'s) give one slot per parameter of their flat
    buffers, named by ``names``; tensor-list groups (FSDP2's) one per tensor, named by ``names``
    where they have them; a flat group without a layout is one slot. Stand-ins without names
    are named ``group{g}`` (and ``.{i}`` per tensor). ``per_parameter=False`` makes a flat
    group one slot (named after its first parameter): the whole-model diagnostics alone.
    """
    table: list[ParamSlot] = []
    for g, group in enumerate(groups):
        w = precision._weights_of(group, default_compute_dtype)
        dtype: torch.dtype | None = w.computes[0].dtype if w.computes is not None else w.compute_dtype
        if hasattr(group, "main_weights"):
            names = list(getattr(group, "names", None) or [f"group{g}.{i}" for i in range(len(w.mains))])
            unit = getattr(group, "unit_name", "")
            params = list(getattr(group, "members", None) or [None] * len(w.mains))
            for i, main in enumerate(w.mains):
                table.append(ParamSlot(names[i], unit, params[i], g, i, 0, main.numel(), dtype, main.dtype))
            continue
        main = w.mains[0]
        layout = getattr(group, "layout", None)
        if layout is None or not per_parameter:
            names = getattr(group, "names", None) or [f"group{g}"]
            unit = "" if layout is None else _unit_of_flat_group(group)
            table.append(ParamSlot(names[0], unit, None, g, 0, 0, main.numel(), dtype, main.dtype))
            continue
        unit = _unit_of_flat_group(group)
        params = getattr(group, "params", None) or [None] * len(layout.params)
        for i, p in enumerate(layout.params):
            table.append(ParamSlot(group.names[i], unit, params[i], g, 0, p.offset, p.local_numel, dtype, main.dtype))
    return table


# -- device-side accumulation --------------------------------------------------------------------


class _Rows:
    """The rows being computed: host-known values, and device scalars added once at the end."""

    def __init__(self, count: int, device: torch.device) -> None:
        self.device = device
        self.host = [[0.0] * ROW for _ in range(count)]
        self._index: list[int] = []
        self._values: list[torch.Tensor] = []

    def add(self, row: int, slot: int, value: torch.Tensor) -> None:
        self._index.append(row * ROW + slot)
        self._values.append(value.reshape(()))

    def matrix(self) -> torch.Tensor:
        rows = torch.tensor(self.host, dtype=torch.float64).to(self.device)
        if self._values:
            values = torch.stack([v.to(torch.float64) for v in self._values])
            index = torch.tensor(self._index, dtype=torch.long, device=self.device)
            rows.view(-1).index_add_(0, index, values)
        return rows.reshape(len(self.host), ROW)


class _Masks:
    """Bool work buffers padded to whole blocks of words, with a zero tail for :func:`_count_true`."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.device], torch.Tensor] = {}

    def get(self, role: str, like: torch.Tensor, numel: int) -> torch.Tensor:
        padded = -(-numel // _WORD_BLOCK) * _WORD_BLOCK
        key = (role, like.device)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < padded:
            size = max(padded, -(-precision.CHUNK_ELEMENTS // _WORD_BLOCK) * _WORD_BLOCK)
            buffer = self._buffers[key] = torch.zeros(size, dtype=torch.bool, device=like.device)
        if padded > numel:
            buffer[numel:padded].zero_()
        return buffer[:numel]


_masks = _Masks()


def _count_true(mask: torch.Tensor) -> torch.Tensor:
    """True elements of a mask from :class:`_Masks` (whose storage is False up to the next block)."""
    n = mask.numel()
    if n < _WORD_COUNT_MIN:
        return torch.count_nonzero(mask)
    padded = -(-n // _WORD_BLOCK) * _WORD_BLOCK
    words = mask.as_strided((padded,), (1,)).view(torch.int64).view(-1, 128)
    # Each byte lane of a block's sum adds at most 128 ones: no carry into the next lane.
    return words.sum(dim=1).view(torch.uint8).sum(dtype=torch.int64)


def _nonzero(mask: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Non-zero elements of ``t`` (NaN counts, -0.0 does not), as ``count_nonzero`` counts them:
    converting into a bool mask and counting its words runs several times faster."""
    return _count_true(mask.copy_(t))


def _count_nonfinite(rows: _Rows, row: int, t: torch.Tensor, nan_slot: int, inf_slot: int) -> None:
    rows.add(row, nan_slot, torch.count_nonzero(torch.isnan(t)))
    rows.add(row, inf_slot, torch.count_nonzero(torch.isinf(t)))


def _sq_norm(t: torch.Tensor) -> torch.Tensor:
    """``sum(t**2)`` as float64: a dot product (BLAS, twice as fast as ``vector_norm`` on a CPU,
    with vectorized partial sums) for float32/float64 chunks."""
    if t.dtype in (torch.float32, torch.float64):
        return torch.dot(t, t).double()
    return torch.linalg.vector_norm(t).double().square()


def _weight_chunk(
    rows: _Rows,
    row: int,
    m: torch.Tensor,
    mb: torch.Tensor,
    compute: torch.Tensor | None,
    compute_before: torch.Tensor | None,
    compute_dtype: torch.dtype | None,
    healthy: bool,
    update: bool,
) -> None:
    """Weight stats of one chunk of one parameter's main weight and its compute weight.

    ``healthy``: the pre-pass showed no NaN/Inf in the main or the compute weight and no
    overflow, so the counting passes and the finite masks are skipped. ``update``: also sum the
    squared update. A compute weight derived by casting the main weight (``compute is None``,
    FSDP2, ``per_gather``) is a function of it, which gives two identities a materialized one (a
    refreshed buffer that might be stale) does not: zeros of the main weight stay zero, so
    underflow = nnz(main) - nnz(compute); and a compute element that changed had its main
    element change, so lost = changed(main) - changed(compute).
    """
    n = m.numel()
    mask = _masks.get("mask", m, n)
    changed = _count_true(torch.ne(precision._bits(m), precision._bits(mb), out=mask))
    rows.add(row, CHANGED, changed)
    scratch = precision._scratch
    if compute is not None:
        c = compute
    elif compute_dtype is not None:
        c = scratch.get("compute", m, compute_dtype, n).copy_(m)
    else:  # the compute weight is the main weight
        if not healthy:
            _count_nonfinite(rows, row, m, MAIN_NAN, MAIN_INF)
            _count_nonfinite(rows, row, m, COMPUTE_NAN, COMPUTE_INF)
            rows.add(row, MAIN_SQ, _sq_norm(torch.where(torch.isfinite(m), m, 0.0)))
        return
    wide_dtype = torch.promote_types(torch.promote_types(m.dtype, c.dtype), torch.float32)
    # The compute weight widened once: a subtraction and a count of one dtype each run faster than
    # their mixed-dtype forms, which widen element by element.
    wide = scratch.get("compute_wide", m, wide_dtype, n).copy_(c)
    if compute is None:  # derived: c is the main weight cast to compute_dtype
        cb = scratch.get("compute_before", m, c.dtype, n).copy_(mb)
        other = _masks.get("mask2", m, n)
        rows.add(row, LOST, changed - _count_true(torch.ne(precision._bits(c), precision._bits(cb), out=other)))
        rows.add(row, UNDERFLOW, _nonzero(mask, m) - _nonzero(other, c))
    else:
        if compute_before is None:
            raise ValueError("a materialized compute weight needs its copy from before the step: none was given")
        cb = compute_before
        kept = _masks.get("mask2", m, n)
        torch.eq(precision._bits(c), precision._bits(cb), out=kept)
        rows.add(row, LOST, _count_true(torch.logical_and(mask, kept, out=kept)))  # mask: changed(main)
        # A comparison with a scalar runs several times slower than a conversion to bool
        # (x != 0) or logical_not (x == 0).
        torch.logical_not(c, out=kept)
        rows.add(row, UNDERFLOW, _count_true(torch.logical_and(mask.copy_(m), kept, out=kept)))
    diff = scratch.get("diff", m, wide_dtype, n)
    torch.sub(m, wide, out=diff)
    if healthy:
        rows.add(row, DIFF_SQ, _sq_norm(diff))
        if update:
            rows.add(row, UPDATE_SQ, _sq_norm(torch.sub(m, mb, out=diff)))
        return
    _count_nonfinite(rows, row, m, MAIN_NAN, MAIN_INF)
    _count_nonfinite(rows, row, c, COMPUTE_NAN, COMPUTE_INF)
    m_finite = torch.isfinite(m)
    rows.add(row, OVERFLOW, torch.count_nonzero(m_finite & torch.isinf(c)))
    finite = m_finite & torch.isfinite(c)
    rows.add(row, DIFF_SQ, _sq_norm(torch.where(finite, diff, 0.0)))
    rows.add(row, MAIN_SQ, _sq_norm(torch.where(finite, m, 0.0)))
    if update:
        torch.sub(m, mb, out=diff)
        rows.add(row, UPDATE_SQ, _sq_norm(torch.where(torch.isfinite(diff), diff, 0.0)))


@dataclass(frozen=True)
class StateTensor:
    """One optimizer state tensor of a parameter.

    Attributes:
        key: Its key in the parameter's state.
        index: Its index among the parameter's state tensors (< :data:`MAX_STATES`).
        local: This rank's local tensor, flattened.
        shows_in_weight: A NaN/Inf in it reaches the main weight within the step that wrote it
            (the optimizer's update is linear in it: Adam's ``exp_avg``, SGD's momentum), so it
            is counted only where the main weight holds NaN/Inf after the step.
    """

    key: str
    index: int
    local: torch.Tensor
    shows_in_weight: bool = False


@dataclass
class _Segment:
    """One slot's tensors for this step, and what the pre-pass found."""

    slot: ParamSlot
    main: torch.Tensor
    before: torch.Tensor
    compute: torch.Tensor | None
    compute_before: torch.Tensor | None
    derived_dtype: torch.dtype | None
    grad: torch.Tensor | None
    states: Sequence[StateTensor] = field(default_factory=tuple)


@overload
def _narrow(t: torch.Tensor, start: int, length: int) -> torch.Tensor: ...
@overload
def _narrow(t: None, start: int, length: int) -> None: ...
def _narrow(t: torch.Tensor | None, start: int, length: int) -> torch.Tensor | None:
    """Elements ``start:start + length`` of a flat tensor (a view); ``None`` (no such tensor) passes through."""
    return None if t is None else t.narrow(0, start, length)


def _segments(snapshot: precision.PrecisionSnapshot, groups: Sequence[Any], table: Sequence[ParamSlot],
              states: Sequence[Sequence[StateTensor]] | None) -> list[_Segment]:  # fmt: skip
    if len(groups) != len(snapshot.main_weights):
        raise ValueError(f"snapshot holds {len(snapshot.main_weights)} groups, got {len(groups)}")
    weights = [precision._weights_of(g, snapshot.default_compute_dtype) for g in groups]
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
        out.append(_Segment(
            slot,
            _narrow(w.mains[slot.tensor], start, length),
            _narrow(snapshot.main_weights[slot.group][slot.tensor], start, length),
            None if w.computes is None else _narrow(w.computes[slot.tensor], start, length),
            None if computes_before is None else _narrow(computes_before[slot.tensor], start, length),
            w.compute_dtype,
            _narrow(w.grads[slot.tensor], start, length),
            () if states is None else states[index],
        ))  # fmt: skip
    return out


def local_rows(
    snapshot: precision.PrecisionSnapshot,
    groups: Sequence[Any],
    table: Sequence[ParamSlot],
    states: Sequence[Sequence[StateTensor]] | None = None,
    detail: bool = True,
    update_slots: Collection[int] | None = None,
) -> torch.Tensor:
    """This rank's rows, one per slot of ``table`` (float64, ``(len(table), ROW)``, on the
    buffers' device); reads the buffers, writes none.

    Args:
        snapshot: The weights before the step (:func:`precision.take_snapshot` of ``groups``).
        groups: The diagnosed groups, as when the snapshot was taken.
        table: :func:`param_table` of ``groups``.
        states: Per slot, its optimizer state tensors (none: no state diagnostics).
        detail: Also compute what only attribution reads (``UPDATE_SQ``, the state slots);
            ``False`` computes the whole-model diagnostics alone.
        update_slots: The slots whose ``UPDATE_SQ`` is computed (of those whose compute dtype
            is narrower than the main dtype); ``None``: all of them.

    Raises:
        ValueError: ``groups`` does not match the snapshot, or ``states`` the table.
    """
    segments = _segments(snapshot, groups, table, states if detail else None)
    device = segments[0].main.device if segments else torch.device("cpu")
    rows = _Rows(len(segments), device)
    with torch.no_grad():
        # Pre-pass, one copy to the host: L2 norms of the main weights (also the refresh error's
        # denominator), max |x| of compute weights and grads, min/max of state tensors.
        mains = [s.main for s in segments]
        main_l2 = torch._foreach_norm(mains) if mains else []
        probes: list[torch.Tensor] = [n.float().reshape(1) for n in main_l2]
        # A finite main weight casts to a finite compute weight when max |main| <= the dtype's
        # max; ||main||_2 bounds max |main|, which settles it for bf16 (fp32's range) without a
        # pass; narrower dtypes (fp16) read max |main| itself.
        narrow = [s.derived_dtype is not None and s.compute is None
                  and torch.finfo(s.derived_dtype).max < precision._WIDE_RANGE for s in segments]  # fmt: skip
        plan: list[tuple[str, int, int]] = []  # (what, segment, state index) per probe after the norms
        # State tensors: the second moment by its min/max (is some element 0?), the others by
        # one fused L2 norm (finite unless they hold NaN/Inf).
        normed: list[tuple[int, int]] = []
        normed_tensors: list[torch.Tensor] = []
        for i, s in enumerate(segments):
            if s.compute is not None:
                plan.append(("compute", i, 0))
                probes.append(precision._abs_max(s.compute).reshape(1))
            elif narrow[i]:
                plan.append(("main_max", i, 0))
                probes.append(precision._abs_max(s.main).reshape(1))
            if s.grad is not None and s.grad.numel():
                plan.append(("grad", i, 0))
                probes.append(precision._abs_max(s.grad).reshape(1))
            for state in s.states:
                if not state.local.numel() or state.shows_in_weight:
                    continue
                if state.key == SECOND_MOMENT_KEY:
                    plan.append(("state", i, state.index))
                    probes.append(torch.stack(torch.aminmax(state.local)).float())
                else:
                    normed.append((i, state.index))
                    normed_tensors.append(state.local)
        if normed_tensors:
            probes.append(torch.stack([n.float() for n in torch._foreach_norm(normed_tensors)]))
        host = torch.cat(probes).tolist() if probes else []
        l2 = host[: len(main_l2)]
        found: dict[tuple[str, int, int], Any] = {}
        cursor = len(main_l2)
        for key in plan:
            width = 2 if key[0] == "state" else 1
            found[key] = host[cursor] if width == 1 else host[cursor : cursor + 2]
            cursor += width
        for (i, index), norm in zip(normed, host[cursor:], strict=True):
            found[("state", i, index)] = [norm, norm]  # finite iff every element is: no NaN/Inf

        chunk = precision.CHUNK_ELEMENTS
        for i, s in enumerate(segments):
            r = rows.host[i]
            r[NUMEL] = float(s.slot.length)
            main_ok = math.isfinite(l2[i])
            if s.compute is not None:
                healthy = main_ok and math.isfinite(found[("compute", i, 0)])
            elif s.derived_dtype is not None:
                bound = found[("main_max", i, 0)] if narrow[i] else l2[i]
                healthy = main_ok and bound <= torch.finfo(s.derived_dtype).max
            else:
                healthy = main_ok
            if healthy:  # else the chunks sum it over the elements finite in both
                r[MAIN_SQ] = float(l2[i]) ** 2
            grad_max = found.get(("grad", i, 0))
            if grad_max is not None and s.grad is not None:  # the plan reads a grad only where there is one
                r[GRAD_AMAX] = grad_max if math.isfinite(grad_max) else precision.GRAD_AMAX_NONFINITE
                if not math.isfinite(grad_max):
                    _count_nonfinite(rows, i, s.grad, GRAD_NAN, GRAD_INF)
            update = detail and s.slot.lossy and (update_slots is None or i in update_slots)
            for start in range(0, s.slot.length, chunk):
                length = min(chunk, s.slot.length - start)
                _weight_chunk(rows, i, _narrow(s.main, start, length), _narrow(s.before, start, length),
                              _narrow(s.compute, start, length), _narrow(s.compute_before, start, length),
                              s.derived_dtype, healthy, update)  # fmt: skip
            for state in s.states:
                if state.shows_in_weight:
                    if not main_ok and state.local.numel():
                        _count_nonfinite(rows, i, state.local, STATE_NAN + 2 * state.index, STATE_INF + 2 * state.index)
                    continue
                low_high = found.get(("state", i, state.index))
                if low_high is None:
                    continue
                low, high = low_high
                if not (math.isfinite(low) and math.isfinite(high)):
                    _count_nonfinite(rows, i, state.local, STATE_NAN + 2 * state.index, STATE_INF + 2 * state.index)
                if (state.key == SECOND_MOMENT_KEY and low <= 0.0 <= high and s.grad is not None
                        and s.grad.numel() == state.local.numel()):  # fmt: skip
                    numel = state.local.numel()
                    for start in range(0, numel, chunk):
                        length = min(chunk, numel - start)
                        zero = torch.logical_not(
                            state.local.narrow(0, start, length), out=_masks.get("mask", s.main, length)
                        )
                        moving = _masks.get("mask2", s.main, length).copy_(s.grad.narrow(0, start, length))
                        rows.add(i, STATE_FLUSHED, _count_true(torch.logical_and(zero, moving, out=zero)))
        return rows.matrix()


def slot_count(groups: Sequence[Any], per_parameter: bool = True) -> int:
    """The number of slots :func:`param_table` gives ``groups``, read from their sizes alone (so
    that a rank whose table could not be built still joins the collective with rows of that shape)."""
    count = 0
    for group in groups:
        if hasattr(group, "main_weights"):
            count += len(group.main_weights)
        else:
            layout = getattr(group, "layout", None)
            count += 1 if layout is None or not per_parameter else len(layout.params)
    return count


def payload(rows: torch.Tensor) -> torch.Tensor:
    """What a rank contributes to the collective: its rows and a status row (1: computed)."""
    status = torch.zeros((1, ROW), dtype=torch.float64, device=rows.device)
    status[0, 0] = 1.0
    return torch.cat([rows, status])


def failed_payload(count: int, device: torch.device) -> torch.Tensor:
    """A payload of ``count`` rows that marks this rank's contribution as unknown (NaN), so that
    the rank still joins the collective with the shape the others send."""
    return torch.full((count + 1, ROW), math.nan, dtype=torch.float64, device=device)


def split_status(reduced: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """The rows of a reduced payload, and whether every rank computed its part."""
    return reduced[:-1], bool(math.isfinite(reduced[-1, 0].item()))


def totals(rows: torch.Tensor) -> torch.Tensor:
    """The whole-model stats vector of :mod:`~fsdp_patch.telemetry.diagnostics.precision` from (local or
    reduced) rows: sums, and the largest ``GRAD_AMAX``."""
    if rows.shape[0] == 0:
        return torch.zeros(_TOTALS, dtype=torch.float64, device=rows.device)
    vector = rows[:, :_TOTALS].sum(dim=0)
    vector[GRAD_AMAX] = rows[:, GRAD_AMAX].max()
    return vector


def gather_rows(local: torch.Tensor, process_group: Any) -> torch.Tensor:
    """Every rank's rows, ``(world, P, ROW)``, with one all-gather (``(1, P, ROW)`` alone).

    Every rank of ``process_group`` must call this on the same steps with rows of one shape.
    """
    import torch.distributed as dist

    if process_group is None or not (dist.is_available() and dist.is_initialized()):
        return local.unsqueeze(0)
    world = dist.get_world_size(process_group)
    if world == 1:
        return local.unsqueeze(0)
    # Flat output (the concatenation form): gloo rejects the stacked form.
    flat = torch.empty(world * local.numel(), dtype=local.dtype, device=local.device)
    all_gather_flat(flat, local.contiguous().view(-1), group=process_group)
    return flat.view(world, *local.shape)


def reduce_gathered(gathered: torch.Tensor) -> torch.Tensor:
    """The global rows from :func:`gather_rows`: sums over ranks, the largest ``GRAD_AMAX``."""
    reduced = gathered.sum(dim=0)
    if gathered.shape[1]:
        reduced[:, GRAD_AMAX] = gathered[:, :, GRAD_AMAX].amax(dim=0)
    return reduced
