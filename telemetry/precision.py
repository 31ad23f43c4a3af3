"""Precision diagnostics on the flat shard buffers of mixed-precision parameter groups.

No OpenTelemetry here: this module computes numbers, :mod:`fsdp_patch.telemetry.observer` records
them. All work is whole-buffer tensor operations on the group's flat buffers, processed
in bounded chunks so temporaries stay small; never a loop over parameters. Every rank
contributes one small stats vector to a single all-gather and then reduces it locally,
so the results are global and identical on every rank.

Definitions follow the project's design page:

* ``nonfinite``: NaN and Inf elements, counted separately, of ``main_grad``,
  ``main_weight`` and ``compute_weight``.
* ``overflow``: finite in the main weight, infinite in the refreshed compute weight.
* ``underflow``: non-zero in the main weight, zero in the refreshed compute weight.
* ``refresh_error``: ``||compute - main||_2 / ||main||_2`` after the refresh, over the
  elements finite in both (``0`` when there are none or ``||main||`` is 0).
* ``lost_ratio``: among elements whose main weight changed in this step, the fraction
  whose compute weight did not change (``0`` when none changed). "Changed" compares the
  stored bits, so a NaN that stays NaN is unchanged and ``-0.0 -> 0.0`` is a change.
* ``grad_amax``: largest finite ``|main_grad|`` (``0`` when there is none).

Non-finite elements are left out of the two norms and the amax because OpenTelemetry
gauges reject NaN and Inf (the SDK drops such a measurement with a warning); they are
counted by ``nonfinite`` and ``overflow`` instead, and the remaining values keep their
meaning (the rounding error of the refresh, the gradient scale).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

# Elements per pass; bounds the temporaries (one fp32 difference plus a few bool masks)
# to a few hundred MiB however large a group's shard is.
CHUNK_ELEMENTS = 1 << 24

TENSOR_NAMES = ("main_grad", "main_weight", "compute_weight")
NONFINITE_KINDS = ("nan", "inf")

# Layout of the stats vector exchanged between ranks. Everything but GRAD_AMAX is summed.
_GRAD_NAN, _GRAD_INF, _MAIN_NAN, _MAIN_INF, _COMPUTE_NAN, _COMPUTE_INF = range(6)
_OVERFLOW, _UNDERFLOW, _DIFF_SQ, _MAIN_SQ, _CHANGED, _LOST, _GRAD_AMAX = range(6, 13)
_STATS_LEN = 13

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@runtime_checkable
class PrecisionView(Protocol):
    """What the diagnostics read from one parameter group; ``fsdp_patch``'s ``ParameterGroup`` satisfies it.

    Attributes:
        main_weight: 1-D flat shard buffer in the main dtype (fp32). Padding is zero and stays zero.
        compute_weight: 1-D flat buffer in the compute dtype, same layout and numel; may be the
            same tensor object as ``main_weight`` when the dtypes are equal.
        main_grad: 1-D flat buffer in the main-grad dtype, same numel; ``None`` for frozen groups.
        process_group: Group the shards are split over; ``None`` when not distributed.
    """

    main_weight: torch.Tensor
    compute_weight: torch.Tensor
    main_grad: torch.Tensor | None
    process_group: ProcessGroup | None


@dataclass(frozen=True)
class PrecisionSnapshot:
    """Copies of the weights taken before the inner optimizer step.

    Attributes:
        main_weights: Clone of each group's main weight.
        compute_weights: Clone of each group's compute weight, ``None`` where the group's
            compute weight is its main weight (nothing can be lost in the refresh then).
    """

    main_weights: tuple[torch.Tensor, ...]
    compute_weights: tuple[torch.Tensor | None, ...]


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


def _shares_storage(group: PrecisionView) -> bool:
    return group.compute_weight is group.main_weight


def take_snapshot(groups: Sequence[PrecisionView]) -> PrecisionSnapshot:
    """Clone the weight buffers the lost-update ratio compares against.

    Args:
        groups: Parameter groups, in the order later passed to :func:`compute_stats`.

    Returns:
        The snapshot; it costs one extra copy of each local weight shard until released.
    """
    mains = tuple(g.main_weight.detach().clone() for g in groups)
    computes = tuple(None if _shares_storage(g) else g.compute_weight.detach().clone() for g in groups)
    return PrecisionSnapshot(mains, computes)


def _bits(t: torch.Tensor) -> torch.Tensor:
    # Compare stored bit patterns, so NaN == NaN and no float rounding is involved.
    return t.view(_INT_VIEW[t.element_size()])


def _nan_inf(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.isnan(t).sum(), torch.isinf(t).sum()


def _chunks(numel: int) -> range:
    return range(0, numel, CHUNK_ELEMENTS)


def _group_stats(
    group: PrecisionView, main_before: torch.Tensor, compute_before: torch.Tensor | None
) -> torch.Tensor:
    main = group.main_weight.detach()
    compute = group.compute_weight.detach()
    grad = None if group.main_grad is None else group.main_grad.detach()
    if compute.numel() != main.numel() or main_before.numel() != main.numel():
        raise ValueError(
            f"precision diagnostics need equal numel: main_weight {main.numel()}, "
            f"compute_weight {compute.numel()}, snapshot {main_before.numel()}"
        )
    if grad is not None and grad.numel() != main.numel():
        raise ValueError(f"main_grad numel {grad.numel()} differs from main_weight numel {main.numel()}")

    device = main.device
    stats = torch.zeros(_STATS_LEN, dtype=torch.float64, device=device)
    shared = compute_before is None
    work_dtype = torch.promote_types(torch.promote_types(main.dtype, compute.dtype), torch.float32)
    for start in _chunks(main.numel()):
        length = min(CHUNK_ELEMENTS, main.numel() - start)
        m = main.narrow(0, start, length)
        m_nan, m_inf = _nan_inf(m)
        if shared:
            c_nan, c_inf = m_nan, m_inf
            overflow = underflow = lost = torch.zeros((), dtype=torch.int64, device=device)
            diff_sq = torch.zeros((), dtype=torch.float64, device=device)
            changed = (_bits(m) != _bits(main_before.narrow(0, start, length))).sum()
            finite = torch.isfinite(m)
        else:
            c = compute.narrow(0, start, length)
            c_nan, c_inf = _nan_inf(c)
            m_finite = torch.isfinite(m)
            overflow = (m_finite & torch.isinf(c)).sum()
            underflow = ((m != 0) & (c == 0)).sum()
            finite = m_finite & torch.isfinite(c)
            diff = torch.where(finite, c.to(work_dtype) - m.to(work_dtype), 0.0)
            diff_sq = torch.linalg.vector_norm(diff).double().square()
            main_changed = _bits(m) != _bits(main_before.narrow(0, start, length))
            compute_kept = _bits(c) == _bits(compute_before.narrow(0, start, length))
            changed = main_changed.sum()
            lost = (main_changed & compute_kept).sum()
        main_sq = torch.linalg.vector_norm(torch.where(finite, m.to(work_dtype), 0.0)).double().square()
        if grad is not None:
            g = grad.narrow(0, start, length)
            g_nan, g_inf = _nan_inf(g)
            g_amax = torch.nan_to_num(g.abs(), nan=0.0, posinf=0.0).amax().double()
        else:
            g_nan = g_inf = torch.zeros((), dtype=torch.int64, device=device)
            g_amax = torch.zeros((), dtype=torch.float64, device=device)
        summed = torch.stack(
            [
                t.double()
                for t in (g_nan, g_inf, m_nan, m_inf, c_nan, c_inf, overflow, underflow, diff_sq, main_sq, changed, lost)
            ]
        )
        stats[:_GRAD_AMAX] += summed
        stats[_GRAD_AMAX] = torch.maximum(stats[_GRAD_AMAX], g_amax)
    return stats


def local_stats(snapshot: PrecisionSnapshot, groups: Sequence[PrecisionView]) -> torch.Tensor:
    """This rank's stats vector (float64, on the buffers' device); reads the buffers, writes none.

    Raises:
        ValueError: ``groups`` does not match the snapshot.
    """
    if len(groups) != len(snapshot.main_weights):
        raise ValueError(f"snapshot holds {len(snapshot.main_weights)} groups, got {len(groups)}")
    device = groups[0].main_weight.device if groups else torch.device("cpu")
    total = torch.zeros(_STATS_LEN, dtype=torch.float64, device=device)
    with torch.no_grad():
        for group, main_before, compute_before in zip(
            groups, snapshot.main_weights, snapshot.compute_weights, strict=True
        ):
            if group.main_weight.numel() == 0:
                continue
            stats = _group_stats(group, main_before, compute_before).to(device)
            amax = torch.maximum(total[_GRAD_AMAX], stats[_GRAD_AMAX])
            total += stats
            total[_GRAD_AMAX] = amax
    return total


def nan_stats(device: torch.device) -> torch.Tensor:
    """A stats vector that marks this rank's contribution as unknown while still joining the collective."""
    return torch.full((_STATS_LEN,), math.nan, dtype=torch.float64, device=device)


def first_process_group(groups: Sequence[PrecisionView]) -> ProcessGroup | None:
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
    # all_gather_single replaces all_gather_into_tensor in recent torch; both are one collective.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(flat, local, group=process_group)
    gathered = flat.view(world, _STATS_LEN)
    reduced = gathered.sum(dim=0)
    reduced[_GRAD_AMAX] = gathered[:, _GRAD_AMAX].max()
    return reduced


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
    nonfinite = {
        ("main_grad", "nan"): count(_GRAD_NAN),
        ("main_grad", "inf"): count(_GRAD_INF),
        ("main_weight", "nan"): count(_MAIN_NAN),
        ("main_weight", "inf"): count(_MAIN_INF),
        ("compute_weight", "nan"): count(_COMPUTE_NAN),
        ("compute_weight", "inf"): count(_COMPUTE_INF),
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


def compute_stats(snapshot: PrecisionSnapshot, groups: Sequence[PrecisionView]) -> PrecisionStats:
    """Local diagnostics, reduced across the first group's process group.

    Every rank of that group must call this on the same steps (it runs a collective).
    """
    local = local_stats(snapshot, groups)
    return stats_from_vector(reduce_stats(local, first_process_group(groups)))
