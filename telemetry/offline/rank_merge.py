"""One sighting per thing the ranks report, with every rank that reported it.

Each rank writes its own event for what it saw (an operation, a forecast, a module's shadow); the
report shows each once, as the sighting one rule prefers (the earliest, the worst), and names every
rank that saw it. No torch and no OpenTelemetry here.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Protocol, TypeVar

__all__ = ["merge"]


class _Ranked(Protocol):
    ranks: set[int]


_K = TypeVar("_K", bound=Hashable)
_T = TypeVar("_T", bound=_Ranked)


def merge(held_by: dict[_K, _T], key: _K, seen: _T, preferred: Callable[[_T, _T], bool], rank: object) -> None:
    """Takes rank ``rank``'s sighting ``seen`` of ``key``: it replaces the one held where
    ``preferred(seen, held)``, and the one kept names the ranks of both."""
    held = held_by.get(key)
    if held is None or preferred(seen, held):
        if held is not None:
            seen.ranks |= held.ranks
        held_by[key] = held = seen
    if isinstance(rank, int):
        held.ranks.add(rank)
