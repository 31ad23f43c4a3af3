"""Precision diagnostics of the weights and grads an optimizer step touches.

No OpenTelemetry here: this module computes numbers, :mod:`fsdp_patch.telemetry.observer` records
them. Two kinds of groups are read:

* ``fsdp_patch``'s parameter groups (:class:`PrecisionView`): flat shard buffers of main weights,
  a materialized compute copy, and main grads;
* torch FSDP2's parameter groups (:class:`TensorListView`): lists of local shards, whose compute
  weights are what FSDP2 will cast them to at its next all-gather (``compute_dtype``); that cast
  is done here, per tensor, exactly as FSDP2 does it (``Tensor.to``).

All work is whole-tensor operations (fused ``torch._foreach_norm`` over the tensor lists, then a
few passes per tensor, in chunks of at most :data:`CHUNK_ELEMENTS`); never a loop over elements.
A first fused pass of norms tells, with one device-to-host copy, which tensors hold a NaN or an
Inf; only those pay for counting them. Every rank contributes one small stats vector to a single
all-gather and then reduces it locally, so the results are global and identical on every rank.

Definitions follow docs/conventions.md:

* ``nonfinite``: NaN and Inf elements, counted separately, of ``main_grad``, ``main_weight``
  and ``compute_weight``.
* ``overflow``: finite in the main weight, infinite in the (refreshed) compute weight.
* ``underflow``: non-zero in the main weight, zero in the compute weight.
* ``refresh_error``: ``||compute - main||_2 / ||main||_2`` after the refresh, over the
  elements finite in both (``0`` when there are none or ``||main||`` is 0).
* ``lost_ratio``: among elements whose main weight changed in this step, the fraction
  whose compute weight did not change (``0`` when none changed). "Changed" compares the
  stored bits, so a NaN that stays NaN is unchanged and ``-0.0 -> 0.0`` is a change.
* ``grad_amax``: largest ``|main_grad|`` (``0`` without grads). When a grad element is NaN or
  Inf there is no finite largest value, and OpenTelemetry gauges take finite numbers only: the
  value is then :data:`GRAD_AMAX_NONFINITE` (float32's largest finite number), off the scale of
  any real gradient, so that NaN grads never read as vanishing ones.

Non-finite elements are left out of the two norms because gauges reject NaN and Inf; they are
counted by ``nonfinite`` and ``overflow`` instead, and the norms keep their meaning (the
rounding error of the refresh).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from fsdp_patch.torch_compat import all_gather_flat, foreach_clone

from . import semconv

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

# Elements per pass: the reused work buffers (an fp32 difference, two compute-dtype casts, two
# bool masks: about 10 bytes per element) stay at about 10 MiB however large a shard is.
CHUNK_ELEMENTS = 1 << 20

TENSOR_NAMES = semconv.TENSORS
NONFINITE_KINDS = semconv.NONFINITE_KINDS

# Compute dtypes whose largest value is at least this have (about) fp32's range.
_WIDE_RANGE = 1e38

GRAD_AMAX_NONFINITE = float(torch.finfo(torch.float32).max)
"""``grad_amax`` when some grad element is NaN or Inf (see the module docstring)."""

# Layout of the stats vector exchanged between ranks. Everything but GRAD_AMAX is summed.
_GRAD_NAN, _GRAD_INF, _MAIN_NAN, _MAIN_INF, _COMPUTE_NAN, _COMPUTE_INF = range(6)
_OVERFLOW, _UNDERFLOW, _DIFF_SQ, _MAIN_SQ, _CHANGED, _LOST, _GRAD_AMAX = range(6, 13)
_STATS_LEN = 13

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@runtime_checkable
class PrecisionView(Protocol):
    """A group of flat buffers; ``fsdp_patch``'s ``ParameterGroup`` satisfies it.

    Attributes:
        main_weight: 1-D flat shard buffer in the main dtype (fp32). Padding is zero and stays zero.
        compute_weight: 1-D flat buffer in the compute dtype, same layout and numel; may be the
            same tensor object as ``main_weight`` when the dtypes are equal. A group whose
            ``compute_per_gather`` is true keeps none between all-gathers: the diagnostics
            then derive it by casting ``main_weight``, as each all-gather does.
        main_grad: 1-D flat buffer in the main-grad dtype, same numel; ``None`` for frozen groups.
        process_group: Group the shards are split over; ``None`` when not distributed.
    """

    main_weight: torch.Tensor
    compute_weight: torch.Tensor
    main_grad: torch.Tensor | None
    process_group: ProcessGroup | None


@runtime_checkable
class TensorListView(Protocol):
    """A group of per-parameter shards; ``fsdp_patch.fsdp2.FSDP2Group`` (torch FSDP2) satisfies it.

    Attributes:
        main_weights: This rank's shards, which the optimizer updates.
        main_grads: This rank's grad shards (of the parameters that have one).
        compute_dtype: The dtype the shards are cast to for compute (FSDP2's
            ``MixedPrecisionPolicy.param_dtype``); ``None``: no cast, or not known.
        process_group: Group the shards are split over.
    """

    main_weights: Sequence[torch.Tensor]
    main_grads: Sequence[torch.Tensor]
    compute_dtype: torch.dtype | None
    process_group: ProcessGroup | None


@dataclass(frozen=True)
class _Weights:
    """What the diagnostics read of one group, whichever its kind.

    ``computes`` are materialized compute weights, one per main weight; ``None`` means they are
    derived by casting each main weight to ``compute_dtype``, or, when that is ``None`` too,
    that the compute weight is the main weight.
    """

    mains: tuple[torch.Tensor, ...]
    computes: tuple[torch.Tensor, ...] | None
    compute_dtype: torch.dtype | None
    grads: tuple[torch.Tensor, ...]


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1)


def _weights_of(group: Any, default_compute_dtype: torch.dtype | None) -> _Weights:
    if hasattr(group, "main_weights"):
        mains = tuple(_flat(t) for t in group.main_weights)
        dtype = group.compute_dtype or default_compute_dtype
        if mains and dtype == mains[0].dtype:
            dtype = None
        return _Weights(mains, None, dtype, tuple(_flat(g) for g in group.main_grads))
    main = _flat(group.main_weight)
    grads = () if group.main_grad is None else (_flat(group.main_grad),)
    if getattr(group, "compute_per_gather", False):
        # No copy is kept: every all-gather casts exactly this.
        return _Weights((main,), None, group.compute_weight.dtype, grads)
    shared = group.compute_weight is group.main_weight
    computes = None if shared else (_flat(group.compute_weight),)
    if not shared and computes[0].numel() != main.numel():
        raise ValueError(
            f"precision diagnostics need equal numel: main_weight {main.numel()}, compute_weight {computes[0].numel()}"
        )
    if grads and grads[0].numel() != main.numel():
        raise ValueError(f"main_grad numel {grads[0].numel()} differs from main_weight numel {main.numel()}")
    return _Weights((main,), computes, None, grads)


@dataclass(frozen=True)
class PrecisionSnapshot:
    """Copies of the weights taken before the inner optimizer step.

    Attributes:
        main_weights: Per group, a clone of each main weight.
        compute_weights: Per group, a clone of each materialized compute weight; ``None`` where
            the compute weights are derived from the main weights (or are the main weights).
        default_compute_dtype: Compute dtype of tensor-list groups that name none.
    """

    main_weights: tuple[tuple[torch.Tensor, ...], ...]
    compute_weights: tuple[tuple[torch.Tensor, ...] | None, ...]
    default_compute_dtype: torch.dtype | None = None


def _same_layout(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and x.dtype == y.dtype and x.device == y.device
                                    for x, y in zip(a, b))  # fmt: skip


def take_snapshot(
    groups: Sequence[Any],
    default_compute_dtype: torch.dtype | None = None,
    reuse: PrecisionSnapshot | None = None,
) -> PrecisionSnapshot:
    """Copy the weights the lost-update ratio compares against.

    Args:
        groups: :class:`PrecisionView` or :class:`TensorListView` groups, in the order later
            passed to :func:`local_stats`.
        default_compute_dtype: Compute dtype for tensor-list groups whose ``compute_dtype`` is
            ``None`` (given by the user, for example when the model runs under autocast).
        reuse: An earlier snapshot whose buffers are overwritten where the layout is unchanged
            (diagnostics every step: a new copy of the shards each step would fault in fresh
            pages every time, which costs more than the copy).

    Returns:
        The snapshot; it costs one extra copy of each local weight shard until released.
    """
    weights = [_weights_of(g, default_compute_dtype) for g in groups]

    def copies(now: Sequence[torch.Tensor], old: Sequence[torch.Tensor] | None) -> tuple[torch.Tensor, ...]:
        if not now:
            return ()
        if old is not None and _same_layout(now, old):
            torch._foreach_copy_(list(old), list(now))
            return tuple(old)
        return tuple(foreach_clone(now))

    old_mains = reuse.main_weights if reuse is not None and len(reuse.main_weights) == len(weights) else None
    old_computes = reuse.compute_weights if old_mains is not None else None
    mains = tuple(copies(w.mains, old_mains[i] if old_mains else None) for i, w in enumerate(weights))
    computes = tuple(
        None if w.computes is None else copies(w.computes, old_computes[i] if old_computes else None)
        for i, w in enumerate(weights)
    )
    return PrecisionSnapshot(mains, computes, default_compute_dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    # Compare stored bit patterns, so NaN == NaN and no float rounding is involved.
    return t.view(_INT_VIEW[t.element_size()])


def _chunks(numel: int) -> range:
    return range(0, numel, CHUNK_ELEMENTS)


class _Scratch:
    """Chunk-sized work buffers, kept across diagnostic steps.

    Fresh temporaries of a whole shard cost more than the arithmetic on a CPU (every new page
    is faulted in and zeroed); buffers of at most :data:`CHUNK_ELEMENTS` elements, reused, keep
    the passes memory-bound and the extra memory bounded (about 9 bytes per chunk element).
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.device, torch.dtype], torch.Tensor] = {}

    def get(self, role: str, like: torch.Tensor, dtype: torch.dtype, numel: int) -> torch.Tensor:
        key = (role, like.device, dtype)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = self._buffers[key] = torch.empty(max(numel, CHUNK_ELEMENTS), dtype=dtype, device=like.device)
        return buffer[:numel]


