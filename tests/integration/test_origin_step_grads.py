"""The grads between the reduce and the step: parameters without a grad (frozen ones) beside those
with one still line up with their units, and a write through a grad's DTensor (which moves its
shard's version counter not) is checked at the step. Runs on the ranks of ``test_origin``'s
training, faults planted as there (``_frozen``: ``blocks.0.fc1.bias`` frozen).
"""

from __future__ import annotations

import pytest

from tests.integration.test_origin import KINDS, PLANT, WANT, _run


@pytest.mark.parametrize(
    ("kind", "fault", "want"),
    [
        ("fully_shard", "backward_frozen", WANT["backward"]),
        ("fsdp2", "backward_frozen", WANT["backward"]),
        ("fsdp2", "grad_replaced_frozen", WANT["grad_write"]),
    ],
)
def test_a_parameter_without_a_grad_leaves_the_others_named(dist_pool, tmp_path, kind, fault, want) -> None:
    """A frozen parameter has no grad after the reduce: the grads read there, and the step's
    record of those already checked, still line up with their parameters' units."""
    report = _run(dist_pool, 2, kind, fault, tmp_path, "100")
    origin = report["origin"]
    got = None if origin is None else (origin["step"], origin["stage"], origin["where"])
    assert got == (PLANT, *want), f"{kind}, {fault}: want the origin {(PLANT, *want)}, got {got}"


@pytest.mark.parametrize("kind", KINDS)
def test_a_grad_written_through_its_dtensor_is_checked_at_the_step(dist_pool, tmp_path, kind) -> None:
    """``p.grad.mul_(nan)`` after backward: the DTensor's version counter moves, its local shard's
    (what the reduce checked) does not; the step checks the grads again and names the write."""
    report = _run(dist_pool, 2, kind, "grad_write_dtensor", tmp_path, "100")
    origin = report["origin"]
    got = None if origin is None else (origin["step"], origin["stage"], origin["where"])
    want = (PLANT, *WANT["grad_write"])
    assert got == want, f"{kind}: want the origin {want}, got {got}"


def test_a_grad_replaced_under_fully_shard_is_checked_at_the_step(dist_pool, tmp_path) -> None:
    """``p.grad = p.grad * nan`` under ``fully_shard``: the new grad is no view of the main-grad
    buffer the reduce filled (which stays finite), and it is what the optimizer steps with: the
    step checks it and names the write, not the update."""
    report = _run(dist_pool, 2, "fully_shard", "grad_replaced", tmp_path, "100")
    origin = report["origin"]
    got = None if origin is None else (origin["step"], origin["stage"], origin["where"])
    want = (PLANT, *WANT["grad_write"])
    assert got == want, f"want the origin {want}, got {got}"
