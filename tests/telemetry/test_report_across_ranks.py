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
        semconv.ATTR_STEP: step,
        semconv.ATTR_PARAM: param,
        semconv.ATTR_UNIT: unit,
        semconv.ATTR_TENSOR: semconv.TENSOR_MAIN_GRAD,
        semconv.ATTR_RANKS: [rank],
        semconv.ATTR_NONFINITE_KIND: semconv.NONFINITE_NAN,
        semconv.ATTR_PRECISION_ELEMENTS: 1,
        semconv.ATTR_PRECISION_PARAMS: [param],
        semconv.ATTR_PRECISION_PARAMS_COUNT: 1,
    }


def _violation(step: int, rank: int) -> tuple[str, dict[str, Any]]:
    return semconv.EVENT_DTYPE_CONTRACT, {
        semconv.ATTR_STEP: step,
        semconv.ATTR_RANK: rank,
        semconv.ATTR_PARAM: "head.weight",
        semconv.ATTR_UNIT: "",
        semconv.ATTR_TENSOR: semconv.TENSOR_OPTIMIZER_STATE,
        semconv.ATTR_OPTIMIZER_STATE: "exp_avg_sq",
        semconv.ATTR_DTYPE_EXPECTED: "float32",
        semconv.ATTR_DTYPE_ACTUAL: "bfloat16",
    }


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
    fired = [
        (line.first, line.last)
        for line in precision_report.range_lines(run, 8)
        if any(f.threshold.check == "dtype_contract" for f in line.findings)
    ]
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
    got = {
        step: (values[semconv.METRIC_LOST_RATIO], values[semconv.METRIC_NONFINITE])
        for step, values in sorted(run.samples.items())
    }
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
        ]
        for step, value in {2: 0.95, 3: 0.5, 5: 0.95}.items()
    }
    for rank in range(WORLD):
        precision = {s: {semconv.METRIC_LOST_RATIO: 0.95 if s in (2, 5) else 0.5} for s in range(1, 7)}
        _write_rank(tmp_path, rank, range(1, 7), precision=precision, precision_events=offenders)
    (named,) = _findings(tmp_path)["lost_updates"]["parameters"]
    got = (named["param"], named["value"], named["step"])
    assert got == ("head.weight", 0.95, 2), f"named (param, value, step): got {got}, want ('head.weight', 0.95, 2)"


# -- where NaN/Inf began: origins over ranks, episodes and stages ----------------------------------


def _origin(step: int, stage: str, where: str, rank: int, refined: bool = False) -> tuple[str, dict[str, Any]]:
    return semconv.EVENT_ORIGIN, {
        semconv.ATTR_STEP: step,
        semconv.ATTR_RANK: rank,
        semconv.ATTR_ORIGIN_STAGE: stage,
        semconv.ATTR_ORIGIN_WHERE: where,
        semconv.ATTR_ORIGIN_DTYPE: "float16",
        semconv.ATTR_NONFINITE_KIND: semconv.NONFINITE_INF,
        semconv.ATTR_MICROBATCH: 0,
        semconv.ATTR_ORIGIN_REFINED: refined,
    }


def _write_origins(directory: Path, origins: Mapping[int, list[tuple[int, str, str, bool]]], steps: int = 10) -> None:
    """Per rank, its origin events ``(step, stage, where, refined)``, each on the span of the step
    after it (where a run reads an iteration's checks)."""
    for rank in range(WORLD):
        events: dict[int, list[tuple[str, dict[str, Any]]]] = {}
        for step, stage, where, refined in origins.get(rank, []):
            events.setdefault(step + 1, []).append(_origin(step, stage, where, rank, refined))
        _write_rank(directory, rank, range(1, steps + 1), precision={}, step_events=events)


@EARLIER_ON
def test_of_two_episodes_the_origin_is_the_earlier_step_not_the_earlier_stage(tmp_path: Path, early: int) -> None:
    """A reduce-scatter overflow at step 3 (on one rank's shard) and, after finite iterations, a
    forward overflow at step 7 on both ranks: the forward is the earlier stage of an iteration,
    the reduce the earlier step. The report and its JSON lead with the reduce at step 3."""
    _write_origins(
        tmp_path,
        {
            early: [(3, "reduce", "", False), (7, "forward", "blocks.0", False)],
            1 - early: [(7, "forward", "blocks.0", False)],
        },
    )
    report = precision_report.report_json(str(tmp_path))
    origin = report["origin"]
    got = (origin["step"], origin["stage"], origin["where"], origin["ranks"])
    assert got == (3, "reduce", "", [early]), f"JSON origin (step, stage, where, ranks): got {got}"
    lead = (report["findings"][0]["check"], report["findings"][0]["first_step"])
    assert lead == ("origin", 3), f"the report leads with {report['findings'][0]}"
    text = precision_report.report(str(tmp_path))
    want = "overall: problem: NaN/Inf began in the reduce-scatter of the grads, from step 3"
    assert want in text.splitlines(), f"want the line {want!r} in the report:\n{text}"


@EARLIER_ON
def test_at_one_step_the_origin_is_the_earliest_stage_any_rank_saw(tmp_path: Path, early: int) -> None:
    """At step 4 one rank saw its first Inf in blocks.1's forward, the other in blocks.0's backward
    (a name that sorts first): the forward runs first in an iteration, so the origin is the
    forward's, on that rank."""
    _write_origins(
        tmp_path, {early: [(4, "forward", "blocks.1", False)], 1 - early: [(4, "backward", "blocks.0", False)]}
    )
    origin = precision_report.report_json(str(tmp_path))["origin"]
    got = (origin["step"], origin["stage"], origin["where"], origin["ranks"])
    assert got == (4, "forward", "blocks.1", [early]), f"JSON origin (step, stage, where, ranks): got {got}"


