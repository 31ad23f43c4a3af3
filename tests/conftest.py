"""Shared fixtures: persistent gloo pools per world size."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from tests.distributed_pool import DistributedPool

_POOLS: dict[tuple[int, str], DistributedPool] = {}


@pytest.fixture(scope="session")
def dist_pool() -> Iterator:
    """``dist_pool(world_size)`` returns a running pool of that many gloo ranks;
    ``dist_pool(world_size, backend="nccl")`` one of NCCL ranks, one GPU each."""

    def get(world_size: int, backend: str = "gloo") -> DistributedPool:
        key = (world_size, backend)
        if key not in _POOLS:
            _POOLS[key] = DistributedPool(world_size, backend)
        return _POOLS[key]

    yield get
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()


@pytest.fixture(autouse=True)
def _no_audit_outlives_its_test() -> Iterator[None]:
    """A test that trains a step or two and stops leaves the operation audit and the float32 shadow
    of its next iteration running, as a script that stops there would; they would measure the next test. Stopped after each
    test (only where telemetry was imported: the core's own tests import none of it)."""
    yield
    for name in ("op_audits", "module_shadows"):
        module = sys.modules.get(f"fsdp_patch.telemetry.instrumentation.{name}")
        if module is not None:
            module.abandon_running()
