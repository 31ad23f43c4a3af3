"""Parameters without a grad (frozen ones) beside those with one: the grads read after the reduce
and at the step still line up with their parameters' units. Runs on the ranks of
``test_origin``'s training, faults planted as there (``_frozen``: ``blocks.0.fc1.bias`` frozen).
"""

from __future__ import annotations

import pytest

from tests.integration.test_origin import PLANT, WANT, _run


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
