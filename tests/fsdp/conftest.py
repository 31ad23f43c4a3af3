"""Shared helpers for the fsdp tests: run-once caches over the session's gloo pools."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

_CACHE: dict[Any, Any] = {}


@pytest.fixture(scope="session")
def run_once(dist_pool: Callable[[int], Any]) -> Callable[..., list[Any]]:
    """``run_once(world_size, fn, *args)``: per-rank results of ``fn``, computed once per session.

    Many tests assert on different facts of one distributed scenario; this keeps the number of
    distributed runs (and the suite's time on 2 cores) small.
    """

    def run(world_size: int, fn: Callable[..., Any], *args: Any) -> list[Any]:
        # By module and name: two test modules may each name their scenario ``refusals_run``.
        key = (world_size, f"{fn.__module__}.{fn.__qualname__}", repr(args))
        if key not in _CACHE:
            _CACHE[key] = dist_pool(world_size).run(fn, *args)
        return _CACHE[key]

    return run


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
