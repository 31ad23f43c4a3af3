"""Where this process sits in the job: rank, world size, local rank and run id."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class RankInfo:
    """Identity of one training process.

    Attributes:
        rank: Global rank.
        world_size: Number of ranks in the default process group.
        local_rank: Rank on this host; offsets per-process ports.
        run_id: ``TORCHELASTIC_RUN_ID`` when torchrun started the job.
        mesh_coordinate: This rank's place on a device mesh of 2 or more dimensions
            (``replicate=1,shard=0``), once :func:`note_mesh_coordinate` was told it.
    """

    rank: int
    world_size: int
    local_rank: int
    run_id: str | None
    mesh_coordinate: str | None = None


_mesh_coordinate: str | None = None


def note_mesh_coordinate(coordinate: str | None) -> None:
    """This process's mesh coordinate, for the rank identity of providers built from now on
    (``None`` forgets it: the telemetry's uninstall). A provider's resource is fixed when it is
    built: providers built before a model was sharded do not carry it."""
    global _mesh_coordinate
    _mesh_coordinate = coordinate


def distributed_rank() -> tuple[int, int]:
    """Rank and world size of the default process group, ``(0, 1)`` when it is not initialized."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _env_int(name: str, default: int) -> int:
    # torchrun's variables are not ours to validate; a malformed one only costs a label.
    try:
        return int(os.environ.get(name, ""))
    except ValueError:
        return default


def known_rank_info() -> RankInfo | None:
    """The rank identity where it is known without importing torch, else ``None``.

    Known once ``torch.distributed`` (already imported) has a default group, or where torchrun set
    ``RANK`` in the environment before the process started; an SDK configured at interpreter
    start (``opentelemetry-instrument``) asks before any import of torch.
    """
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return _rank_info(dist.get_rank(), dist.get_world_size())
    if "RANK" in os.environ:
        return _rank_info(_env_int("RANK", 0), _env_int("WORLD_SIZE", 1))
    return None


def current_rank_info() -> RankInfo:
    """Rank identity from ``torch.distributed`` when initialized, else torchrun's environment.

    The environment fallback matters because providers may be built before
    ``init_process_group`` and their resource cannot change afterwards.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return _rank_info(dist.get_rank(), dist.get_world_size())
    return _rank_info(_env_int("RANK", 0), _env_int("WORLD_SIZE", 1))


def _rank_info(rank: int, world_size: int) -> RankInfo:
    run_id = os.environ.get("TORCHELASTIC_RUN_ID") or None
    return RankInfo(rank, world_size, _env_int("LOCAL_RANK", 0), run_id, _mesh_coordinate)
