"""Where a newly adapted optimizer gets its observer: the seam telemetry registers into.

The adapter knows nothing of telemetry. An :class:`ObserverSource` registered here decides,
per adapted optimizer, whether it reports to an observer or to nobody (a ``NullObserver``),
and words the cross-rank settings error whose settings it owns.
``fsdp_patch.telemetry`` registers one when it is imported; with ``FSDP_PATCH_TELEMETRY`` set
and no source registered yet, :func:`registered_source` imports that package by name, the one
place the core names it. With the variable unset and telemetry never imported, nothing of it
is loaded.

Alternatives considered:
    - An entry point group for sources: a lookup of installed distributions on every first
      adaptation, for the one source this project ships.
    - The source registered by the instrumentor only: ``FSDP_PATCH_TELEMETRY=1`` turns telemetry
      on without instrumenting, so the variable still needs its trigger.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from .events import StepObserver

__all__ = [
    "TELEMETRY_PACKAGE",
    "TELEMETRY_VARIABLE",
    "ObserverSource",
    "register_observer_source",
    "registered_source",
    "unregister_observer_source",
]

TELEMETRY_PACKAGE = "fsdp_patch.telemetry"
# Set (to anything but ""), it loads TELEMETRY_PACKAGE, which reads the value itself.
TELEMETRY_VARIABLE = "FSDP_PATCH_TELEMETRY"


class ObserverSource(Protocol):
    """What the adapter asks the registered source."""

    def observer_factory(
        self, optimizer: torch.optim.Optimizer, precision_aware: bool
    ) -> Callable[[], StepObserver] | None:
        """The factory of ``optimizer``'s observer, or ``None`` when it gets none (a ``NullObserver``).

        Raises:
            ValueError: The source's settings are malformed; nothing is adapted then.
        """

    def describe_settings(self, values: Sequence[Sequence[int]]) -> str:
        """The error message for ranks whose ``collective_settings`` (one row per rank) differ."""


_source: ObserverSource | None = None


def register_observer_source(source: ObserverSource) -> None:
    """Make ``source`` the one newly adapted optimizers ask; replaces any registered before."""
    global _source
    _source = source


def unregister_observer_source(source: ObserverSource) -> None:
    """Remove ``source`` if it is the registered one (a no-op otherwise)."""
    global _source
    if _source is source:
        _source = None


def registered_source(*, load: bool = False) -> ObserverSource | None:
    """The registered source; telemetry is imported first when none is and it is asked for.

    Args:
        load: Import telemetry even with ``FSDP_PATCH_TELEMETRY`` unset (the settings error
            needs its wording); a telemetry that is not installed then gives ``None``.

    Raises:
        ModuleNotFoundError: ``FSDP_PATCH_TELEMETRY`` is set and telemetry is not installed.
    """
    if _source is None and (load or os.environ.get(TELEMETRY_VARIABLE, "").strip()):
        try:
            importlib.import_module(TELEMETRY_PACKAGE)  # registers its source
        except ModuleNotFoundError as exc:
            if not load or exc.name != TELEMETRY_PACKAGE:
                raise
    return _source
