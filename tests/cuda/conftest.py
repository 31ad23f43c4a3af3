"""CUDA tests: each runs on one rank of a single-rank NCCL pool (``dist_pool(1, backend="nccl")``).

Marked ``cuda``; without a CUDA device they skip, saying so. ``scripts/gpu_check.sh`` runs them
(``pytest -m cuda``) whenever a GPU machine is lent.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

NO_CUDA = "no CUDA device here: scripts/gpu_check.sh runs the CUDA tests on a GPU machine"


@pytest.fixture
def on_cuda(dist_pool: Any) -> Callable[..., Any]:
    """``on_cuda(fn, *args)``: ``fn(*args)`` on CUDA in a single-rank NCCL group; skips without CUDA."""
    if not torch.cuda.is_available():
        pytest.skip(NO_CUDA)

    def run(fn: Callable[..., Any], *args: Any) -> Any:
        (result,) = dist_pool(1, backend="nccl").run(fn, *args)
        return result

    return run
