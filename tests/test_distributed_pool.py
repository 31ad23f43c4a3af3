"""The distributed test harness reports a rank's failure to load a test body, a rank whose
process dies and a rank that hangs (with its stacks), instead of hanging; the pool goes on
after each."""

from __future__ import annotations

import os
import sys
import time
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


def abort_on_rank_1() -> int:
    if int(os.environ["RANK"]) == 1:
        os.abort()  # as glibc does when it finds the heap corrupted
    return 0


def test_rank_that_dies_is_reported_with_its_signal_and_the_pool_goes_on() -> None:
    pool = DistributedPool(2)
    try:
        with pytest.raises(RankError, match=r"^rank 1 died \(killed by SIGABRT\), see its stderr$"):
            pool.run(abort_on_rank_1)
        got = pool.run(len, [1, 2])
        assert got == [2, 2], f"the pool after a rank died: got {got}, want [2, 2]"
    finally:
        pool.close()


def test_ranks_that_cannot_start_fail_the_pool_once() -> None:
    # An unknown backend: init_process_group raises on every rank, whose process then exits (the
    # error names the ranks found dead by then: one or both).
    with pytest.raises(
        RankError, match=r"^rank [01] died \(exit code 1\)(; rank 1 died \(exit code 1\))?, see its stderr$"
    ):
        DistributedPool(2, backend="no-such-backend")


def hang_on_rank_1() -> int:
    if int(os.environ["RANK"]) == 1:
        time.sleep(3600)
    return 0


def test_rank_that_hangs_is_reported_with_its_stacks_and_the_pool_goes_on(capfd: pytest.CaptureFixture[str]) -> None:
    pool = DistributedPool(2)
    try:
        pool.timeout_s = 3.0
        with pytest.raises(
            RankError, match=r"^ranks \[1\] timed out after 3 s \(their stacks are on stderr\); ranks \[0\] answered$"
        ):
            pool.run(hang_on_rank_1)
        stderr = capfd.readouterr().err
        assert "in hang_on_rank_1" in stderr, f"the hung rank's stacks on stderr: got {stderr[-2000:]!r}"
        got = pool.run(len, [1, 2])
        assert got == [2, 2], f"the pool after a rank hung: got {got}, want [2, 2]"
    finally:
        pool.close()
