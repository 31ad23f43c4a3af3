"""Whose backward a backward is: a model's watch checks and counts only its own, in a process that
runs others beside it (another model's backward and clip) or one inside another (reentrant
activation checkpointing). Runs on the ranks of ``test_origin``'s training, faults planted as there.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.test_origin import KINDS, PLANT, STEPS, WANT, _run


def _backward_counts(trace_dir: Path) -> dict[int, list[int]]:
    """Each rank's ``fsdp.backward.count`` per step span, in step order."""
    from fsdp_patch.telemetry import semconv
    from fsdp_patch.telemetry.offline.trace_reading import iter_events, rank_segments

    counts: dict[int, dict[int, int]] = {}
    for segment in rank_segments(str(trace_dir)):
        for event in iter_events(segment.path):
            args = event.get("args") or {}
            if event.get("name") == semconv.SPAN_STEP and semconv.ATTR_BACKWARD_COUNT in args:
                counts.setdefault(segment.rank, {})[args[semconv.ATTR_STEP]] = args[semconv.ATTR_BACKWARD_COUNT]
    return {rank: [by_step[step] for step in sorted(by_step)] for rank, by_step in counts.items()}


@pytest.mark.parametrize("kind", KINDS)
def test_another_models_backward_is_not_this_models(dist_pool, tmp_path, kind) -> None:
    """A backward that reaches none of the model's hooks is another model's: its NaN loss (and
    the NaN norm of its clip) is no origin of this model's, and it is not counted as one of this
    model's backward passes."""
    report = _run(dist_pool, 2, kind, "other_model", tmp_path, "100")
    assert report["origin"] is None, (
        f"{kind}: another model's NaN loss was reported as this model's: {report['origin']}"
    )
    counts = _backward_counts(tmp_path / f"{kind}-other_model-100")
    want = {rank: [1] * STEPS for rank in (0, 1)}
    assert counts == want, f"{kind}: backward passes per step, want one each (this model's), got {counts}"


@pytest.mark.parametrize("kind", KINDS)
def test_a_backward_inside_a_backward_is_part_of_it(dist_pool, tmp_path, kind) -> None:
    """Reentrant checkpointing recomputes each block in a backward of its own, inside the step's:
    one backward a step is counted, and a NaN planted in a block's backward is still named there."""
    report = _run(dist_pool, 2, kind, "healthy_reentrant", tmp_path, "100")
    counts = _backward_counts(tmp_path / f"{kind}-healthy_reentrant-100")
    want = {rank: [1] * STEPS for rank in (0, 1)}
    assert report["origin"] is None and counts == want, (
        f"{kind}: want no origin and one backward a step {want}, got {report['origin']} and {counts}"
    )
    origin = _run(dist_pool, 2, kind, "backward_reentrant", tmp_path, "100")["origin"]
    got = None if origin is None else (origin["step"], origin["stage"], origin["where"])
    assert got == (PLANT, *WANT["backward"]), f"{kind}: want {(PLANT, *WANT['backward'])}, got {got}"
