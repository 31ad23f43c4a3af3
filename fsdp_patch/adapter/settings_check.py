"""Settings that change collectives, checked across ranks once, at an optimizer's first step.

With telemetry on, the precision diagnostics add an ``all_gather`` on their steps. A rank with
telemetry off (or another diagnostics schedule, or the per-parameter detail on where its peers
have it off: a payload of another size) would skip it or send other rows while its peers wait: a
collective mismatch on gloo, a hang on NCCL. So at its first step every adapted optimizer,
telemetry on or off, gathers ``(telemetry on, diagnostics interval, per-parameter detail on,
escalation, per-iteration checks)`` from every rank of its process group in one small ``all_gather``,
and a difference
raises the same error on every rank, naming each rank's values and, in the registered observer
source's words (telemetry's), the variables they come from. A rank with telemetry off takes part
through the same call, with its ``NullObserver``'s settings: one collective of five integers per
optimizer, at its first step only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..torch_interop.torch_compat import all_gather_flat
from .observer_source import registered_source

__all__ = ["CollectiveSettingsError", "check_collective_settings", "process_group_and_device"]


class CollectiveSettingsError(RuntimeError):
    """Ranks of one optimizer disagree on settings that change collectives."""


def process_group_and_device(groups: Sequence[Any]) -> tuple[Any, torch.device] | None:
    """The process group the diagnostics would reduce over (the first group's) and a device for it."""
    for group in groups:
        pg = getattr(group, "process_group", None)
        if pg is None:
            continue
        weights = getattr(group, "main_weights", None)
        tensor = weights[0] if weights else getattr(group, "main_weight", None)
        return pg, tensor.device if tensor is not None else torch.device("cpu")
    return None


def _describe(values: list[list[int]]) -> str:
    # Only a source knows which variables these settings come from; a rank whose optimizer has
    # no observer asks it too, so every rank words the error alike.
    source = registered_source(load=True)
    if source is not None:
        return source.describe_settings(values)
    rows = ", ".join(f"rank {r} {tuple(v)}" for r, v in enumerate(values))
    return (
        "fsdp_patch: ranks of this optimizer's process group disagree on settings that change "
        f"collectives ({', '.join(SETTINGS)}): {rows}. Expected the "
        "same values on every rank."
    )


# The settings compared, in order; an observer that names fewer leaves the rest at 0 (off).
SETTINGS = ("telemetry on", "diagnostics interval", "per-parameter detail", "escalation", "per-iteration checks")


def check_collective_settings(groups: Sequence[Any], settings: Sequence[bool | int]) -> None:
    """Raise on every rank if the ranks' settings differ; a no-op without a process group.

    Args:
        groups: The FSDP groups of the optimizer (``fully_shard``'s or FSDP2's).
        settings: This rank's values of :data:`SETTINGS` (its observer's ``collective_settings``):
            whether it emits telemetry, its diagnostics interval (0: none), whether its diagnostics
            send a row per parameter, the iterations it diagnoses every step after a NaN/Inf, and
            whether its per-iteration checks run (one small all-reduce per step).

    Raises:
        CollectiveSettingsError: The settings differ on some rank; every rank raises it, with
            the same message.
    """
    import torch.distributed as dist

    found = process_group_and_device(groups)
    if found is None or not (dist.is_available() and dist.is_initialized()):
        return
    pg, device = found
    world = dist.get_world_size(pg)
    if world == 1:
        return
    padded = [int(value) for value in settings] + [0] * (len(SETTINGS) - len(settings))
    mine = torch.tensor(padded, dtype=torch.int64, device=device)
    gathered = torch.empty(world * len(padded), dtype=torch.int64, device=device)
    all_gather_flat(gathered, mine, group=pg)
    values = gathered.view(world, len(padded)).tolist()
    if any(v != values[0] for v in values):
        raise CollectiveSettingsError(_describe(values))