_scratch = _Scratch()


class _Accumulator:
    """Device-side sums of the stats slots; read back once, by the caller."""

    def __init__(self, device: torch.device) -> None:
        self.parts: dict[int, list[torch.Tensor]] = {}
        self.device = device

    def add(self, slot: int, value: torch.Tensor) -> None:
        self.parts.setdefault(slot, []).append(value.reshape(()))

    def vector(self, grad_amax: float) -> torch.Tensor:
        stats = torch.zeros(_STATS_LEN, dtype=torch.float64, device=self.device)
        for slot, values in self.parts.items():
            stats[slot] = torch.stack([v.to(self.device, torch.float64) for v in values]).sum()
        stats[_GRAD_AMAX] = grad_amax
        return stats


def _count(mask: torch.Tensor) -> torch.Tensor:
    # count_nonzero, not .sum(): summing a bool tensor is several times slower on the CPU.
    return torch.count_nonzero(mask)


def _count_nonfinite(acc: _Accumulator, t: torch.Tensor, nan_slot: int, inf_slot: int) -> None:
    acc.add(nan_slot, _count(torch.isnan(t)))
    acc.add(inf_slot, _count(torch.isinf(t)))


def _abs_max(t: torch.Tensor) -> torch.Tensor:
    """``max |t|`` (NaN when ``t`` has a NaN) in one fused min/max pass, as float32."""
    if t.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=t.device)
    low, high = torch.aminmax(t)
    return torch.maximum(low.float().neg(), high.float())


