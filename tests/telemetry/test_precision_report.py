"""The precision report on trace files written by the real exporter, with chosen diagnostic values.

End to end on the demo's planted scenarios: tests/cli/test_installed_command.py.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from fsdp_patch.telemetry import precision_thresholds
from fsdp_patch.telemetry.export import trace_files
from fsdp_patch.telemetry.offline import precision_report
from fsdp_patch.telemetry.offline.trace_reading import TraceFileError
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import Status, StatusCode

HEALTHY = {
    "fsdp.precision.nonfinite": 0,
    "fsdp.precision.refresh.overflow": 0,
    "fsdp.precision.refresh.underflow": 0,
    "fsdp.precision.refresh.error": 1.5e-3,
    "fsdp.precision.update.lost_ratio": 0.1,
    "fsdp.precision.grad.amax": 0.07,
}


def _rank_tracer(directory: Path, rank: int, ranks: int) -> tuple[TracerProvider, Any]:
    """A tracer writing rank ``rank``'s trace file (of ``ranks``) with the real exporter; shut the
    provider down to write it."""
    exporter = trace_files.TraceFileExporter(str(directory), rank, {"fsdp.world_size": ranks}, jaeger_at_shutdown=False)
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, provider.get_tracer("t")


def _write(
    directory: Path, diagnostics: dict[int, dict], steps: int, failed: tuple[int, ...] = (), ranks: int = 2
) -> None:
    """Step spans 1..steps per rank, a precision child on the steps in ``diagnostics``."""
    for rank in range(ranks):
        provider, tracer = _rank_tracer(directory, rank, ranks)
        for step in range(1, steps + 1):
            with tracer.start_as_current_span("fsdp.optimizer.step", attributes={"fsdp.step": step}) as span:
                if step in diagnostics:
                    with tracer.start_as_current_span("fsdp.optimizer.precision") as child:
                        child.set_attributes({**HEALTHY, **diagnostics[step]})
                if step in failed:
                    span.set_status(Status(StatusCode.ERROR, "TypeError: rejected"))
        provider.shutdown()


def _verdicts(directory: Path, lines: int = 10) -> list[tuple[int, int, str, list[str]]]:
    run = precision_report.read_run(str(directory))
    return [
        (line.first, line.last, line.verdict, sorted(f.threshold.check for f in line.findings))
        for line in precision_report.range_lines(run, lines)
    ]


def test_healthy_run_is_healthy_on_every_line(tmp_path: Path) -> None:
    _write(tmp_path, {s: {} for s in (1, 5, 10)}, steps=12)
    got = _verdicts(tmp_path)
    assert got == [(1, 1, "healthy", []), (2, 5, "healthy", []), (6, 12, "healthy", [])], got
    text = precision_report.report(str(tmp_path))
    assert "overall: healthy" in text and "ranks 0, 1 of 2" in text, text


def test_each_threshold_fires_on_its_line_and_names_the_bug(tmp_path: Path) -> None:
    diagnostics = {
        1: {},
        2: {"fsdp.precision.update.lost_ratio": 0.95},
        3: {"fsdp.precision.nonfinite": 3, "fsdp.precision.grad.amax": 0.0},
        4: {"fsdp.precision.refresh.overflow": 8, "fsdp.precision.nonfinite": 8},
        5: {"fsdp.precision.grad.amax": 0.0},
        6: {"fsdp.precision.refresh.error": 0.01, "fsdp.precision.refresh.underflow": 2},
        7: {"fsdp.precision.grad.amax": 1e5},
        8: {"fsdp.precision.update.unstepped": 1},
        9: {"fsdp.precision.state.nonfinite": 2},
        10: {"fsdp.precision.update.stuck": 1},
        11: {"fsdp.precision.state.flushed": 0.5},
        12: {"fsdp.precision.update.skipped": 1},
        13: {"fsdp.precision.grad.underflow": 0.9},
        14: {"fsdp.precision.update.jump": 3000.0},
    }
    _write(tmp_path, diagnostics, steps=14)
    got = _verdicts(tmp_path, lines=14)
    want = [
        (1, 1, "healthy", []),
        (2, 2, "warning", ["lost_updates"]),
        (3, 3, "problem", ["nonfinite"]),  # amax 0 of NaN grads is not "vanishing gradients"
        (4, 4, "problem", ["nonfinite", "refresh_overflow"]),
        (5, 5, "warning", ["grad_zero"]),
        (6, 6, "warning", ["refresh_error", "refresh_underflow"]),
        (7, 7, "warning", ["grad_amax_fp16"]),
        (8, 8, "problem", ["unstepped_weights"]),
        (9, 9, "problem", ["state_nonfinite"]),
        (10, 10, "warning", ["stuck_weights"]),
        (11, 11, "warning", ["state_flushed"]),
        (12, 12, "warning", ["skipped_steps"]),
        (13, 13, "problem", ["grad_underflow"]),
        (14, 14, "problem", ["update_jump"]),
    ]
    assert got == want, got
    text = precision_report.report(str(tmp_path), max_lines=14)
    assert "overall: problem: NaN/Inf in gradients or weights, from step 3" in text, text
    line4 = next(line for line in text.splitlines() if line.strip().startswith("4-4"))
    # The overflow explains the Inf compute weights the non-finite count includes: named first.
    assert "problem: refresh overflow" in line4, line4
    for threshold in precision_thresholds.THRESHOLDS:
        assert threshold.finding in text, f"{threshold.check}'s finding is missing from the report"


def test_lines_take_the_worst_value_of_their_range(tmp_path: Path) -> None:
    diagnostics = {s: {"fsdp.precision.update.lost_ratio": s / 100} for s in range(1, 21)}
    diagnostics[7]["fsdp.precision.refresh.error"] = float("nan")
    _write(tmp_path, diagnostics, steps=20, ranks=1)
    run = precision_report.read_run(str(tmp_path))
    lines = precision_report.range_lines(run, 4)
    got = [(line.first, line.last, line.values["fsdp.precision.update.lost_ratio"]) for line in lines]
    assert got == [(1, 5, 0.05), (6, 10, 0.10), (11, 15, 0.15), (16, 20, 0.20)], got
    assert lines[1].values["fsdp.precision.refresh.error"] == HEALTHY["fsdp.precision.refresh.error"]


def test_failed_steps_are_counted_in_their_range(tmp_path: Path) -> None:
    _write(tmp_path, {1: {}, 10: {}}, steps=10, failed=(4, 7), ranks=1)
    got = _verdicts(tmp_path)
    assert got == [(1, 1, "healthy", []), (2, 10, "warning", ["failed_steps"])], got
    lines = precision_report.range_lines(precision_report.read_run(str(tmp_path)))
    assert lines[1].failed == 2, f"failed steps counted: {lines[1].failed}, want 2"


def test_step_offset_shows_global_steps_of_a_resumed_run(tmp_path: Path) -> None:
    _write(tmp_path, {1: {}, 4: {"fsdp.precision.update.lost_ratio": 0.99}}, steps=4, ranks=1)
    text = precision_report.report(str(tmp_path), step_offset=6)
    assert "  7-7 " in text and "  8-10 " in text and "from step 10" in text, text


def test_no_diagnostics_says_how_to_turn_them_on(tmp_path: Path) -> None:
    _write(tmp_path, {}, steps=3, ranks=1)
    text = precision_report.report(str(tmp_path))
    assert "no precision diagnostics" in text and "FSDP_PATCH_PRECISION_EVERY" in text, text


@pytest.mark.parametrize("make", ["missing", "empty"])
def test_a_directory_without_traces_is_an_error_naming_it(tmp_path: Path, make: str) -> None:
    directory = tmp_path / "traces"
    if make == "empty":
        directory.mkdir()
    with pytest.raises(TraceFileError, match=re.escape(str(directory))):
        precision_report.read_run(str(directory))


def _write_attributed(directory: Path, ranks: int = 2) -> None:
    """Steps 1-4; the attribution's events as the observer writes them (every rank the same
    offenders, each rank its own dtype-contract event)."""
    from fsdp_patch.telemetry import semconv

    for rank in range(ranks):
        provider, tracer = _rank_tracer(directory, rank, ranks)
        for step in range(1, 5):
            with tracer.start_as_current_span(semconv.SPAN_STEP, attributes={semconv.ATTR_STEP: step}) as span:
                with tracer.start_as_current_span(semconv.SPAN_PRECISION) as child:
                    values = dict(HEALTHY)
                    if step >= 3:
                        values[semconv.METRIC_NONFINITE] = 3 if step == 3 else 900
                        values[semconv.ATTR_UNSTEPPED_PARAMS] = 1
                    child.set_attributes(values)
                    if step == 3:
                        child.add_event(
                            semconv.EVENT_FIRST_NONFINITE,
                            {
                                semconv.ATTR_STEP: 3,
                                semconv.ATTR_PARAM: "blocks.1.fc1.weight",
                                semconv.ATTR_UNIT: "blocks.1",
                                semconv.ATTR_TENSOR: semconv.TENSOR_MAIN_GRAD,
                                semconv.ATTR_RANKS: [1],
                                semconv.ATTR_NONFINITE_KIND: "nan",
                                semconv.ATTR_PRECISION_ELEMENTS: 1,
                                semconv.ATTR_PRECISION_PARAMS: ["blocks.1.fc1.weight"],
                                semconv.ATTR_PRECISION_PARAMS_COUNT: 1,
                            },
                        )
                    offenders = [(semconv.METRIC_LOST_RATIO, "head.weight", "", 0.4 + step / 100, {})]
                    if step == 3:
                        offenders.append((semconv.METRIC_NONFINITE, "blocks.1.fc1.weight", "blocks.1", 3, {}))
                    if step == 4:
                        offenders.append((semconv.METRIC_NONFINITE, "head.weight", "", 900, {}))
                    if step >= 3:
                        offenders.append(
                            (
                                semconv.DIAGNOSTIC_UNSTEPPED,
                                "blocks.0.proj.weight",
                                "blocks.0",
                                step,
                                {semconv.ATTR_CAUSE: semconv.UNSTEPPED_NOT_IN_OPTIMIZER},
                            )
                        )
                    for diagnostic, param, unit, value, extra in offenders:
                        child.add_event(
                            semconv.EVENT_OFFENDER,
                            {
                                semconv.ATTR_DIAGNOSTIC: diagnostic,
                                semconv.ATTR_PARAM: param,
                                semconv.ATTR_UNIT: unit,
                                semconv.ATTR_VALUE: value,
                                **extra,
                            },
                        )
                if step == 2:
                    span.add_event(
                        semconv.EVENT_DTYPE_CONTRACT,
                        {
                            semconv.ATTR_STEP: 2,
                            semconv.ATTR_RANK: rank,
                            semconv.ATTR_PARAM: "head.weight",
                            semconv.ATTR_UNIT: "",
                            semconv.ATTR_TENSOR: semconv.TENSOR_OPTIMIZER_STATE,
                            semconv.ATTR_OPTIMIZER_STATE: "exp_avg_sq",
                            semconv.ATTR_DTYPE_EXPECTED: "float32",
                            semconv.ATTR_DTYPE_ACTUAL: "bfloat16",
                        },
                    )
        provider.shutdown()


def test_report_names_the_parameters_of_each_finding(tmp_path: Path) -> None:
    _write_attributed(tmp_path)
    text = precision_report.report(str(tmp_path))
    for want in (
        "first NaN/Inf: step 3, rank 1, blocks.1.fc1.weight (unit 'blocks.1'), main_grad: 1 NaN element",
        # at the first bad step only: what spread a step later is not the culprit
        "with NaN/Inf: blocks.1.fc1.weight (unit 'blocks.1'): 3 elements at step 3\n",
        "unstepped: blocks.0.proj.weight (unit 'blocks.0'): 4 diagnosed steps at step 4, not in optimizer",
        "head.weight (root unit): optimizer_state 'exp_avg_sq' is bfloat16, expected float32 (step 2, ranks 0, 1)",
        "overall: problem: NaN/Inf in gradients or weights, from step 3",
    ):
        assert want in text, f"{want!r} missing from:\n{text}"
    verdicts = _verdicts(tmp_path)
    assert verdicts[1] == (2, 2, "warning", ["dtype_contract"]), verdicts


def test_report_json_carries_the_same_findings_and_parameters(tmp_path: Path) -> None:
    _write_attributed(tmp_path)
    data = precision_report.report_json(str(tmp_path))
    assert data["verdict"] == "problem" and data["ranks"] == [0, 1] and data["steps"] == 4, data
    by_check = {f["check"]: f for f in data["findings"]}
    assert set(by_check) == {"nonfinite", "unstepped_weights", "dtype_contract"}, sorted(by_check)
    first = by_check["nonfinite"]["first_nonfinite"]
    assert (first["step"], first["param"], first["ranks"], first["tensor"]) == (
        3,
        "blocks.1.fc1.weight",
        [1],
        "main_grad",
    )
    (unstepped,) = by_check["unstepped_weights"]["parameters"]
    assert (unstepped["param"], unstepped["value"], unstepped["cause"]) == (
        "blocks.0.proj.weight",
        4.0,
        "not_in_optimizer",
    )
    (violation,) = by_check["dtype_contract"]["violations"]
    assert (violation["param"], violation["state"], violation["actual"], violation["ranks"]) == (
        "head.weight",
        "exp_avg_sq",
        "bfloat16",
        [0, 1],
    )
    import json

    json.dumps(data)  # plain data throughout


def _write_iterations(
    directory: Path,
    ranks: dict[int, list[tuple[str, int, dict]]],
    events: dict[int, list[tuple[str, dict]]] | None = None,
    diagnostics: dict[int, dict] | None = None,
) -> None:
    """Per rank, spans in order: ``(name, step, extra attributes)`` (a step, a skipped step,
    checks); on the step span of each step in ``events`` those events (the same on every rank,
    the rank added), and a precision child on each step in ``diagnostics``."""
    for rank, spans in ranks.items():
        provider, tracer = _rank_tracer(directory, rank, len(ranks))
        for name, step, attributes in spans:
            with tracer.start_as_current_span(name, attributes={"fsdp.step": step, **attributes}) as span:
                if name != "fsdp.optimizer.step":
                    continue
                for event, event_attributes in (events or {}).get(step, []):
                    span.add_event(event, {**event_attributes, "fsdp.rank": rank})
                if step in (diagnostics or {}):
                    with tracer.start_as_current_span("fsdp.optimizer.precision") as child:
                        child.set_attributes({**HEALTHY, **(diagnostics or {})[step]})
        provider.shutdown()


def _steps(count: int) -> list[tuple[str, int, dict]]:
    return [("fsdp.optimizer.step", s, {"fsdp.backward.count": 1}) for s in range(1, count + 1)]


def _origin_event(step: int, stage: str, where: str) -> tuple[str, dict]:
    return (
        "fsdp.precision.origin",
        {
            "fsdp.step": step,
            "fsdp.origin.stage": stage,
            "fsdp.origin.where": where,
            "fsdp.origin.dtype": "float16",
            "fsdp.nonfinite.kind": "nan",
            "fsdp.microbatch": 0,
            "fsdp.origin.refined": False,
        },
    )


JUMP = (
    "fsdp.optimizer.lr_jump",
    {"fsdp.step": 3, "fsdp.param_group": 0, "fsdp.lr.before": 1e-3, "fsdp.lr.after": 100.0},
)


def test_an_lr_jump_that_a_nan_followed_leads_the_report(tmp_path: Path) -> None:
    """Source: facebookresearch/fairseq#282 (Sometimes my loss explodes). The lr rose 1e5-fold at
    step 3 and the fp16 forward overflowed at step 4: the report leads with the jump and gives the
    origin as what followed; the origin is still the origin of the NaN."""
    # The origin of iteration 4 is read at step 5.
    _write_iterations(
        tmp_path, {r: _steps(6) for r in (0, 1)}, {3: [JUMP], 5: [_origin_event(4, "forward", "blocks.0")]}
    )
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
        ("too late", _origin_event(7, "forward", "blocks.0")),
        ("a write", _origin_event(4, "weight_write", "w")),
        ("before it", _origin_event(2, "forward", "blocks.0")),
        (
            "the batch",
            (
                _origin_event(4, "forward", "")[0],
                {
                    **_origin_event(4, "forward", "")[1],
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
    _write_iterations(tmp_path, {r: _steps(9) for r in (0, 1)}, {3: [JUMP], origin[1]["fsdp.step"] + 1: [origin]})
    report = precision_report.report_json(str(tmp_path))
    got = [f["check"] for f in report["findings"]]
    assert got == ["origin"], f"{case}: want the origin alone, got {got}"


def test_grads_zeroed_before_the_step_name_the_cause_of_zero_grads(tmp_path: Path) -> None:
    """Source: facebookresearch/fairscale#263 (grad norms become inf with OSS / fp16). Step 3's grads
    were zeroed after the backward (a clip of an Inf norm): the report names that, with the units
    and ranks, and not "all gradients are zero" with its advice of a detached loss."""
    zeroed = ("fsdp.precision.grads_zeroed", {"fsdp.step": 3, "fsdp.grads_zeroed.units": "(root), blocks.0"})
    _write_iterations(tmp_path, {r: _steps(6) for r in (0, 1)}, {4: [zeroed]}, {3: {"fsdp.precision.grad.amax": 0.0}})
    report = precision_report.report_json(str(tmp_path))
    got = ([(f["check"], f["first_step"]) for f in report["findings"]], report["verdict"])
    assert got == ([("grads_zeroed", 3)], "warning"), f"want the zeroing alone, got {got}"
    text = precision_report.report(str(tmp_path))
    assert "1 iteration(s) (steps 3); units (root), blocks.0; ranks 0, 1" in text, text
    assert "clip" in report["findings"][0]["advice"], report["findings"][0]
    # Without the event, zero grads are reported as such.
    _write_iterations(tmp_path / "plain", {r: _steps(6) for r in (0, 1)}, {}, {3: {"fsdp.precision.grad.amax": 0.0}})
    got_plain = [f["check"] for f in precision_report.report_json(str(tmp_path / "plain"))["findings"]]
    assert got_plain == ["grad_zero"], got_plain


def test_backward_passes_no_step_followed_are_a_finding(tmp_path: Path) -> None:
    """A run whose backward passes no optimizer step followed (a step never called, or called on
    another optimizer) and no GradScaler skipped: the report names it, which a run with its steps does
    not (its last backward passes are followed by a step)."""
    _write_iterations(
        tmp_path / "none", {r: [("fsdp.optimizer.checks", 0, {"fsdp.backward.count": 5})] for r in (0, 1)}
    )
    report = precision_report.report_json(str(tmp_path / "none"))
    got = ([f["check"] for f in report["findings"]], report["iterations"]["backward_without_steps"], report["verdict"])
    assert got == (["no_optimizer_steps"], 5, "problem"), f"want the finding over 5 backward passes, got {got}"
    stepped = [("fsdp.optimizer.step", s, {"fsdp.backward.count": 1}) for s in (1, 2)]
    _write_iterations(
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
    _write_iterations(tmp_path, {0: steps + skipped, 1: steps + skipped})
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
        return [*_steps(skip_at - 1), *skipped, *[s for s in _steps(5) if s[1] >= skip_at]]

    _write_iterations(tmp_path, {early: spans(4), 1 - early: spans(6)})
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
    jumps[5] = [_origin_event(4, "forward", "blocks.0")]
    _write_iterations(tmp_path, {r: _steps(6) for r in (0, 1)}, jumps)
    report = precision_report.report_json(str(tmp_path))
    got = [(f["check"], f["first_step"]) for f in report["findings"]]
    assert got == [("lr_jump", 2), ("origin", 4)], f"want the x1e5 jump at step 2, then the origin; got {got}"
    assert "jumped x1e+05" in report["findings"][0]["finding"], report["findings"][0]


@pytest.mark.parametrize("lines", [1, 2])
def test_a_finding_is_dated_at_the_first_step_it_fired_on(tmp_path: Path, lines: int) -> None:
    """NaN/Inf at steps 3, 5 and 8 of 10: the finding is from step 3, with the steps on one line
    (3 and 5 in it) or on two (3 and 5 on the first, 8 on the second)."""
    nonfinite = {"fsdp.precision.nonfinite": 2}
    _write(tmp_path, {s: nonfinite if s in (3, 5, 8) else {} for s in range(1, 11)}, steps=10)
    report = precision_report.report_json(str(tmp_path), max_lines=lines)
    got = [(f["check"], f["first_step"]) for f in report["findings"]]
    assert got == [("nonfinite", 3)], f"{lines} line(s): want the finding from step 3, got {got}"


def _write_shadowed(directory: Path, modules: dict[int, list[tuple[str, float, float]]]) -> None:
    """Steps 1-4 on 2 ranks, diagnosed; ``fsdp.precision.shadow`` events as the observer writes them:
    per step, ``(module, error, weight_error)`` (rank 1's errors half rank 0's)."""
    import torch
    from fsdp_patch.telemetry import semconv
    from fsdp_patch.telemetry.diagnostics.module_shadow import ModuleCost
    from fsdp_patch.telemetry.instrumentation.module_shadows import event_attributes

    for rank in range(2):
        provider, tracer = _rank_tracer(directory, rank, 2)
        for step in range(1, 5):
            with tracer.start_as_current_span(semconv.SPAN_STEP, attributes={semconv.ATTR_STEP: step}) as span:
                with tracer.start_as_current_span(semconv.SPAN_PRECISION) as child:
                    child.set_attributes(HEALTHY)
                for order, (module, error, weight_error) in enumerate(modules.get(step, [])):
                    cost = ModuleCost(
                        module,
                        "Linear",
                        torch.bfloat16,
                        error / (rank + 1),
                        weight_error / (rank + 1),
                        2**-8,
                        1e-3,
                        0.0,
                        0,
                        1,
                        64,
                    )
                    span.add_event(semconv.EVENT_SHADOW, event_attributes(cost, step, rank, order))
        provider.shutdown()


def test_the_report_names_the_module_whose_float32_shadow_differs_and_ranks_the_last_shadow(tmp_path: Path) -> None:
    _write_shadowed(
        tmp_path,
        {
            2: [("blocks.0.fc1", 0.004, 0.0), ("blocks.1.gain", 0.004, 0.004)],
            4: [("blocks.1.gain", 0.9, 0.85), ("blocks.0.fc1", 0.004, 0.0)],
        },
    )
    text = precision_report.report(str(tmp_path))
    want_line = "float32 shadow, step 4: where low precision costs most: blocks.1.gain (Linear, bfloat16) 230x rounding"
    assert want_line in text, text
    assert "overall: warning: a module whose output is far from its float32 recompute" in text, text
    assert "module 'blocks.1.gain' (Linear, bfloat16) at step 4: differs from float32 by 0.9 (230x" in text, text
    assert "0.85 of it from its compute weights" in text, text
    data = precision_report.report_json(str(tmp_path))
    findings = [(f["check"], f["first_step"]) for f in data["findings"]]
    assert findings == [("shadow_precision", 4)], f"want the shadow's finding at step 4 alone, got {findings}"
    got = [(s["step"], s["module"], s["costly"], s["ranks"]) for s in data["shadow"]]
    want = [
        (2, "blocks.0.fc1", False, [0, 1]),
        (2, "blocks.1.gain", False, [0, 1]),
        (4, "blocks.1.gain", True, [0, 1]),
        (4, "blocks.0.fc1", False, [0, 1]),
    ]
    assert got == want, f"per step, costliest first, the worst rank's values and every rank: want {want}, got {got}"
    assert data["shadow"][2]["error"] == 0.9, f"the worst rank's error: {data['shadow'][2]}"


def test_a_shadow_within_rounding_is_no_finding(tmp_path: Path) -> None:
    _write_shadowed(tmp_path, {2: [("blocks.0.fc1", 0.02, 0.0)]})  # 5x bf16 rounding: not 8x
    data = precision_report.report_json(str(tmp_path))
    assert data["findings"] == [], f"want no finding, got {data['findings']}"
    assert "float32 shadow, step 2" in precision_report.report(str(tmp_path))
