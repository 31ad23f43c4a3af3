"""The distributed test harness reports a rank's failure to load a test body instead of hanging."""

from __future__ import annotations

import sys
import types

import pytest

from tests.distributed_pool import DistributedPool, RankError


def test_body_the_ranks_cannot_import_is_reported_and_the_pool_goes_on() -> None:
    # A function pickled by reference to a module that exists only in this process.
    module = types.ModuleType("fsdp_patch_tests_only_here")
    exec("def body():\n    return 1\n", module.__dict__)
    sys.modules[module.__name__] = module
    pool = DistributedPool(2)
    try:
        with pytest.raises(RankError, match="ModuleNotFoundError: No module named 'fsdp_patch_tests_only_here'"):
            pool.run(module.body)
        got = pool.run(len, [1, 2, 3])
        assert got == [3, 3], f"the pool after the failed call: got {got}, want [3, 3]"
    finally:
        pool.close()
        del sys.modules[module.__name__]