def _weight_chunk(
    acc: _Accumulator,
    m: torch.Tensor,
    mb: torch.Tensor,
    compute: torch.Tensor | None,
    compute_before: torch.Tensor | None,
    compute_dtype: torch.dtype | None,
    healthy: bool,
) -> None:
    """Weight stats of one chunk of a main weight and its compute weight.

    ``healthy``: the fused pre-pass showed no NaN/Inf in the main or the compute weight and no
    overflow, so the counting passes and the finite masks are skipped. A compute weight derived
    by casting the main weight (``compute is None``, FSDP2) is a function of it, which gives two
    identities the materialized one (a refreshed buffer that might be stale) does not: zeros of
    the main weight stay zero, so underflow = nnz(main) - nnz(compute); and a compute element
    that changed had its main element change, so lost = changed(main) - changed(compute).
    """
    n = m.numel()
    mask = _scratch.get("mask", m, torch.bool, n)
    changed = _count(torch.ne(_bits(m), _bits(mb), out=mask))
    acc.add(_CHANGED, changed)
    if compute is None and compute_dtype is None:  # the compute weight is the main weight
        if not healthy:
            _count_nonfinite(acc, m, _MAIN_NAN, _MAIN_INF)
            _count_nonfinite(acc, m, _COMPUTE_NAN, _COMPUTE_INF)
            acc.add(_MAIN_SQ, torch.linalg.vector_norm(torch.where(torch.isfinite(m), m, 0.0)).double().square())
        return
    if compute is None:
        c = _scratch.get("compute", m, compute_dtype, n).copy_(m)
        cb = _scratch.get("compute_before", m, compute_dtype, n).copy_(mb)
        acc.add(_UNDERFLOW, _count(m) - _count(c))
        acc.add(_LOST, changed - _count(torch.ne(_bits(c), _bits(cb), out=mask)))
    else:
        c, cb = compute, compute_before
        kept = _scratch.get("mask2", m, torch.bool, n)
        torch.eq(_bits(c), _bits(cb), out=kept)
        acc.add(_LOST, _count(torch.logical_and(mask, kept, out=kept)))  # mask: changed(main)
        torch.eq(c, 0, out=kept)
        acc.add(_UNDERFLOW, _count(torch.logical_and(torch.ne(m, 0, out=mask), kept, out=kept)))
    diff = _scratch.get("diff", m, torch.promote_types(torch.promote_types(m.dtype, c.dtype), torch.float32), n)
    torch.sub(m, c, out=diff)
    if healthy:
        acc.add(_DIFF_SQ, torch.linalg.vector_norm(diff).double().square())
        return
    _count_nonfinite(acc, m, _MAIN_NAN, _MAIN_INF)
    _count_nonfinite(acc, c, _COMPUTE_NAN, _COMPUTE_INF)
    m_finite = torch.isfinite(m)
    acc.add(_OVERFLOW, _count(m_finite & torch.isinf(c)))
    finite = m_finite & torch.isfinite(c)
    acc.add(_DIFF_SQ, torch.linalg.vector_norm(torch.where(finite, diff, 0.0)).double().square())
    acc.add(_MAIN_SQ, torch.linalg.vector_norm(torch.where(finite, m, 0.0)).double().square())


