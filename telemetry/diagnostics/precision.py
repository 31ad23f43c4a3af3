"""Precision diagnostics of the weights and grads an optimizer step touches.

No OpenTelemetry here: this module computes numbers, :mod:`fsdp_patch.telemetry.instrumentation.observer` records
them. Two kinds of groups are read:

* ``fsdp_patch``'s parameter groups (:class:`PrecisionView`): flat shard buffers of main weights,
  a materialized compute copy, and main grads;
* torch FSDP2's parameter groups (:class:`TensorListView`): lists of local shards, whose compute
  weights are what FSDP2 will cast them to at its next all-gather (``compute_dtype``); that cast
  is done here, per tensor, exactly as FSDP2 does it (``Tensor.to``).

The passes themselves run per parameter, in :mod:`fsdp_patch.telemetry.diagnostics.param_stats` (whole-tensor
operations on each parameter's segment, in chunks of at most :data:`CHUNK_ELEMENTS`; never a loop
over elements; a first fused pass of norms tells, with one device-to-host copy, which segments
hold a NaN or an Inf, and only those pay for counting them): the whole-model vector here is the
sum of its rows. Every rank contributes its numbers to a single all-gather and reduces them
locally, so the results are global and identical on every rank.

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

from .. import semconv

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

# Elements per pass: the reused work buffers (an fp32 difference, the compute weight widened, two
# compute-dtype casts, two bool masks: about 14 bytes per element) stay at about 3.5 MiB however
# large a shard is, near a core's L2 cache, so a chunk's later passes read it from there.
CHUNK_ELEMENTS = 1 << 18

TENSOR_NAMES = semconv.TENSORS
NONFINITE_KINDS = semconv.NONFINITE_KINDS

# Compute dtypes whose largest value is at least this have (about) fp32's range.
_WIDE_RANGE = 1e38

GRAD_AMAX_NONFINITE = float(torch.finfo(torch.float32).max)
"""``grad_amax`` when some grad element is NaN or Inf (see the module docstring)."""

# Layout of the stats vector exchanged between ranks. Everything but GRAD_AMAX is summed.
# (param_stats' per-parameter rows begin with the same slots.)
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
    that the compute weight is the main weight. ``grads`` holds one grad per main weight, in
    the same layout, ``None`` where there is none.
    """

    mains: tuple[torch.Tensor, ...]
    computes: tuple[torch.Tensor, ...] | None
    compute_dtype: torch.dtype | None
    grads: tuple[torch.Tensor | None, ...]


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1)


def _aligned_grads(group: Any, mains: Sequence[torch.Tensor]) -> tuple[torch.Tensor | None, ...]:
    """One grad per main weight: ``local_grads`` where the group has them (FSDP2's, one per
    parameter), else ``main_grads`` (only the shards that have a grad) matched in order by size."""
    local = getattr(group, "local_grads", None)
    if local is not None:
        return tuple(None if g is None else _flat(g) for g in local)
    grads = [_flat(g) for g in group.main_grads]
    if len(grads) == len(mains):
        return tuple(grads)
    out: list[torch.Tensor | None] = []
    pending = iter(grads)
    grad = next(pending, None)
    for main in mains:
        if grad is not None and grad.numel() == main.numel():
            out.append(grad)
            grad = next(pending, None)
        else:
            out.append(None)
    return tuple(out)


def _weights_of(group: Any, default_compute_dtype: torch.dtype | None) -> _Weights:
    if hasattr(group, "main_weights"):
        mains = tuple(_flat(t) for t in group.main_weights)
        dtype = group.compute_dtype or default_compute_dtype
        if mains and dtype == mains[0].dtype:
            dtype = None
        return _Weights(mains, None, dtype, _aligned_grads(group, mains))
    main = _flat(group.main_weight)
    grads = (None if group.main_grad is None else _flat(group.main_grad),)
    if getattr(group, "compute_per_gather", False):
        # No copy is kept: every all-gather casts exactly this.
        return _Weights((main,), None, group.compute_weight.dtype, grads)
    computes: tuple[torch.Tensor, ...] | None = None
    if group.compute_weight is not group.main_weight:
        compute = _flat(group.compute_weight)
        if compute.numel() != main.numel():
            raise ValueError(
                f"precision diagnostics need equal numel: main_weight {main.numel()}, compute_weight {compute.numel()}"
            )
        computes = (compute,)
    if grads[0] is not None and grads[0].numel() != main.numel():
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
                                    for x, y in zip(a, b, strict=True))  # fmt: skip


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

    old_mains: tuple[tuple[torch.Tensor, ...], ...] | None = None
    old_computes: tuple[tuple[torch.Tensor, ...] | None, ...] | None = None
    if reuse is not None and len(reuse.main_weights) == len(weights):
        old_mains, old_computes = reuse.main_weights, reuse.compute_weights
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
    the passes memory-bound and the extra memory bounded (about 10 bytes per chunk element).
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


def _abs_max(t: torch.Tensor) -> torch.Tensor:
    """``max |t|`` (NaN when ``t`` has a NaN) in one fused min/max pass, as float32."""
    if t.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=t.device)
    low, high = torch.aminmax(t)
    return torch.maximum(low.float().neg(), high.float())


def local_stats(snapshot: PrecisionSnapshot, groups: Sequence[Any]) -> torch.Tensor:
    """This rank's stats vector (float64, on the buffers' device); reads the buffers, writes none.

    The sums of :func:`fsdp_patch.telemetry.diagnostics.param_stats.local_rows` over its slots (here one per
    flat buffer or tensor): the whole-model numbers are the per-parameter ones added up.

    Raises:
        ValueError: ``groups`` does not match the snapshot.
    """
    from . import param_stats

    table = param_stats.param_table(groups, snapshot.default_compute_dtype, per_parameter=False)
    return param_stats.totals(param_stats.local_rows(snapshot, groups, table, detail=False))


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
        for kind, slot in zip((semconv.NONFINITE_NAN, semconv.NONFINITE_INF), pair, strict=True)
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
