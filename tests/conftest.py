"""Shared fixtures: persistent gloo pools per world size."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.distributed_pool import DistributedPool

_POOLS: dict[int, DistributedPool] = {}


@pytest.fixture(scope="session")
def dist_pool() -> Iterator:
    """``dist_pool(world_size)`` returns a running pool of that many gloo ranks."""

    def get(world_size: int) -> DistributedPool:
        if world_size not in _POOLS:
            _POOLS[world_size] = DistributedPool(world_size)
        return _POOLS[world_size]

    yield get
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()