def local_stats(snapshot: PrecisionSnapshot, groups: Sequence[Any]) -> torch.Tensor:
    """This rank's stats vector (float64, on the buffers' device); reads the buffers, writes none.

    Raises:
        ValueError: ``groups`` does not match the snapshot.
    """
    if len(groups) != len(snapshot.main_weights):
        raise ValueError(f"snapshot holds {len(snapshot.main_weights)} groups, got {len(groups)}")
    weights = [_weights_of(g, snapshot.default_compute_dtype) for g in groups]
    for w, before in zip(weights, snapshot.main_weights, strict=True):
        if len(w.mains) != len(before) or any(a.numel() != b.numel() for a, b in zip(w.mains, before)):
            raise ValueError("precision diagnostics need equal numel: the snapshot does not match the weights")
    mains = [t for w in weights for t in w.mains]
    device = mains[0].device if mains else torch.device("cpu")
    acc = _Accumulator(device)
    with torch.no_grad():
        # Fused pre-pass and one copy to the host: L2 norms of the main weights (also the
        # refresh error's denominator) and max |x| of compute weights and grads say which
        # tensors hold NaN/Inf or could overflow their compute dtype; only those are counted.
        main_l2 = [n.float() for n in torch._foreach_norm(mains)] if mains else []
        derived = [w.computes is None and w.compute_dtype is not None for w in weights]
        # A finite main weight casts to a finite compute weight when max |main| <= the dtype's
        # max; ||main||_2 bounds max |main|, which settles it for bf16 (fp32's range) without a
        # pass; narrower dtypes (fp16) read max |main| itself.
        narrow = [d and torch.finfo(w.compute_dtype).max < _WIDE_RANGE for w, d in zip(weights, derived)]
        main_max = [_abs_max(t) for w, n in zip(weights, narrow) if n for t in w.mains]
        compute_max = [_abs_max(t) for w in weights if w.computes is not None for t in w.computes]
        grads = [g for w in weights for g in w.grads if g.numel()]
        grad_max = [_abs_max(g) for g in grads]
        norms = [*main_l2, *main_max, *compute_max, *grad_max]
        host = iter(torch.stack(norms).tolist() if norms else [])
        main_l2_host = [next(host) for _ in main_l2]
        main_max_host, compute_max_host = iter([next(host) for _ in main_max]), iter([next(host) for _ in compute_max])
        grad_max_host = [next(host) for _ in grad_max]

        index = 0
        for group_index, (w, is_derived, before, computes_before) in enumerate(
            zip(weights, derived, snapshot.main_weights, snapshot.compute_weights, strict=True)
        ):
            limit = torch.finfo(w.compute_dtype).max if is_derived else math.inf
            for i, main in enumerate(w.mains):
                main_ok = math.isfinite(main_l2_host[index])
                if w.computes is not None:
                    healthy = main_ok and math.isfinite(next(compute_max_host))
                elif is_derived:
                    bound = next(main_max_host) if narrow[group_index] else main_l2_host[index]
                    healthy = main_ok and bound <= limit
                else:
                    healthy = main_ok
                if healthy:  # else the chunks sum it over the elements finite in both
                    acc.add(_MAIN_SQ, main_l2[index].double().square())
                compute = None if w.computes is None else w.computes[i]
                compute_before = None if computes_before is None else computes_before[i]
                for start in _chunks(main.numel()):
                    length = min(CHUNK_ELEMENTS, main.numel() - start)

                    def part(t: torch.Tensor | None) -> torch.Tensor | None:
                        return None if t is None else t.narrow(0, start, length)

                    _weight_chunk(acc, part(main), part(before[i]), part(compute), part(compute_before),
                                  w.compute_dtype, healthy)  # fmt: skip
                index += 1
        grad_amax = 0.0
        if grads:
            if all(math.isfinite(v) for v in grad_max_host):
                grad_amax = max(grad_max_host)
            else:
                grad_amax = GRAD_AMAX_NONFINITE
                for g, value in zip(grads, grad_max_host, strict=True):
                    if not math.isfinite(value):
                        _count_nonfinite(acc, g, _GRAD_NAN, _GRAD_INF)
        return acc.vector(grad_amax)


