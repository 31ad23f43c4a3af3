"""Communication overlap (issue: "faster and leaner than FSDP2"): each unit issues the next
units' all-gathers before it computes, in forward and backward, up to a limit, and leaves its
reduce-scatter running while backward goes on. Training must not change by a bit, at most the
configured number of units may be gathered ahead, and an exception must leave nothing behind."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.fsdp import overlap_fns

CASES = [  # (world size, checkpointed, microbatches, gradient sync)
    (2, False, 1, "all"),
    (2, True, 4, "last"),
    (2, False, 4, "all"),
    (4, True, 1, "all"),
    (4, False, 4, "last"),
]
LIMITS = {"off": 0, "default": 1, "deep": 2}


def _run(run_once: Any, case: tuple[int, bool, int, str]) -> list[dict[str, Any]]:
    world_size, checkpointed, microbatches, sync = case
    return run_once(world_size, overlap_fns.overlap_run, checkpointed, microbatches, sync)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"ws{c[0]}-{'ckpt' if c[1] else 'plain'}-mb{c[2]}-sync_{c[3]}")
def test_overlap_trains_bitwise_like_blocking_collectives(run_once: Any, case: tuple[int, bool, int, str]) -> None:
    per_rank = _run(run_once, case)
    want = per_rank[0]["off"]
    for name in ("default", "deep"):
        got = per_rank[0][name]
        for rank, facts in enumerate(per_rank):
            assert facts[name]["losses"] == facts["off"]["losses"], (
                f"rank {rank}, overlap {name}: losses {facts[name]['losses']}, blocking {facts['off']['losses']}"
            )
        differ = [n for n in want["params"] if not torch.equal(got["params"][n], want["params"][n])]
        assert not differ, f"overlap {name}: final weights differ from blocking collectives in {differ}"


@pytest.mark.parametrize("case", CASES[:2], ids=lambda c: f"ws{c[0]}-{'ckpt' if c[1] else 'plain'}")
def test_units_gathered_ahead_never_exceed_the_limit(run_once: Any, case: tuple[int, bool, int, str]) -> None:
    """Counted from storages at each unit's forward and backward: units other than the one
    computing and the root whose weights are gathered (or being gathered)."""
    for rank, facts in enumerate(_run(run_once, case)):
        for name, limit in LIMITS.items():
            for direction in ("forward", "backward"):
                ahead = facts[name]["ahead"][direction]
                assert ahead, f"rank {rank}: no {direction} observations"
                assert max(ahead) == limit, (
                    f"rank {rank}, limit {limit}: at most {max(ahead)} units gathered ahead in {direction} "
                    f"(want exactly {limit} at some point, never more): {ahead}"
                )
            assert facts[name]["gathered_at_end"] == [], (
                f"rank {rank}: still gathered after training: {facts[name]['gathered_at_end']}"
            )


def test_main_grad_memory_is_free_after_zero_grad_set_to_none(run_once: Any) -> None:
    for rank, facts in enumerate(_run(run_once, CASES[0])):
        for name in LIMITS:
            got = facts[name]["storage_after_zero_grad"]
            assert got == [0] * overlap_fns.STEPS, f"rank {rank}, {name}: main-grad bytes after zero_grad: {got}"


def test_exception_mid_forward_leaves_nothing_gathered_or_in_flight(run_once: Any) -> None:
    for rank, facts in enumerate(run_once(2, overlap_fns.forward_exception_run)):
        assert facts["raised"], f"rank {rank}: the planted exception did not propagate"
        assert facts["in_flight_at_raise"] >= 1, f"rank {rank}: no all-gather was in flight when the forward raised"
        assert set(facts["gathered_after"].values()) == {0}, (
            f"rank {rank}: gathered after the exception: {facts['gathered_after']}"
        )
        assert facts["in_flight_after"] == 0, f"rank {rank}: {facts['in_flight_after']} all-gathers still in flight"
        assert facts["sharded_in_modules"], f"rank {rank}: unsharded parameters left in the modules"
        assert facts["next_iteration_grads"], f"rank {rank}: the next iteration produced no grads"