@EARLIER_ON
def test_refinements_are_of_the_first_episode_in_the_order_of_their_steps(tmp_path: Path, early: int) -> None:
    """Episode 1 began at step 3 (blocks.0's forward, both ranks); its escalated iterations refined
    it at step 4 (a backward, on one rank) and step 5 (a forward, on the other). Episode 2 began
    at step 8 (the loss) and was refined at step 9. Under the origin: steps 4 then 5, not 9."""
    _write_origins(
        tmp_path,
        {
            early: [
                (3, "forward", "blocks.0", False),
                (4, "backward", "blocks.0.fc2", True),
                (8, "loss", "loss", False),
                (9, "forward", "head", True),
            ],
            1 - early: [
                (3, "forward", "blocks.0", False),
                (5, "forward", "blocks.0.fc1", True),
                (8, "loss", "loss", False),
            ],
        },
    )
    origin = precision_report.report_json(str(tmp_path))["origin"]
    got = [(o["step"], o["stage"], o["where"], o["ranks"]) for o in origin["refined"]]
    want = [(4, "backward", "blocks.0.fc2", [early]), (5, "forward", "blocks.0.fc1", [1 - early])]
    assert got == want, f"JSON refinements of the origin at step 3: got {got}, want {want}"
    text = precision_report.report(str(tmp_path))
    refined = [line.strip().split(":", 2)[1] for line in text.splitlines() if line.strip().startswith("refined:")]
    want_text = [" Inf began in the backward at step 4", " Inf began in the forward at step 5"]
    assert refined == want_text, f"refined lines: got {refined}, want {want_text}:\n{text}"


# -- iterations whose grads were zeroed, replicas that diverged ----------------------------------------


def _zeroed(step: int, units: str, rank: int) -> tuple[str, dict[str, Any]]:
    return semconv.EVENT_GRADS_ZEROED, {
        semconv.ATTR_STEP: step,
        semconv.ATTR_RANK: rank,
        semconv.ATTR_GRADS_ZEROED_UNITS: units,
    }


def _zeroed_line(directory: Path) -> str:
    text = precision_report.report(str(directory))
    return next((line.strip() for line in text.splitlines() if "iteration(s) (steps" in line), text)


@EARLIER_ON
def test_zeroed_grads_are_dated_at_the_earliest_step_any_rank_saw(tmp_path: Path, early: int) -> None:
    """One rank saw blocks.0's grads zeroed at step 2, the other at step 5: the finding is dated at
    step 2 and lists both steps in order."""
    for rank in range(WORLD):
        step = 2 if rank == early else 5
        _write_rank(
            tmp_path, rank, range(1, 8), precision={}, step_events={step + 1: [_zeroed(step, "blocks.0", rank)]}
        )
    first = _findings(tmp_path)["grads_zeroed"]["first_step"]
    assert first == 2, f"grads-zeroed finding first at step {first}, want 2 (rank {early}'s)"
    got = _zeroed_line(tmp_path)
    want = "2 iteration(s) (steps 2, 5); units blocks.0; ranks 0, 1"
    assert got == want, f"want {want!r}, got {got!r}"


@pytest.mark.parametrize("root_on", (0, 1), ids=("root_on_rank0", "root_on_rank1"))
def test_zeroed_grads_name_the_units_of_every_rank(tmp_path: Path, root_on: int) -> None:
    """At step 3 one rank saw the root's grads zeroed, the other the blocks' (its shard of the
    root's grads was 0 already after the reduce): the report names the units of both ranks."""
    for rank in range(WORLD):
        units = "(root)" if rank == root_on else "blocks.0, blocks.1"
        _write_rank(tmp_path, rank, range(1, 6), precision={}, step_events={4: [_zeroed(3, units, rank)]})
    got = _zeroed_line(tmp_path)
    want = "1 iteration(s) (steps 3); units (root), blocks.0, blocks.1; ranks 0, 1"
    assert got == want, f"want {want!r}, got {got!r}"


def _divergence(step: int) -> tuple[str, dict[str, Any]]:
    return semconv.EVENT_REPLICA_DIVERGENCE, {
        semconv.ATTR_STEP: step,
        semconv.ATTR_REPLICA_DIFF: semconv.REPLICA_DIFF_NONFINITE,
        semconv.ATTR_REPLICA_NONFINITE: [0, 4],
        semconv.ATTR_RANKS: [0, 1],
        semconv.ATTR_PRECISION_PARAMS: ["head.weight"],
        semconv.ATTR_PRECISION_PARAMS_COUNT: 1,
    }


@EARLIER_ON
def test_replica_divergence_is_dated_at_the_earliest_step_any_rank_saw(tmp_path: Path, early: int) -> None:
    """One rank's files hold the replicas' divergence at steps 3 and 6, the other's at step 6 only
    (its older steps rotated away): the divergence is reported from step 3."""
    for rank in range(WORLD):
        steps = (3, 6) if rank == early else (6,)
        _write_rank(tmp_path, rank, range(1, 8), precision_events={s: [_divergence(s)] for s in steps})
    report = precision_report.report_json(str(tmp_path))
    divergence = report["replica_divergence"]
    got = (divergence["step"], divergence["steps"], _findings(tmp_path)["replica_divergence"]["first_step"])
    assert got == (3, [3, 6], 3), f"(step, steps, finding's first step): got {got}, want (3, [3, 6], 3)"
    text = precision_report.report(str(tmp_path))
    assert "NaN/Inf counts differ at step 3 (2 diagnosed steps in all): head.weight" in text, text