def nan_stats(device: torch.device) -> torch.Tensor:
    """A stats vector that marks this rank's contribution as unknown while still joining the collective."""
    return torch.full((_STATS_LEN,), math.nan, dtype=torch.float64, device=device)


def first_process_group(groups: Sequence[Any]) -> ProcessGroup | None:
    """The process group of the first group that has one, else ``None``."""
    for group in groups:
        pg = getattr(group, "process_group", None)
        if pg is not None:
            return pg
    return None


def reduce_stats(local: torch.Tensor, process_group: ProcessGroup | None) -> torch.Tensor:
    """Combine every rank's stats vector with one all-gather: sums, and a max for ``grad_amax``.

    Args:
        local: This rank's vector from :func:`local_stats`.
        process_group: Group to reduce over; ``None`` (or an uninitialized default group) means
            this rank alone.

    Returns:
        The global vector, identical on every rank.
    """
    import torch.distributed as dist

    if process_group is None or not (dist.is_available() and dist.is_initialized()):
        return local
    world = dist.get_world_size(process_group)
    if world == 1:
        return local
    # Flat output (the concatenation form): gloo rejects the stacked (world, n) form.
    flat = torch.empty(world * _STATS_LEN, dtype=local.dtype, device=local.device)
    all_gather_flat(flat, local, group=process_group)
    gathered = flat.view(world, _STATS_LEN)
    reduced = gathered.sum(dim=0)
    reduced[_GRAD_AMAX] = gathered[:, _GRAD_AMAX].max()
    return reduced


