"""The precision report on trace files written by the real exporter, with chosen diagnostic values:
a verdict per range of steps, each threshold's finding, failed steps, the parameters behind each
finding (text and JSON), a finding dated at its first step.

End to end on the demo's planted scenarios: tests/cli/test_installed_command.py. The per-iteration
checks' findings: test_precision_report_iterations.py; the float32 shadow's:
test_precision_report_shadow.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from fsdp_patch.telemetry import precision_thresholds
from fsdp_patch.telemetry.offline import precision_report
from fsdp_patch.telemetry.offline.trace_reading import TraceFileError
from report_traces import HEALTHY, range_verdicts, rank_tracer, write_steps


def test_healthy_run_is_healthy_on_every_line(tmp_path: Path) -> None:
    write_steps(tmp_path, {s: {} for s in (1, 5, 10)}, steps=12)
    got = range_verdicts(tmp_path)
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
    write_steps(tmp_path, diagnostics, steps=14)
    got = range_verdicts(tmp_path, lines=14)
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
    write_steps(tmp_path, diagnostics, steps=20, ranks=1)
    run = precision_report.read_run(str(tmp_path))
    lines = precision_report.range_lines(run, 4)
    got = [(line.first, line.last, line.values["fsdp.precision.update.lost_ratio"]) for line in lines]
    assert got == [(1, 5, 0.05), (6, 10, 0.10), (11, 15, 0.15), (16, 20, 0.20)], got
    assert lines[1].values["fsdp.precision.refresh.error"] == HEALTHY["fsdp.precision.refresh.error"]


def test_failed_steps_are_counted_in_their_range(tmp_path: Path) -> None:
    write_steps(tmp_path, {1: {}, 10: {}}, steps=10, failed=(4, 7), ranks=1)
    got = range_verdicts(tmp_path)
    assert got == [(1, 1, "healthy", []), (2, 10, "warning", ["failed_steps"])], got
    lines = precision_report.range_lines(precision_report.read_run(str(tmp_path)))
    assert lines[1].failed == 2, f"failed steps counted: {lines[1].failed}, want 2"


def test_step_offset_shows_global_steps_of_a_resumed_run(tmp_path: Path) -> None:
    write_steps(tmp_path, {1: {}, 4: {"fsdp.precision.update.lost_ratio": 0.99}}, steps=4, ranks=1)
    text = precision_report.report(str(tmp_path), step_offset=6)
    assert "  7-7 " in text and "  8-10 " in text and "from step 10" in text, text


def test_no_diagnostics_says_how_to_turn_them_on(tmp_path: Path) -> None:
    write_steps(tmp_path, {}, steps=3, ranks=1)
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
        provider, tracer = rank_tracer(directory, rank, ranks)
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
    verdicts = range_verdicts(tmp_path)
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


@pytest.mark.parametrize("lines", [1, 2])
def test_a_finding_is_dated_at_the_first_step_it_fired_on(tmp_path: Path, lines: int) -> None:
    """NaN/Inf at steps 3, 5 and 8 of 10: the finding is from step 3, with the steps on one line
    (3 and 5 in it) or on two (3 and 5 on the first, 8 on the second)."""
    nonfinite = {"fsdp.precision.nonfinite": 2}
    write_steps(tmp_path, {s: nonfinite if s in (3, 5, 8) else {} for s in range(1, 11)}, steps=10)
    report = precision_report.report_json(str(tmp_path), max_lines=lines)
    got = [(f["check"], f["first_step"]) for f in report["findings"]]
    assert got == [("nonfinite", 3)], f"{lines} line(s): want the finding from step 3, got {got}"
