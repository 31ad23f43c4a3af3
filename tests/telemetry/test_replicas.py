"""telemetry.diagnostics.replicas on 2 gloo ranks as 2 replicas of one shard rank each: rows
combined over replicas (the largest, never summed), where they differ, and a failed part.

The rows are made here, one row per slot as param_stats lays them out; the integration tests
(tests/integration/test_hsdp_telemetry.py) plant the same differences in HSDP training.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from fsdp_patch.telemetry.diagnostics import replicas
from fsdp_patch.telemetry.diagnostics import rows as row_spec

WORLD = 2
SLOTS = 3


def _combine(local: torch.Tensor) -> replicas.ReplicaRows:
    """``local`` as this rank's payload, on a replica of its own rank alone."""
    groups = [SimpleNamespace(replicate_group=dist.group.WORLD)]
    gathered = local.unsqueeze(0)
    return replicas.over_replicas(local, gathered, [dist.get_rank()], groups)


def _rows() -> torch.Tensor:
    rows = torch.zeros(SLOTS, row_spec.ROW, dtype=torch.float64)
    rows[:, row_spec.MAIN_SQ] = torch.tensor([4.0, 9.0, 16.0])
    rows[:, row_spec.NUMEL] = 10.0
    return rows


def replicas_on_ranks() -> dict[str, Any]:
    rank = dist.get_rank()
    found: dict[str, Any] = {}

    agree = _combine(row_spec.payload(_rows()))
    found["agree"] = (agree.divergence, agree.reduced[:-1].tolist() == _rows().tolist(), agree.ranks)

    nan_rows = _rows()
    if rank == 1:
        nan_rows[2, row_spec.MAIN_NAN] = 3.0
        nan_rows[2, row_spec.STATE_NAN] = 1.0
    nan = _combine(row_spec.payload(nan_rows))
    found["nan"] = (nan.divergence, nan.reduced[2, row_spec.MAIN_NAN].item(), nan.reduced[2, row_spec.STATE_NAN].item())

    drift_rows = _rows()
    if rank == 0:
        drift_rows[1, row_spec.MAIN_SQ] += 1e-12
    drift = _combine(row_spec.payload(drift_rows))
    found["drift"] = drift.divergence

    failed = _combine(row_spec.failed_payload(SLOTS, torch.device("cpu")) if rank == 1 else row_spec.payload(_rows()))
    found["failed"] = (failed.divergence, row_spec.split_status(failed.reduced)[1])
    return found


def test_replicas_combined_and_compared(dist_pool) -> None:
    for rank, got in enumerate(dist_pool(WORLD).run(replicas_on_ranks)):
        assert got["agree"] == (None, True, [0, 1]), (
            f"rank {rank}: replicas that agree: want no divergence, the rows as they are (not summed), "
            f"and both ranks' blocks; got {got['agree']}"
        )
        want_nan = (replicas.Divergence([2], "nonfinite", [0, 4], [0, 1]), 3.0, 1.0)
        assert got["nan"] == want_nan, f"rank {rank}: a NaN on replica 1: want {want_nan}, got {got['nan']}"
        want_drift = replicas.Divergence([1], "main_weight", [0, 0], [0, 1])
        assert got["drift"] == want_drift, (
            f"rank {rank}: finite weights that differ: want {want_drift}, got {got['drift']}"
        )
        assert got["failed"] == (None, False), (
            f"rank {rank}: a replica whose part failed: want no divergence and the step marked incomplete, "
            f"got {got['failed']}"
        )
