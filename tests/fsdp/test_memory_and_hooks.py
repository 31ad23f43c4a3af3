"""Unsharded storage over a step, collectives per phase, gradient sync and unused parameters.

With ``reshard_after_forward=True`` a rank holds only its shards between and around forward and
backward: forward gathers each group once and frees it, backward gathers it again, reduce-
scatters once per group and frees it. With ``reshard_after_forward=False`` the gathered storage
survives forward and backward needs no gather. No-grad (eval) forwards always reshard; a frozen
unit that backward passes through is freed again; ``set_requires_gradient_sync(False)`` skips the
reduce-scatter.
"""

from __future__ import annotations

import pytest
import torch

from tests.fsdp import rank_fns

WORLD_SIZE = 2  # collectives are skipped at world size 1


@pytest.fixture(scope="module")
def memory(run_once) -> list[dict]:
    return run_once(WORLD_SIZE, rank_fns.memory_run)


def _all_zero(sizes: dict[str, int]) -> bool:
    return bool(sizes) and all(v == 0 for v in sizes.values())


def test_reshard_after_forward_keeps_only_shards_between_uses(memory) -> None:
    for facts in memory:
        phase = facts["reshard_True"]
        expected = phase["expected_unsharded"]
        assert all(v > 0 for v in expected.values())
        for when in ("init", "after_forward", "after_backward", "after_step", "after_second_backward"):
            assert _all_zero(phase[when]), f"unsharded storage left {when}: {phase[when]}"
        # Each unit was gathered inside its forward and again inside its backward.
        by_unit = {k.split("[")[0]: v for k, v in expected.items()}
        assert phase["seen_in_forward"] == {("" if k == "<root>" else k): v for k, v in by_unit.items()}
        assert phase["seen_in_backward"] == phase["seen_in_forward"]
        storage = phase["storage_after_step"]
        assert storage["params_in_main_buffers"]
        assert storage["param_storage_bytes"] == storage["shard_bytes_expected"]
        assert storage["unsharded_param_storage_bytes"] == 0


def test_reshard_after_forward_false_keeps_gathered_weights_until_backward(memory) -> None:
    for facts in memory:
        phase = facts["reshard_False"]
        assert phase["after_forward"] == phase["expected_unsharded"]
        for when in ("init", "after_backward", "after_step", "after_second_backward"):
            assert _all_zero(phase[when]), f"unsharded storage left {when}: {phase[when]}"


def test_collectives_per_phase(memory) -> None:
    for facts in memory:
        on, off = facts["reshard_True"], facts["reshard_False"]
        groups = on["groups"]
        assert on["forward_collectives"] == {"all_gather": groups, "reduce_scatter": 0}
        assert on["backward_collectives"] == {"all_gather": groups, "reduce_scatter": groups}
        assert off["forward_collectives"] == {"all_gather": groups, "reduce_scatter": 0}
        assert off["backward_collectives"] == {"all_gather": 0, "reduce_scatter": groups}


def test_no_grad_forward_reshards(memory) -> None:
    for facts in memory:
        for reshard in (True, False):
            phase = facts[f"reshard_{reshard}"]
            assert _all_zero(phase["after_no_grad_forward"]), phase["after_no_grad_forward"]
            assert phase["no_grad_matches_grad_mode"]
            assert phase["grads_present"], "training after an eval forward lost grads"


def test_frozen_unit_is_freed_after_backward(memory) -> None:
    for facts in memory:
        assert _all_zero(facts["frozen_after_backward"]), facts["frozen_after_backward"]
        # (requires_grad, no main-grad buffer, grads_dtype, every .grad None): a frozen group
        # allocates no main-grad buffer, though its grads dtype is resolved for a later unfreeze.
        trainable, frozen = (True, False, torch.float32, False), (False, True, torch.float32, True)
        assert sorted(facts["frozen_groups"], key=repr) == sorted([trainable, trainable, frozen, frozen], key=repr)


def test_set_requires_gradient_sync_false_skips_reduce_scatter(memory) -> None:
    for facts in memory:
        assert facts["nosync_collectives"]["reduce_scatter"] == 0
        assert facts["nosync_grads_none"], "grads installed although the reduce-scatter was skipped"
        assert _all_zero(facts["nosync_after_backward"])
        assert facts["sync_collectives"]["reduce_scatter"] == facts["sync_groups"]
        assert facts["sync_grads_present"]
        assert "must be a bool" in facts["sync_bad_arg"]


@pytest.mark.parametrize("world_size", (2, 4))
def test_unused_and_rank_dependent_parameters(run_once, world_size: int) -> None:
    """A parameter some ranks skip still takes part in the collectives (no hang) and gets the
    average of the ranks' grads on every rank; one no rank uses keeps ``None``, as in the
    unsharded model."""
    per_rank = run_once(world_size, rank_fns.unused_run)
    for rank, facts in enumerate(per_rank):
        for name in ("never.weight", "never.bias"):
            got = facts[name]
            assert got["grad_is_none"], f"rank {rank}: {name} got a grad, though no rank used it: {got}"
            assert got["reference_grads"] == [False] * world_size, (
                f"rank {rank}: {name}'s reference grads {got['reference_grads']}"
            )
        for name, grad in facts.items():
            if name.startswith("never."):
                continue
            assert not grad["grad_is_none"] and grad["grad_is_dtensor"], f"rank {rank}: {name}: {grad}"
            assert grad["max_abs_err"] <= 1e-6, (
                f"rank {rank}: {name}: differs from the ranks' average by {grad['max_abs_err']}"
            )
        assert not facts["odd_only.weight"]["all_zero"], f"rank {rank}: odd_only.weight's grad is all zero"