@dataclass(frozen=True)
class PrecisionStats:
    """Diagnostics of one step, reduced over all ranks.

    Attributes:
        nonfinite: Element counts keyed by ``(tensor name, "nan" | "inf")``.
        overflow: See the module docstring.
        underflow: See the module docstring.
        refresh_error: See the module docstring.
        lost_ratio: See the module docstring.
        grad_amax: See the module docstring.
        changed: Elements whose main weight changed (denominator of ``lost_ratio``).
        lost: Elements whose main weight changed but compute weight did not.
        complete: ``False`` when some rank could not compute its part (its counts were NaN);
            the other fields are then not meaningful.
    """

    nonfinite: dict[tuple[str, str], int]
    overflow: int
    underflow: int
    refresh_error: float
    lost_ratio: float
    grad_amax: float
    changed: int
    lost: int
    complete: bool = True


def stats_from_vector(vector: torch.Tensor) -> PrecisionStats:
    """Turn a reduced stats vector into :class:`PrecisionStats` (one device-to-host copy)."""
    v = vector.tolist()

    count_slots = (*range(_GRAD_NAN, _DIFF_SQ), _CHANGED, _LOST)
    # Counts are finite unless a rank sent nan_stats() because its computation failed.
    complete = all(math.isfinite(v[i]) for i in count_slots)

    def count(i: int) -> int:
        return int(v[i]) if math.isfinite(v[i]) else 0

    main_sq, diff_sq = v[_MAIN_SQ], v[_DIFF_SQ]
    # Both sums cover finite elements only; they can still overflow fp32 for absurd weights,
    # which then shows as inf (and is not recorded by a gauge).
    refresh_error = math.sqrt(diff_sq / main_sq) if main_sq > 0 else 0.0
    changed, lost = count(_CHANGED), count(_LOST)
    slots = {
        semconv.TENSOR_MAIN_GRAD: (_GRAD_NAN, _GRAD_INF),
        semconv.TENSOR_MAIN_WEIGHT: (_MAIN_NAN, _MAIN_INF),
        semconv.TENSOR_COMPUTE_WEIGHT: (_COMPUTE_NAN, _COMPUTE_INF),
    }
    nonfinite = {
        (tensor, kind): count(slot)
        for tensor, pair in slots.items()
        for kind, slot in zip((semconv.NONFINITE_NAN, semconv.NONFINITE_INF), pair)
    }
    return PrecisionStats(
        nonfinite=nonfinite,
        overflow=count(_OVERFLOW),
        underflow=count(_UNDERFLOW),
        refresh_error=refresh_error,
        lost_ratio=lost / changed if changed else 0.0,
        grad_amax=v[_GRAD_AMAX],
        changed=changed,
        lost=lost,
        complete=complete,
    )


def compute_stats(snapshot: PrecisionSnapshot, groups: Sequence[Any]) -> PrecisionStats:
    """Local diagnostics, reduced across the first group's process group.

    Every rank of that group must call this on the same steps (it runs a collective).
    """
    local = local_stats(snapshot, groups)
    return stats_from_vector(reduce_stats(local, first_process_group(groups)))
