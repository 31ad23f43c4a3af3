"""Counting the reads of a tensor's values into Python: on a GPU each is a device-to-host
synchronization (``item``, ``tolist``, ``bool``, ``nonzero``, ...), which stops the host from
running ahead of the device.

On a CPU every tensor is on the host, so the count treats every tensor as a device tensor except
the host copies telemetry reads on purpose (:func:`fsdp_patch.telemetry.diagnostics.host_copies.is_host_copy`):
what a GPU run would synchronize on is what this counts.
"""

from __future__ import annotations

import traceback
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

# What makes a tensor's values Python values (or needs them on the host to size its result).
READS = frozenset(
    {
        "item",
        "tolist",
        "numpy",
        "__bool__",
        "__int__",
        "__float__",
        "__index__",
        "__len__",
        "is_nonzero",
        "nonzero",
        "argwhere",
        "masked_select",
        "unique",
        "equal",
        "allclose",
        "cpu",
    }
)
TORCH_DIR = "/torch/"


def _site() -> str:
    """The innermost frame outside torch that made the read (torch's own code, such as an
    optimizer reading its step count, is named by the code that called into it)."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if TORCH_DIR not in frame.filename and not frame.filename.endswith("host_reads.py"):
            return (
                f"{frame.filename.rsplit('/', 2)[-2]}/{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno} {frame.name}"
            )
    return "?"


class HostReads(TorchFunctionMode):
    """Records ``(read, site)`` for each read of a tensor that is not a host copy: a script's own
    reads too (``loss.item()``, an optimizer's step count), so compare runs with telemetry on and
    off by :func:`by_read`."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[tuple[str, str]] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in READS and args and isinstance(args[0], torch.Tensor):
            from fsdp_patch.telemetry.diagnostics.host_copies import is_host_copy

            if not is_host_copy(args[0]):
                self.reads.append((name, _site()))
        return func(*args, **(kwargs or {}))


def by_read(reads: list[tuple[str, str]]) -> dict[str, int]:
    """How many of each read (the site left out: with telemetry off a script's reads come from
    other frames than with it on)."""
    counts: dict[str, int] = {}
    for name, _ in reads:
        counts[name] = counts.get(name, 0) + 1
    return counts
