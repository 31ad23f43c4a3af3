"""Pools for the optimizer adapter tests: one gloo pool per world size, shared by the session."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture(scope="session")
def pool1(dist_pool: Any) -> Any:
    return dist_pool(1)


@pytest.fixture(scope="session")
def pool2(dist_pool: Any) -> Any:
    return dist_pool(2)
