"""HSDP's replicas in the precision diagnostics: counted once, compared, and named where they differ.

Under HSDP each replica (a row of the ``(replicate, shard)`` mesh) holds the whole model, sharded
over its ranks, and every replica holds the same values: the all-reduce over the replicate
dimension gives the grads the same values on each, and the same optimizer steps them alike. The
rows :func:`~.rows.reduce_gathered` makes over one replica's ranks therefore count the model's
elements once; :func:`over_replicas` gathers them over the replicate group (one all-gather, on
the diagnosed steps of an HSDP model only), so that

* the rows every rank records are the largest over the replicas: the same rows where replicas
  agree (counted once, not summed), and where they do not, a NaN on one replica is counted on
  every rank, not only on that replica's;
* the parameters whose rows differ between replicas are found. Compared: the non-finite counts,
  and the main weights' squared norm, which replicas holding equal weights compute bitwise
  equal (the same elements at the same shard positions, summed over the shard ranks in the same
  order). Replicas that differ have silently diverged: something wrote some replicas' weights
  and not the others' (a load or edit on some ranks only), or one node computes wrongly.

Each rank's own rows travel too, so that a finding names the ranks of every replica where it
was seen, not only those of this rank's replica.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .. import semconv
from . import rows as row_spec
from .groups import first_process_group

NONFINITE_COLUMNS = (
    row_spec.GRAD_NAN,
    row_spec.GRAD_INF,
    row_spec.MAIN_NAN,
    row_spec.MAIN_INF,
    row_spec.COMPUTE_NAN,
    row_spec.COMPUTE_INF,
    *range(row_spec.STATE_NAN, row_spec.STATE_END),
)
"""Row columns that count NaN/Inf elements: main grads, main and compute weights, optimizer state."""

DIFF_NONFINITE = semconv.REPLICA_DIFF_NONFINITE
"""Replicas hold different numbers of NaN/Inf elements of some parameter."""
DIFF_MAIN_WEIGHT = semconv.REPLICA_DIFF_MAIN_WEIGHT
"""Replicas' non-finite counts agree and some parameter's main weights differ (their norms do)."""


@dataclass(frozen=True)
class Divergence:
    """Where the replicas' rows differ, at one diagnosed step.

    Attributes:
        slots: The rows (table slots) that differ, in table order.
        diff: :data:`DIFF_NONFINITE` or :data:`DIFF_MAIN_WEIGHT`.
        nonfinite: Per replica, in replica order: NaN/Inf elements of those slots.
        peers: Per replica: the global rank that holds this rank's shard there (this rank among
            them): the replicate group's ranks.
    """

    slots: list[int]
    diff: str
    nonfinite: list[int]
    peers: list[int]


@dataclass
class ReplicaRows:
    """A step's payload rows combined over the replicas, and every rank's own.

    Attributes:
        reduced: The reduced payload (its rows and status row), the largest over the replicas.
        blocks: Each rank's own payload, ``(ranks, slots + 1, ROW)``: this replica's ranks, or
            every replica's under HSDP.
        ranks: The global rank of each of :attr:`blocks`.
        divergence: Where the replicas differ; ``None`` where they agree, without replicas, or
            where some rank's part failed.
    """

    reduced: torch.Tensor
    blocks: torch.Tensor
    ranks: list[int]
    divergence: Divergence | None


def replicate_group(groups: Sequence[Any]) -> Any:
    """The replicate process group of the first group that has one (HSDP), else ``None``."""
    for group in groups:
        found = getattr(group, "replicate_group", None)
        if found is not None:
            return found
    return None


def reduce_payload(local: torch.Tensor, table: Sequence[Any] | None, groups: Sequence[Any]) -> ReplicaRows:
    """This rank's payload (:func:`~.rows.payload`) reduced over the whole mesh: over the ranks
    that shard the groups (:func:`~.rows.reduce_gathered`), combined over the TP ranks
    (:func:`~.rows.combine_over_tensor_parallel`, by ``table``'s split slots) and over HSDP's
    replicas (:func:`over_replicas`). Every rank of the mesh must call this on the same steps."""
    process_group = first_process_group(groups)
    gathered = row_spec.gather_rows(local, process_group)
    reduced = row_spec.combine_over_tensor_parallel(row_spec.reduce_gathered(gathered), table, groups)
    return over_replicas(reduced, gathered, row_spec.gathered_ranks(process_group), groups)


def over_replicas(
    reduced: torch.Tensor, gathered: torch.Tensor, ranks: list[int], groups: Sequence[Any]
) -> ReplicaRows:
    """``reduced`` (one replica's payload, reduced over its ranks and combined over tensor
    parallelism) and ``gathered`` (its ranks' own payloads, of global ranks ``ranks``), combined
    over the replicas of ``groups``.

    Every rank of the replicate group must call this on the same steps (it runs a collective
    where there are several replicas); the rows as they are without.
    """
    process_group = replicate_group(groups)
    if process_group is None:
        return ReplicaRows(reduced, gathered, ranks, None)
    every = row_spec.gather_rows(torch.cat([reduced.unsqueeze(0), gathered]), process_group)
    if every.shape[0] == 1:
        return ReplicaRows(reduced, gathered, ranks, None)
    per_replica, blocks = every[:, 0], every[:, 1:]
    peers = row_spec.gathered_ranks(process_group)
    # Each replica's ranks, in the order of its blocks: the status row carries its own rank.
    every_rank = [
        _rank_of(block, fallback) for replica, fallback in zip(blocks, peers, strict=True) for block in replica
    ]
    combined = per_replica.amax(dim=0)  # a failed part (NaN) stays NaN: amax propagates it
    complete = all(math.isfinite(v) for v in per_replica[:, -1, 0].tolist())
    divergence = _divergence(per_replica[:, :-1], peers) if complete else None
    return ReplicaRows(combined, blocks.flatten(0, 1), every_rank, divergence)


def _rank_of(block: torch.Tensor, fallback: int) -> int:
    value = block[-1, row_spec.STATUS_RANK].item()
    return int(value) if math.isfinite(value) else fallback


def _divergence(per_replica: torch.Tensor, peers: list[int]) -> Divergence | None:
    """Where ``per_replica`` (``(replicas, slots, ROW)``) differ between replicas, if anywhere."""
    if per_replica.shape[1] == 0:
        return None
    counts = per_replica[:, :, list(NONFINITE_COLUMNS)]
    nonfinite = (counts != counts[:1]).any(dim=2).any(dim=0)
    norms = per_replica[:, :, row_spec.MAIN_SQ]
    weights = (norms != norms[:1]).any(dim=0)
    if bool(nonfinite.any()):
        differ, diff = nonfinite, DIFF_NONFINITE
    elif bool(weights.any()):
        differ, diff = weights, DIFF_MAIN_WEIGHT
    else:
        return None
    slots = [int(i) for i in differ.nonzero().flatten().tolist()]
    totals = counts[:, slots].sum(dim=(1, 2)).tolist()
    return Divergence(slots, diff, [int(t) for t in totals], list(peers))
