"""The precision report on the per-iteration checks' spans and events: a learning-rate jump that a
NaN/Inf followed leads the report (the largest of several), grads zeroed before the step, backward
passes no step followed, a GradScaler's skips dated at the earliest skip over the ranks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from fsdp_patch.telemetry.offline import precision_report
from report_traces import origin_event, steps, write_iterations

JUMP = (
    "fsdp.optimizer.lr_jump",
    {"fsdp.step": 3, "fsdp.param_group": 0, "fsdp.lr.before": 1e-3, "fsdp.lr.after": 100.0},
)


def test_an_lr_jump_that_a_nan_followed_leads_the_report(tmp_path: Path) -> None:
    """Source: facebookresearch/fairseq#282 (Sometimes my loss explodes). The lr rose 1e5-fold at
    step 3 and the fp16 forward overflowed at step 4: the report leads with the jump and gives the
    origin as what followed; the origin is still the origin of the NaN."""
    # The origin of iteration 4 is read at step 5.
    write_iterations(tmp_path, {r: steps(6) for r in (0, 1)}, {3: [JUMP], 5: [origin_event(4, "forward", "blocks.0")]})
    report = precision_report.report_json(str(tmp_path))
    got = [(f["check"], f["first_step"]) for f in report["findings"]]
    assert got == [("lr_jump", 3), ("origin", 4)], f"want the jump, then the origin; got {got}"
    want = "the learning rate jumped x1e+05 (0.001 to 100, param group 0) at step 3, then NaN/Inf began in the forward at step 4"
    assert report["findings"][0]["finding"] == want, report["findings"][0]
    assert (report["origin"]["stage"], report["origin"]["step"]) == ("forward", 4), report["origin"]
    text = precision_report.report(str(tmp_path))
    assert "then: NaN began in the forward at step 4: module 'blocks.0' output" in text, text


@pytest.mark.parametrize(
    ("case", "origin"),
    [
        ("too late", origin_event(7, "forward", "blocks.0")),
        ("a write", origin_event(4, "weight_write", "w")),
        ("before it", origin_event(2, "forward", "blocks.0")),
        (
            "the batch",
            (
                origin_event(4, "forward", "")[0],
                {
                    **origin_event(4, "forward", "")[1],
                    "fsdp.origin.detail": "the model's input (the batch) already held it",
                },
            ),
        ),
    ],
)
def test_an_lr_jump_is_no_finding_unless_a_nan_of_the_update_follows_it(
    tmp_path: Path, case: str, origin: tuple[str, dict]
) -> None:
    """A jump (a restart of a schedule) with no NaN/Inf within 3 iterations after it, or followed by a
    weight written from outside the optimizer or a batch that held NaN, or after the NaN began:
    the origin leads alone."""
    write_iterations(tmp_path, {r: steps(9) for r in (0, 1)}, {3: [JUMP], origin[1]["fsdp.step"] + 1: [origin]})
    report = precision_report.report_json(str(tmp_path))
    got = [f["check"] for f in report["findings"]]
    assert got == ["origin"], f"{case}: want the origin alone, got {got}"


def test_grads_zeroed_before_the_step_name_the_cause_of_zero_grads(tmp_path: Path) -> None:
    """Source: facebookresearch/fairscale#263 (grad norms become inf with OSS / fp16). Step 3's grads
    were zeroed after the backward (a clip of an Inf norm): the report names that, with the units
    and ranks, and not "all gradients are zero" with its advice of a detached loss."""
    zeroed = ("fsdp.precision.grads_zeroed", {"fsdp.step": 3, "fsdp.grads_zeroed.units": "(root), blocks.0"})
    write_iterations(tmp_path, {r: steps(6) for r in (0, 1)}, {4: [zeroed]}, {3: {"fsdp.precision.grad.amax": 0.0}})
    report = precision_report.report_json(str(tmp_path))
    got = ([(f["check"], f["first_step"]) for f in report["findings"]], report["verdict"])
    assert got == ([("grads_zeroed", 3)], "warning"), f"want the zeroing alone, got {got}"
    text = precision_report.report(str(tmp_path))
    assert "1 iteration(s) (steps 3); units (root), blocks.0; ranks 0, 1" in text, text
    assert "clip" in report["findings"][0]["advice"], report["findings"][0]
    # Without the event, zero grads are reported as such.
    write_iterations(tmp_path / "plain", {r: steps(6) for r in (0, 1)}, {}, {3: {"fsdp.precision.grad.amax": 0.0}})
    got_plain = [f["check"] for f in precision_report.report_json(str(tmp_path / "plain"))["findings"]]
    assert got_plain == ["grad_zero"], got_plain


def test_backward_passes_no_step_followed_are_a_finding(tmp_path: Path) -> None:
    """A run whose backward passes no optimizer step followed (a step never called, or called on
    another optimizer) and no GradScaler skipped: the report names it, which a run with its steps does
    not (its last backward passes are followed by a step)."""
    write_iterations(tmp_path / "none", {r: [("fsdp.optimizer.checks", 0, {"fsdp.backward.count": 5})] for r in (0, 1)})
    report = precision_report.report_json(str(tmp_path / "none"))
    got = ([f["check"] for f in report["findings"]], report["iterations"]["backward_without_steps"], report["verdict"])
    assert got == (["no_optimizer_steps"], 5, "problem"), f"want the finding over 5 backward passes, got {got}"
    stepped = [("fsdp.optimizer.step", s, {"fsdp.backward.count": 1}) for s in (1, 2)]
    write_iterations(
        tmp_path / "some", {r: [*stepped, ("fsdp.optimizer.checks", 2, {"fsdp.backward.count": 0})] for r in (0, 1)}
    )
    report = precision_report.report_json(str(tmp_path / "some"))
    assert report["iterations"]["backward_without_steps"] == 0 and report["findings"] == [], report


def test_a_scaler_that_skips_some_iterations_is_dated_at_its_first_skip(tmp_path: Path) -> None:
    """The GradScaler finding starts at the first skipped iteration, and only many skips are one."""
    steps = [("fsdp.optimizer.step", s, {"fsdp.backward.count": 1}) for s in range(1, 4)]
    skipped = [
        ("fsdp.optimizer.skipped_step", 4, {"fsdp.backward.count": 1, "fsdp.grad_scaler.scale": 2.0**-k})
        for k in range(4)
    ]
    write_iterations(tmp_path, {0: steps + skipped, 1: steps + skipped})
    report = precision_report.report_json(str(tmp_path))
    got = ([(f["check"], f["first_step"]) for f in report["findings"]], report["iterations"])
    want = (
        [("scaler_skipped", 4)],
        {"optimizer_steps": 3, "skipped": 4, "scale_first": 1.0, "scale_last": 0.125, "backward_without_steps": 0},
    )
    assert got == want, f"want {want}, got {got}"
    text = precision_report.report(str(tmp_path))
    assert (
        "iterations: 3 optimizer steps, 4 skipped (GradScaler scale 1 at the first skip, 0.125 at the last), 7 backward passes"
        in text
    ), text


@pytest.mark.parametrize("early", (0, 1), ids=("earlier_on_rank0", "earlier_on_rank1"))
def test_a_scaler_that_skips_on_some_ranks_earlier_is_dated_at_the_earliest_skip(tmp_path: Path, early: int) -> None:
    """One rank's GradScaler skipped 4 iterations at step 4, the other's 4 at step 6 (9 iterations
    each): the finding is dated at step 4, whichever rank's files are read first."""

    def spans(skip_at: int) -> list[tuple[str, int, dict]]:
        skipped = [
            ("fsdp.optimizer.skipped_step", skip_at, {"fsdp.backward.count": 1, "fsdp.grad_scaler.scale": 2.0**-k})
            for k in range(4)
        ]
        return [*steps(skip_at - 1), *skipped, *[s for s in steps(5) if s[1] >= skip_at]]

    write_iterations(tmp_path, {early: spans(4), 1 - early: spans(6)})
    report = precision_report.report_json(str(tmp_path))
    got = [(f["check"], f["first_step"]) for f in report["findings"]]
    assert got == [("scaler_skipped", 4)], f"want the skips dated at step 4 (rank {early}'s), got {got}"


def test_of_several_lr_jumps_before_a_nan_the_largest_leads(tmp_path: Path) -> None:
    """The lr rose x10 at step 1, x1e5 at step 2 and x10 at step 3, and the forward overflowed at
    step 4: the report ties the NaN to the x1e5 jump, neither the first nor the last in its window."""
    jumps = {
        step: [
            (
                "fsdp.optimizer.lr_jump",
                {"fsdp.step": step, "fsdp.param_group": 0, "fsdp.lr.before": 1e-3, "fsdp.lr.after": 1e-3 * factor},
            )
        ]
        for step, factor in ((1, 10.0), (2, 1e5), (3, 10.0))
    }
    jumps[5] = [origin_event(4, "forward", "blocks.0")]
    write_iterations(tmp_path, {r: steps(6) for r in (0, 1)}, jumps)
    report = precision_report.report_json(str(tmp_path))
    got = [(f["check"], f["first_step"]) for f in report["findings"]]
    assert got == [("lr_jump", 2), ("origin", 4)], f"want the x1e5 jump at step 2, then the origin; got {got}"
    assert "jumped x1e+05" in report["findings"][0]["finding"], report["findings"][0]
