"""The precision report over ranks whose trace files disagree: each rank writes its own files, and
they need not hold the same steps (a rank whose files were rotated earlier, a rank that died
early) nor the same findings (ranks sharded over different process groups reduce their
diagnostics over their own group only, and each rank audits its own tensors).

Every merge across ranks is tested here with the disagreeing value on either rank, so that no
order of reading the files makes a wrong merge pass: the earliest step wins and the ranks that
reported it are named; values every rank reduced already are taken at their worst, not added up.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import pytest
from fsdp_patch.telemetry import semconv
from fsdp_patch.telemetry.export import trace_files
from fsdp_patch.telemetry.offline import precision_report
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import Status, StatusCode

WORLD = 2
HEALTHY: dict[str, float] = {
    semconv.METRIC_NONFINITE: 0,
    semconv.METRIC_REFRESH_OVERFLOW: 0,
    semconv.METRIC_REFRESH_UNDERFLOW: 0,
    semconv.METRIC_REFRESH_ERROR: 1.5e-3,
    semconv.METRIC_LOST_RATIO: 0.1,
    semconv.METRIC_GRAD_AMAX: 0.07,
}
Events = Mapping[int, list[tuple[str, dict[str, Any]]]]
# Which rank holds the earlier (or the worse) of two disagreeing values: both, so that neither the
# first nor the last file read can be what the report shows by accident.
EARLIER_ON = pytest.mark.parametrize("early", (0, 1), ids=("earlier_on_rank0", "earlier_on_rank1"))


def _write_rank(
    directory: Path,
    rank: int,
    steps: range,
    precision: Mapping[int, Mapping[str, float]] | None = None,
    precision_events: Events | None = None,
    step_events: Events | None = None,
    failed: Collection[int] = (),
) -> None:
    """One rank's trace file, through the real exporter: a step span for each of ``steps``, with a
    precision child (healthy values, updated by ``precision``) on every step unless ``precision``
    names the steps; events on the precision span and on the step span by step."""
    exporter = trace_files.TraceFileExporter(
        str(directory), rank, {semconv.RESOURCE_WORLD_SIZE: WORLD}, jaeger_at_shutdown=False
    )
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    for step in steps:
        with tracer.start_as_current_span(semconv.SPAN_STEP, attributes={semconv.ATTR_STEP: step}) as span:
            if precision is None or step in precision:
                with tracer.start_as_current_span(semconv.SPAN_PRECISION) as child:
                    child.set_attributes({**HEALTHY, **(precision or {}).get(step, {})})
                    for name, attributes in (precision_events or {}).get(step, []):
                        child.add_event(name, attributes)
            for name, attributes in (step_events or {}).get(step, []):
                span.add_event(name, attributes)
            if step in failed:
                span.set_status(Status(StatusCode.ERROR, f"RuntimeError: rank {rank} failed step {step}"))
    provider.shutdown()


def _first_nonfinite(step: int, param: str, unit: str, rank: int) -> tuple[str, dict[str, Any]]:
    return semconv.EVENT_FIRST_NONFINITE, {
        semconv.ATTR_STEP: step, semconv.ATTR_PARAM: param, semconv.ATTR_UNIT: unit,
        semconv.ATTR_TENSOR: semconv.TENSOR_MAIN_GRAD, semconv.ATTR_RANKS: [rank],
        semconv.ATTR_NONFINITE_KIND: semconv.NONFINITE_NAN, semconv.ATTR_PRECISION_ELEMENTS: 1,
        semconv.ATTR_PRECISION_PARAMS: [param], semconv.ATTR_PRECISION_PARAMS_COUNT: 1,
    }  # fmt: skip


def _violation(step: int, rank: int) -> tuple[str, dict[str, Any]]:
    return semconv.EVENT_DTYPE_CONTRACT, {
        semconv.ATTR_STEP: step, semconv.ATTR_RANK: rank, semconv.ATTR_PARAM: "head.weight", semconv.ATTR_UNIT: "",
        semconv.ATTR_TENSOR: semconv.TENSOR_OPTIMIZER_STATE, semconv.ATTR_OPTIMIZER_STATE: "exp_avg_sq",
        semconv.ATTR_DTYPE_EXPECTED: "float32", semconv.ATTR_DTYPE_ACTUAL: "bfloat16",
    }  # fmt: skip


def _findings(directory: Path) -> dict[str, dict[str, Any]]:
    return {f["check"]: f for f in precision_report.report_json(str(directory))["findings"]}


@EARLIER_ON
def test_first_nonfinite_is_the_earliest_any_rank_recorded(tmp_path: Path, early: int) -> None:
    """Two ranks reduced over different groups: one saw its first NaN grad at step 3, the other
    at step 7. The report's first NaN/Inf is step 3's, with the rank and parameter of that event."""
    late = 1 - early
    firsts = {early: (3, "blocks.0.fc1.weight", "blocks.0"), late: (7, "head.weight", "")}
    for rank, (step, param, unit) in firsts.items():
        _write_rank(
            tmp_path,
            rank,
            range(1, 9),
            precision={s: {semconv.METRIC_NONFINITE: 1 if s >= step else 0} for s in range(1, 9)},
            precision_events={step: [_first_nonfinite(step, param, unit, rank)]},
        )
    text = precision_report.report(str(tmp_path))
    want = f"first NaN/Inf: step 3, rank {early}, blocks.0.fc1.weight (unit 'blocks.0'), main_grad: 1 NaN element"
    assert want in text, f"want {want!r} in the report of first NaN/Infs at step 3 (rank {early}) and 7:\n{text}"
    first = _findings(tmp_path)["nonfinite"]["first_nonfinite"]
    got = (first["step"], first["ranks"], first["param"])
    assert got == (3, [early], "blocks.0.fc1.weight"), f"JSON first NaN/Inf (step, ranks, param): {got}"


@EARLIER_ON
def test_dtype_violation_is_dated_at_the_earliest_rank_and_names_every_rank(tmp_path: Path, early: int) -> None:
    """The same violation reported by one rank at step 2 and by the other at step 5 is one
    violation, from step 2, of both ranks; its finding sits on the line of step 2."""
    for rank in range(WORLD):
        step = 2 if rank == early else 5
        _write_rank(tmp_path, rank, range(1, 9), step_events={step: [_violation(step, rank)]})
    text = precision_report.report(str(tmp_path), max_lines=8)
    want = "head.weight (root unit): optimizer_state 'exp_avg_sq' is bfloat16, expected float32 (step 2, ranks 0, 1)"
    assert want in text, f"want {want!r} in the report of a violation at step 2 (rank {early}) and 5:\n{text}"
    (violation,) = _findings(tmp_path)["dtype_contract"]["violations"]
    got = (violation["step"], violation["ranks"])
    assert got == (2, [0, 1]), f"JSON violation (step, ranks): got {got}, want (2, [0, 1])"
    run = precision_report.read_run(str(tmp_path))
    fired = [(line.first, line.last) for line in precision_report.range_lines(run, 8)
             if any(f.threshold.check == "dtype_contract" for f in line.findings)]  # fmt: skip
    assert fired == [(2, 2)], f"lines with the dtype-contract finding: got {fired}, want [(2, 2)] only"


def test_a_violation_one_rank_reports_names_that_rank_only(tmp_path: Path) -> None:
    for rank in range(WORLD):
        _write_rank(tmp_path, rank, range(1, 5), step_events={3: [_violation(3, 1)]} if rank == 1 else None)
    (violation,) = _findings(tmp_path)["dtype_contract"]["violations"]
    got = (violation["step"], violation["ranks"])
    assert got == (3, [1]), f"JSON violation (step, ranks): got {got}, want (3, [1])"


@EARLIER_ON
def test_each_step_shows_the_worst_value_any_rank_recorded(tmp_path: Path, early: int) -> None:
    """Step 2's lost-update ratio is 0.95 on one rank and 0.1 on the other: the line shows 0.95
    and its finding fires; a count both ranks reduced (3 NaN elements) stays 3, not 6."""
    worse = early
    for rank in range(WORLD):
        lost = 0.95 if rank == worse else 0.1
        _write_rank(
            tmp_path,
            rank,
            range(1, 5),
            precision={2: {semconv.METRIC_LOST_RATIO: lost}, 4: {semconv.METRIC_NONFINITE: 3}},
        )
    run = precision_report.read_run(str(tmp_path))
    got = {step: (values[semconv.METRIC_LOST_RATIO], values[semconv.METRIC_NONFINITE])
           for step, values in sorted(run.samples.items())}  # fmt: skip
    want = {2: (0.95, 0.0), 4: (0.1, 3.0)}
    assert got == want, f"(lost ratio, NaN/Inf elements) by step: got {got}, want {want} (0.95 on rank {worse})"
    checks = _findings(tmp_path)
    lost = checks.get("lost_updates", {}).get("first_step")
    assert lost == 2, f"lost-updates finding first at step {lost}, want 2 (rank {worse}'s 0.95), of {sorted(checks)}"


@EARLIER_ON
def test_failed_steps_of_every_rank_count_once_each(tmp_path: Path, early: int) -> None:
    """Step 4 failed on one rank only, step 7 on both: two failed steps, the first at step 4."""
    for rank in range(WORLD):
        _write_rank(tmp_path, rank, range(1, 9), precision={1: {}}, failed=(4, 7) if rank == early else (7,))
    run = precision_report.read_run(str(tmp_path))
    (line,) = [line for line in precision_report.range_lines(run) if line.last == 8]
    assert line.failed == 2, f"failed steps on the line of steps {line.first}-{line.last}: {line.failed}, want 2"
    first = _findings(tmp_path)["failed_steps"]["first_step"]
    assert first == 4, f"failed-steps finding first at step {first}, want 4 (rank {early}'s failure)"


@EARLIER_ON
def test_the_report_covers_the_steps_of_every_rank(tmp_path: Path, early: int) -> None:
    """One rank's files hold steps 1-6 (it died), the other's 4-10 (its first steps rotated away):
    the report covers steps 1-10 and says no step is missing; step 2's finding, in one rank's
    files only, is named."""
    for rank in range(WORLD):
        steps = range(1, 7) if rank == early else range(4, 11)
        precision = {s: {semconv.METRIC_LOST_RATIO: 0.95 if s == 2 else 0.1} for s in steps}
        _write_rank(tmp_path, rank, steps, precision=precision)
    run = precision_report.read_run(str(tmp_path))
    got = (run.first_step, run.last_step, sorted(run.samples))
    assert got == (1, 10, list(range(1, 11))), f"(first step, last step, diagnosed steps): {got}"
    text = precision_report.report(str(tmp_path))
    assert "10 optimizer steps, diagnostics on 10)" in text and "not in these files" not in text, text
    lost = _findings(tmp_path).get("lost_updates", {}).get("first_step")
    assert lost == 2, f"lost-updates finding first at step {lost}, want 2 (in rank {early}'s files only):\n{text}"


def test_a_parameter_is_dated_at_the_first_step_of_its_worst_value(tmp_path: Path) -> None:
    """head.weight lost 0.95 of its updates at steps 2 and 5 (less in between): named at step 2."""
    offenders = {
        step: [
            (
                semconv.EVENT_OFFENDER,
                {
                    semconv.ATTR_DIAGNOSTIC: semconv.METRIC_LOST_RATIO,
                    semconv.ATTR_PARAM: "head.weight",
                    semconv.ATTR_UNIT: "",
                    semconv.ATTR_VALUE: value,
                },
            )
        ]  # fmt: skip
        for step, value in {2: 0.95, 3: 0.5, 5: 0.95}.items()
    }
    for rank in range(WORLD):
        precision = {s: {semconv.METRIC_LOST_RATIO: 0.95 if s in (2, 5) else 0.5} for s in range(1, 7)}
        _write_rank(tmp_path, rank, range(1, 7), precision=precision, precision_events=offenders)
    (named,) = _findings(tmp_path)["lost_updates"]["parameters"]
    got = (named["param"], named["value"], named["step"])
    assert got == ("head.weight", 0.95, 2), f"named (param, value, step): got {got}, want ('head.weight', 0.95, 2)"
