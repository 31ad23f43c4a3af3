"""The whole-model precision diagnostics of one optimizer step, reduced over every rank.

No OpenTelemetry here: this module turns numbers into :class:`PrecisionStats`,
:mod:`fsdp_patch.telemetry.instrumentation.observer` records them. The numbers are the sums of the
per-parameter rows of :mod:`~fsdp_patch.telemetry.diagnostics.param_stats` (here one row per flat
buffer or tensor when the attribution is off), so every number is computed once. Every rank
contributes its rows to a single all-gather and reduces them locally, so the results are global
and identical on every rank.

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
* ``grad_amax``: largest ``|main_grad|`` (``0`` without grads); where a grad element is NaN or
  Inf, :data:`~fsdp_patch.telemetry.diagnostics.rows.GRAD_AMAX_NONFINITE`.

Non-finite elements are left out of the two norms because gauges reject NaN and Inf; they are
counted by ``nonfinite`` and ``overflow`` instead, and the norms keep their meaning (the
rounding error of the refresh).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .. import semconv
from . import param_stats, replicas, rows
from .groups import PrecisionSnapshot


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


_TENSOR_SLOTS = {
    semconv.TENSOR_MAIN_GRAD: (rows.GRAD_NAN, rows.GRAD_INF),
    semconv.TENSOR_MAIN_WEIGHT: (rows.MAIN_NAN, rows.MAIN_INF),
    semconv.TENSOR_COMPUTE_WEIGHT: (rows.COMPUTE_NAN, rows.COMPUTE_INF),
}
_COUNT_SLOTS = (*range(rows.GRAD_NAN, rows.DIFF_SQ), rows.CHANGED, rows.LOST)


def stats_from_values(v: Sequence[float]) -> PrecisionStats:
    """:class:`PrecisionStats` of a whole-model vector (or a row's first
    :data:`~.rows.WHOLE_MODEL_SLOTS` values), already on the host."""
    # Counts are finite unless a rank sent a failed payload because its computation failed.
    complete = all(math.isfinite(v[i]) for i in _COUNT_SLOTS)

    def count(i: int) -> int:
        return int(v[i]) if math.isfinite(v[i]) else 0

    main_sq, diff_sq = v[rows.MAIN_SQ], v[rows.DIFF_SQ]
    # Both sums cover finite elements only; they can still overflow fp32 for absurd weights,
    # which then shows as inf (and is not recorded by a gauge).
    refresh_error = math.sqrt(diff_sq / main_sq) if main_sq > 0 else 0.0
    changed, lost = count(rows.CHANGED), count(rows.LOST)
    nonfinite = {
        (tensor, kind): count(slot)
        for tensor, pair in _TENSOR_SLOTS.items()
        for kind, slot in zip((semconv.NONFINITE_NAN, semconv.NONFINITE_INF), pair, strict=True)
    }
    return PrecisionStats(
        nonfinite=nonfinite,
        overflow=count(rows.OVERFLOW),
        underflow=count(rows.UNDERFLOW),
        refresh_error=refresh_error,
        lost_ratio=lost / changed if changed else 0.0,
        grad_amax=v[rows.GRAD_AMAX],
        changed=changed,
        lost=lost,
        complete=complete,
    )


def stats_from_vector(vector: torch.Tensor) -> PrecisionStats:
    """Turn a reduced stats vector into :class:`PrecisionStats` (one device-to-host copy)."""
    return stats_from_values(vector.tolist())


def local_stats(snapshot: PrecisionSnapshot, groups: Sequence[Any]) -> torch.Tensor:
    """This rank's whole-model vector (float64, on the buffers' device); reads the buffers,
    writes none: the sums of :func:`~.param_stats.local_rows` over one slot per flat buffer or tensor.

    Raises:
        ValueError: ``groups`` does not match the snapshot.
    """
    table = rows.param_table(groups, snapshot.default_compute_dtype, per_parameter=False)
    return rows.totals(param_stats.local_rows(snapshot, groups, table, detail=False))


def compute_stats(snapshot: PrecisionSnapshot, groups: Sequence[Any]) -> PrecisionStats:
    """Local diagnostics, reduced across the first group's process group (and the TP ranks, and
    the largest over HSDP's replicas).

    Every rank of that group must call this on the same steps (it runs a collective).
    """
    table = rows.param_table(groups, snapshot.default_compute_dtype, per_parameter=False)
    local = rows.payload(param_stats.local_rows(snapshot, groups, table, detail=False))
    combined = replicas.reduce_payload(local, table, groups)
    return stats_from_vector(rows.totals(rows.split_status(combined.reduced)[0]))
