"""The compute copy's lifetime (``MixedPrecisionPolicy.compute_copy``, issue "faster and leaner
than FSDP2": memory at most FSDP2's). ``"per_gather"`` must train bit for bit like the
persistent copy and like FSDP2, hold no compute-copy memory (each all-gather casts into its own output),
and keep telemetry's precision diagnostics unchanged."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.fsdp import compute_copy_fns

CASES = [(False, 1), (True, 4)]  # (checkpointed, microbatches)


def _case_id(case: tuple[bool, int]) -> str:
    return f"{'ckpt' if case[0] else 'plain'}-mb{case[1]}"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_per_gather_trains_bitwise_like_persistent_and_fsdp2(run_once: Any, case: tuple[bool, int]) -> None:
    facts = run_once(2, compute_copy_fns.lifetime_run, *case)[0]
    want = facts["persistent"]
    for impl in ("per_gather", "fsdp2"):
        got = facts[impl]
        assert got["losses"] == want["losses"], f"{impl}: losses {got['losses']}, persistent {want['losses']}"
        differ = [n for n in want["params"] if not torch.equal(got["params"][n], want["params"][n])]
        assert not differ, f"{impl}: final weights differ from the persistent copy's in {differ}"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_per_gather_keeps_no_compute_copy(run_once: Any, case: tuple[bool, int]) -> None:
    got = run_once(2, compute_copy_fns.lifetime_run, *case)[0]["per_gather"]
    steps = compute_copy_fns.STEPS
    seen = got["holding_compute_copies"]
    assert seen, "no observation was made in forward or backward"
    assert max(seen) == 0, (
        f"groups holding compute-copy memory: up to {max(seen)}, in {sum(map(bool, seen))} of {len(seen)} observations"
    )
    assert got["compute_bytes_after_step"] == [0] * steps, (
        f"compute-copy bytes after each step: {got['compute_bytes_after_step']}"
    )
    assert got["compute_bytes_after_zero_grad"] == [0] * steps, (
        f"compute-copy bytes between steps: {got['compute_bytes_after_zero_grad']}"
    )
    assert all(all(stale) for stale in got["stale_after_step"]), (
        f"groups not marked changed by the step: {got['stale_after_step']}"
    )


def test_persistent_copy_is_refreshed_and_kept(run_once: Any) -> None:
    """The control: the default copy lives between steps, refreshed (not stale) by the adapter."""
    got = run_once(2, compute_copy_fns.lifetime_run, *CASES[0])[0]["persistent"]
    want = [got["shard_compute_bytes"]] * compute_copy_fns.STEPS
    assert got["shard_compute_bytes"] > 0, "the bf16 model has no separate compute copy"
    assert got["compute_bytes_after_zero_grad"] == want, (
        f"persistent copy bytes between steps: {got['compute_bytes_after_zero_grad']}, want {want}"
    )
    assert not any(any(stale) for stale in got["stale_after_step"]), (
        f"stale after the adapter's refresh: {got['stale_after_step']}"
    )


def test_per_gather_keeps_precision_diagnostics_and_counts_no_refresh_bytes(run_once: Any) -> None:
    """The diagnostics derive a per_gather group's compute weight by the cast every all-gather
    makes, so they read the same values as with the refreshed persistent copy; no refresh cast
    happens at the step, so none is counted (the refresh span still marks the phase)."""
    facts = run_once(2, compute_copy_fns.telemetry_run)[0]
    persistent, per_gather = facts["persistent"], facts["per_gather"]
    steps = compute_copy_fns.STEPS
    assert per_gather["losses"] == persistent["losses"], f"losses {per_gather['losses']} vs {persistent['losses']}"
    assert persistent["refresh_bytes"] == steps * persistent["shard_compute_bytes"], (
        f"persistent refresh bytes {persistent['refresh_bytes']}, want {steps} x {persistent['shard_compute_bytes']}"
    )
    assert per_gather["refresh_bytes"] == 0, f"per_gather counted {per_gather['refresh_bytes']} refresh bytes"
    assert per_gather["grad_bytes"] == persistent["grad_bytes"] > 0, (
        f"grad cast bytes {per_gather['grad_bytes']} vs {persistent['grad_bytes']}"
    )
    assert per_gather["refresh_spans"] == persistent["refresh_spans"] == steps, (
        f"refresh spans {per_gather['refresh_spans']} vs {persistent['refresh_spans']}, want {steps}"
    )
    for name, values in persistent["gauges"].items():
        assert values, f"{name}: no data point"
        assert per_gather["gauges"][name] == values, (
            f"{name}: per_gather {per_gather['gauges'][name]}, persistent {values}"
        )
    assert per_gather["counters"] == persistent["counters"], f"{per_gather['counters']} vs {persistent['counters']}"


def test_per_gather_sees_writes_outside_the_optimizer(run_once: Any) -> None:
    facts = run_once(2, compute_copy_fns.external_write_run)[0]
    persistent, per_gather = facts["persistent"], facts["per_gather"]
    for key in ("before", "halved", "loaded"):
        assert per_gather[key] == persistent[key], (
            f"{key}: per_gather loss {per_gather[key]}, persistent {persistent[key]}"
        )
    assert persistent["halved"] != persistent["before"], "halving the head changed nothing: the test proves nothing"
    assert per_gather["unsharded_after_unshard"] > 0, "explicit unshard gathered nothing"
    assert per_gather["compute_bytes_while_unsharded"] == 0, (
        f"per_gather kept {per_gather['compute_bytes_while_unsharded']} compute bytes after an explicit unshard"
    )
    assert persistent["compute_bytes_while_unsharded"] == persistent["shard_compute_bytes"] > 0


def test_policy_refuses_an_unknown_lifetime() -> None:
    from fsdp_patch import MixedPrecisionPolicy

    with pytest.raises(ValueError) as info:
        MixedPrecisionPolicy(compute_copy="lazy")  # type: ignore[arg-type]
    got = str(info.value)
    for want in ("compute_copy", "'persistent'", "'per_gather'", "'lazy'"):
        assert want in got, f"message {got!r} does not name {want}"


def test_exception_mid_forward_leaves_nothing_behind_and_training_goes_on(run_once: Any) -> None:
    facts = run_once(2, compute_copy_fns.exception_run)[0]
    persistent, per_gather = facts["persistent"], facts["per_gather"]
    assert per_gather["raised"] == 1, "the planted exception did not propagate"
    assert per_gather["in_flight_at_raise"] >= 1, "no all-gather was in flight when the forward raised"
    for key in ("in_flight_after", "unsharded_after", "compute_bytes_after"):
        assert per_gather[key] == 0, f"per_gather after the exception: {key} = {per_gather[key]}"
    assert len(per_gather["losses"]) == 3, f"steps trained: {per_gather['losses']}"
    assert per_gather["losses"] == persistent["losses"], (
        f"losses {per_gather['losses']} vs persistent {persistent['losses']}"
    )
