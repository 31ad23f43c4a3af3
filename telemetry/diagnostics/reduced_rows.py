"""A diagnosed step's rows reduced over the ranks and read on the host, with one synchronization
on a healthy step: :func:`reduce_on_host`, which the precision recorder calls."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from . import param_stats, replicas
from . import rows as row_spec
from .host_copies import HostCopy


@dataclass
class ReducedRows:
    """A diagnosed step's rows reduced over the ranks, on the host."""

    rows: list[list[float]]
    totals: list[float]
    blocks: list[list[list[float]]]
    ranks: list[int]
    divergence: Any


def reduce_on_host(
    local: torch.Tensor,
    table: Sequence[row_spec.ParamSlot] | None,
    groups: Sequence[Any],
    first: param_stats.FirstRound | None,
) -> ReducedRows | None:
    """``local`` (this rank's payload) reduced over the ranks and read on the host; ``None`` where
    some rank's part failed.

    [Note: one synchronization per diagnosed step]
    Round 1 of the rows is reduced as it is, and one host copy reads the reduced rows, every
    rank's own rows (whose ranks name a finding) and this rank's round 1 with its probes: on a
    GPU, one wait for the device. Round 2 runs only where some rank's round 1 holds a NaN/Inf
    (the status column :data:`~..diagnostics.rows.STATUS_SECOND`, summed over the ranks, so that
    every rank decides alike): then every rank repairs its rows and the reduction runs again, a
    second collective and a second wait, on unhealthy steps alone.
    """
    combined = replicas.reduce_payload(local, table, groups)
    own = [] if first is None else first.host_tensors()
    reduced, totals, blocks, *own_host = HostCopy(
        [combined.reduced, row_spec.totals(combined.reduced[:-1]), combined.blocks, *own]
    ).tensors(wait=True)
    rows = reduced.tolist()
    if not math.isfinite(rows[-1][0]) or first is None:
        return None  # every rank sees the same reduced status, so every rank returns here
    if rows[-1][row_spec.STATUS_SECOND] > 0:
        repaired = param_stats.second_round(first, *first.read(own_host))
        combined = replicas.reduce_payload(row_spec.payload(repaired), table, groups)
        reduced, totals, blocks = HostCopy(
            [combined.reduced, row_spec.totals(combined.reduced[:-1]), combined.blocks]
        ).tensors(wait=True)
        rows = reduced.tolist()
        if not math.isfinite(rows[-1][0]):
            return None
    return ReducedRows(rows[:-1], totals.tolist(), blocks.tolist(), combined.ranks, combined.divergence)
