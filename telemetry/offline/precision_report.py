"""The precision report: a verdict per step range from a run's trace files.

Reads the ``fsdp.optimizer.precision`` spans (their attributes hold the step's diagnostics,
already reduced over ranks) and the ``fsdp.optimizer.step`` spans (step numbers, and steps
that raised) from every rank's trace files, rotated segments included, streaming. Each line
covers a range of steps and shows the worst value of each diagnostic in it, judged with
:mod:`fsdp_patch.telemetry.precision_thresholds` (the thresholds of the Prometheus alerts);
the report ends with where to look next for each finding.

No torch and no OpenTelemetry here: ``fsdp-patch report TRACE_DIR`` works on any machine the
files are copied to.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

from .. import precision_thresholds as thresholds
from .. import semconv, trace_limits
from .attribution_report import AttributionTrace, details, details_json
from .headroom_report import HeadroomTrace, forecast_json, forecast_text
from .op_report import OpSeen, OpTrace, op_json, op_text, place
from .origin_report import OriginSeen, OriginTrace, advice, divergence_json, divergence_text, origin_json, origin_text
from .shadow_report import ShadowTrace, costliest_text, shadow_json, shadow_text
from .trace_reading import TraceFileError, iter_events, rank_segments

# -- Names read from the trace ---------------------------------------------------------
# Span names and attribute keys come from semconv; the precision span's attributes are named
# after the metrics they mirror (docs/conventions.md).
RESOURCE_SERVICE = "service.name"  # OpenTelemetry's own resource attribute
# Written by the trace-file exporter next to the span attributes.
SPAN_ID, PARENT_SPAN_ID, STATUS, STATUS_DESCRIPTION = "span_id", "parent_span_id", "status", "status_description"
RESOURCE = "otel.resource"

# Report columns: (attribute, header, format).
COLUMNS: tuple[tuple[str, str, str], ...] = (
    (semconv.METRIC_NONFINITE, "nonfinite", "{:>9.0f}"),
    (semconv.METRIC_REFRESH_OVERFLOW, "overflow", "{:>8.0f}"),
    (semconv.METRIC_REFRESH_UNDERFLOW, "underflow", "{:>9.0f}"),
    (semconv.METRIC_REFRESH_ERROR, "refresh err", "{:>11.3g}"),
    (semconv.METRIC_LOST_RATIO, "lost upd", "{:>8.3f}"),
    (semconv.METRIC_GRAD_AMAX, "grad amax", "{:>9.3g}"),
)
DEFAULT_MAX_LINES = 10
# Judged but not shown as columns: the attribution's whole-model values (its parameters are named
# under "where to look next").
JUDGED = (*(key for key, _, _ in COLUMNS), *semconv.ATTRIBUTION_SPAN_ATTRIBUTES)
NAMED_PER_FINDING = 5
WHERE_TRACE_FILES_COME_FROM = (
    "trace files are written by runs with telemetry on whose OTEL_TRACES_EXPORTER is unset or lists trace_file, "
    "into FSDP_PATCH_TRACE_DIR (default fsdp_patch_traces)"
)


@dataclass
class RunTrace:
    """What a run's trace files say about precision.

    Attributes:
        samples: Diagnostics by step number (the worst value over ranks and optimizers).
        failed_steps: Steps whose span ended with status ERROR, with the first description.
        first_step: Lowest step number seen (above 1 when the files no longer hold the first steps).
        last_step: Highest step number seen.
        ranks: Ranks whose files were read.
        rotated_ranks: Ranks whose files include an older, rotated segment (``rank{R}.1.trace.json``).
        world_size: World size from the files' resource, when present.
        service: Service name from the files' resource, when present.
        files: Files read.
        attribution: The parameters the attribution's events name.
        iterations: What the per-iteration checks recorded: origins, skipped iterations, backward passes.
        ops: What the operation audits named.
        headroom: The units forecast to reach their dtype's largest value.
        shadow: What the float32 shadows measured of each module.
    """

    samples: dict[int, dict[str, float]] = field(default_factory=dict)
    failed_steps: dict[int, str] = field(default_factory=dict)
    first_step: int = 0
    last_step: int = 0
    ranks: set[int] = field(default_factory=set)
    rotated_ranks: set[int] = field(default_factory=set)
    world_size: int | None = None
    service: str | None = None
    files: list[str] = field(default_factory=list)
    attribution: AttributionTrace = field(default_factory=AttributionTrace)
    iterations: OriginTrace = field(default_factory=OriginTrace)
    ops: OpTrace = field(default_factory=OpTrace)
    headroom: HeadroomTrace = field(default_factory=HeadroomTrace)
    shadow: ShadowTrace = field(default_factory=ShadowTrace)


def _number(value: object) -> float | None:
    # The trace file writes non-finite floats as strings ("nan", "inf"): JSON has no literal for them.
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None


def _worse(old: float | None, new: float) -> float:
    if old is None or math.isnan(old):
        return new
    return old if math.isnan(new) else max(old, new)


def read_run(directory: str) -> RunTrace:
    """Read the steps and diagnostics of every ``rank*.trace.json`` in ``directory``.

    Raises:
        TraceFileError: Not a directory, no trace file in it, or a file that is not a Chrome trace.
    """
    try:
        segments = rank_segments(directory)
    except TraceFileError as exc:
        raise TraceFileError(f"{exc}; {WHERE_TRACE_FILES_COME_FROM}") from None
    if not segments:
        raise TraceFileError(f"{directory} holds no rank*.trace.json file; {WHERE_TRACE_FILES_COME_FROM}")
    run = RunTrace()
    step_of_span: dict[str, int] = {}
    precision: list[tuple[str | None, dict[str, float]]] = []
    precision_parent: dict[str, str | None] = {}
    for segment in segments:
        run.ranks.add(segment.rank)
        run.files.append(segment.path)
        if segment.age:
            run.rotated_ranks.add(segment.rank)
        for event in iter_events(segment.path):
            args = event.get("args") or {}
            if event.get("ph") == "M" and event.get("name") == "process_name":
                resource = args.get(RESOURCE) or {}
                run.world_size = resource.get(semconv.RESOURCE_WORLD_SIZE, run.world_size)
                coordinate = resource.get(semconv.RESOURCE_MESH_COORDINATE)
                if coordinate:
                    run.iterations.coordinates.setdefault(segment.rank, str(coordinate))
                run.service = resource.get(RESOURCE_SERVICE, run.service)
            elif event.get("ph") == "X" and event.get("name") in (semconv.SPAN_SKIPPED_STEP, semconv.SPAN_CHECKS):
                run.iterations.feed_span(str(event["name"]), args, segment.rank, float(event.get("ts") or 0))
            elif (
                event.get("ph") == "X"
                and event.get("name") == semconv.SPAN_STEP
                and isinstance(args.get(semconv.ATTR_STEP), int)
            ):
                run.iterations.feed_span(semconv.SPAN_STEP, args, segment.rank, float(event.get("ts") or 0))
                step = args[semconv.ATTR_STEP]
                step_of_span[args.get(SPAN_ID, "")] = step
                run.first_step = min(run.first_step, step) if run.first_step else step
                run.last_step = max(run.last_step, step)
                if args.get(STATUS) == "ERROR":
                    run.failed_steps.setdefault(step, str(args.get(STATUS_DESCRIPTION, "")))
            elif event.get("ph") == "X" and event.get("name") == semconv.SPAN_PRECISION:
                precision_parent[str(args.get(SPAN_ID, ""))] = args.get(PARENT_SPAN_ID)
                values = {key: v for key in JUDGED if (v := _number(args.get(key))) is not None}
                if values:
                    precision.append((args.get(PARENT_SPAN_ID), values))
            elif event.get("ph") == "i":
                run.attribution.feed(event)
                run.iterations.feed_instant(args, str(event.get("name", "")))
                run.ops.feed_instant(args, str(event.get("name", "")))
                run.headroom.feed_instant(args, str(event.get("name", "")))
                run.shadow.feed_instant(args, str(event.get("name", "")))
    for parent, values in precision:
        # The step span ends after its precision child, possibly in the next (still kept) segment;
        # a parent rotated away belongs to the oldest, dropped steps.
        step = step_of_span.get(parent or "")
        if step is None:
            continue
        sample = run.samples.setdefault(step, {})
        for key, value in values.items():
            sample[key] = _worse(sample.get(key), value)
    steps_of_precision = {
        span: step_of_span[parent]
        for span, parent in precision_parent.items()
        if parent is not None and parent in step_of_span
    }
    run.attribution.resolve(steps_of_precision)
    return run


@dataclass
class Finding:
    """A threshold crossed in a step range."""

    threshold: thresholds.Threshold
    first_step: int


@dataclass
class RangeLine:
    """One line of the report: steps ``first``..``last`` and their worst values."""

    first: int
    last: int
    values: dict[str, float]
    failed: int
    findings: list[Finding]

    @property
    def verdict(self) -> str:
        return thresholds.worst([f.threshold.severity for f in self.findings])


def _judge(
    samples: list[tuple[int, dict[str, float]]], failed: list[int], contract: Sequence[int] = ()
) -> list[Finding]:
    first_fired: dict[str, int] = {}
    for step, values in samples:
        fired = {t.check for t in thresholds.THRESHOLDS if t.metric in values and t.fires(values[t.metric])}
        for threshold in thresholds.THRESHOLDS:
            if threshold.check in fired and threshold.unless not in fired:
                first_fired.setdefault(threshold.check, step)
    findings = [Finding(thresholds.BY_CHECK[check], step) for check, step in first_fired.items()]
    if failed:
        findings.append(Finding(thresholds.FAILED_STEPS, min(failed)))
    if contract:
        findings.append(Finding(thresholds.DTYPE_CONTRACT, min(contract)))
    return findings


def _chunks(steps: list[int], count: int) -> list[list[int]]:
    size, extra = divmod(len(steps), count)
    out, start = [], 0
    for index in range(count):
        end = start + size + (1 if index < extra else 0)
        if end > start:
            out.append(steps[start:end])
        start = end
    return out


def range_lines(run: RunTrace, max_lines: int = DEFAULT_MAX_LINES) -> list[RangeLine]:
    """Split the diagnosed steps into at most ``max_lines`` contiguous ranges and judge each."""
    steps = sorted(run.samples)
    lines: list[RangeLine] = []
    # The first range starts where the files do: steps before it are not in them (rotated away).
    previous_last = min(run.first_step or 1, steps[0] if steps else 1) - 1
    chunks = _chunks(steps, max(1, min(max_lines, len(steps))))
    for index, chunk in enumerate(chunks):
        first = previous_last + 1
        last = run.last_step if index == len(chunks) - 1 else chunk[-1]
        samples = [(step, run.samples[step]) for step in chunk]
        values: dict[str, float] = {}
        for _, sample in samples:
            for key, value in sample.items():
                values[key] = _worse(values.get(key), value)
        failed = [step for step in run.failed_steps if first <= step <= last]
        contract = [v.step for v in run.attribution.violations.values() if first <= v.step <= last]
        lines.append(RangeLine(first, last, values, len(failed), _judge(samples, failed, contract)))
        previous_last = last
    return lines


def _format(key: str, value: float | None, fmt: str) -> str:
    if value is None:
        text = "-"
    elif math.isnan(value):
        text = "nan"
    elif key == semconv.METRIC_GRAD_AMAX and value >= thresholds.GRAD_AMAX_NONFINITE_MARK:
        text = "nan/inf"  # no finite largest |grad|: the value is the diagnostics' marker
    else:
        text = fmt.format(value)
    return text.rjust(len(fmt.format(0)))


def _missing_steps(run: RunTrace, step_offset: int) -> str | None:
    """A note saying which steps the files no longer hold, and how to keep them; ``None`` if none are missing."""
    if run.first_step <= 1:
        return None
    first, before = 1 + step_offset, run.first_step - 1 + step_offset
    missing = f"step {first}" if first == before else f"steps {first}-{before}"
    if run.rotated_ranks:
        return (
            f"  note: {missing} are not in these files: they were rotated away to keep each rank's trace files under "
            f"{trace_limits.TRACE_MAX_BYTES} (default 128M), so this report covers steps {run.first_step + step_offset}-"
            f"{run.last_step + step_offset} only. To see a whole run: raise {trace_limits.TRACE_MAX_BYTES} (0: no cap), "
            "or read the fsdp.precision.* metrics (Prometheus/OTLP), which cover every step."
        )
    return f"  note: {missing} are not in these files (they begin at step {run.first_step + step_offset})."


def iteration_findings(run: RunTrace) -> list[Finding]:
    """What the per-iteration checks found: where the first NaN/Inf began, HSDP replicas that
    differ, a GradScaler skipping many iterations, backward passes with no optimizer step."""
    found: list[Finding] = []
    first = run.iterations.first()
    if first is not None:
        found.append(Finding(thresholds.NAN_ORIGIN, first.step))
        jump = run.iterations.lr_jump_before(first)
        if jump is not None:
            found.append(Finding(thresholds.LR_JUMP, jump.step))
    zeroed = run.iterations.zeroed_steps()
    if zeroed:
        found.append(Finding(thresholds.GRADS_ZEROED, zeroed[0].step))
    diverged = run.iterations.divergence_steps()
    if diverged:
        found.append(Finding(thresholds.REPLICA_DIVERGENCE, diverged[0].step))
    skipped, iterations, _, _ = run.iterations.skipped()
    if skipped >= thresholds.SCALER_SKIPS_AT_LEAST and skipped > thresholds.SCALER_SKIPS_WARN_SHARE * iterations:
        threshold = thresholds.SCALER_SKIPPED
        if skipped > thresholds.SCALER_SKIPS_PROBLEM_SHARE * iterations:
            threshold = replace(threshold, severity=thresholds.PROBLEM)
        found.append(Finding(threshold, run.iterations.first_skip() or run.first_step or 1))
    if run.iterations.backward_without_steps():
        found.append(Finding(thresholds.NO_OPTIMIZER_STEPS, 1))
    forecasts = run.headroom.forecasts()
    if forecasts:
        found.append(Finding(thresholds.HEADROOM_FORECAST, forecasts[0].step))
    costly = run.shadow.costly()
    if costly:
        found.append(Finding(thresholds.SHADOW_PRECISION, costly[0].step))
    for kind in run.ops.kinds():
        if kind == semconv.OP_KIND_NONFINITE and _origin_operation(run) is not None:
            continue  # named with the origin it refines
        found.append(Finding(thresholds.OP_CHECKS[kind], run.ops.of_kind(kind)[0].step))
    return found


def _origin_operation(run: RunTrace) -> OpSeen | None:
    """The operation where the run's first NaN/Inf began, where an audited iteration saw it."""
    first = run.iterations.first()
    if first is None:
        return None
    return run.ops.first_nonfinite(first.step, before=run.iterations.episode_end(first))


_OP_KIND_OF_CHECK = {threshold.check: kind for kind, threshold in thresholds.OP_CHECKS.items()}


def _origin_lines(run: RunTrace, check: str, step_offset: int) -> list[str]:
    first = run.iterations.first()
    at = run.iterations.coordinates
    lines: list[str] = []
    if check == thresholds.NAN_ORIGIN.check and first is not None:
        lines.append(origin_text(first, step_offset, at))
        lines.extend(f"refined: {origin_text(o, step_offset, at)}" for o in run.iterations.refinements(first)[:3])
        operation = _origin_operation(run)
        if operation is not None:
            lines.append(f"operation: {op_text(operation, step_offset)}")
            lines.append(f"fix: {operation.fix}")
    elif check == thresholds.HEADROOM_FORECAST.check:
        lines.extend(forecast_text(f, step_offset) for f in run.headroom.forecasts()[:NAMED_PER_FINDING])
    elif check == thresholds.SHADOW_PRECISION.check:
        lines.extend(shadow_text(seen, step_offset) for seen in run.shadow.costly()[:NAMED_PER_FINDING])
    elif check in _OP_KIND_OF_CHECK:
        for seen in run.ops.of_kind(_OP_KIND_OF_CHECK[check])[:NAMED_PER_FINDING]:
            lines.append(op_text(seen, step_offset))
    elif check == thresholds.SCALER_SKIPPED.check:
        skipped, iterations, scale_first, scale_last = run.iterations.skipped()
        where = f"; the first overflow: {origin_text(first, step_offset, at)}" if first is not None else ""
        lines.append(
            f"skipped {skipped} of {iterations} iterations; scale {scale_first:g} at the first skip, "
            f"{scale_last:g} at the last{where}"
        )
    elif check == thresholds.NO_OPTIMIZER_STEPS.check:
        lines.append(f"{run.iterations.backward_without_steps()} backward passes, 0 optimizer steps, 0 skipped")
    elif check == thresholds.LR_JUMP.check and first is not None:
        lines.append(f"then: {origin_text(first, step_offset, at)}")
    elif check == thresholds.REPLICA_DIVERGENCE.check and run.iterations.divergence:
        lines.append(divergence_text(run.iterations.divergence_steps(), step_offset))
    elif check == thresholds.GRADS_ZEROED.check:
        zeroed = run.iterations.zeroed_steps()
        steps = ", ".join(str(z.step + step_offset) for z in zeroed[:10]) + (", ..." if len(zeroed) > 10 else "")
        ranks = ", ".join(str(r) for r in sorted(set().union(*(z.ranks for z in zeroed)))) or "?"
        lines.append(f"{len(zeroed)} iteration(s) (steps {steps}); units {zeroed[0].units}; ranks {ranks}")
    return lines


def _no_fp32_master(run: RunTrace, finding: Finding) -> bool:
    """Whether every unstepped parameter named is so because its main weight is low precision."""
    if finding.threshold.check != "unstepped_weights":
        return False
    named = run.attribution.worst(semconv.DIAGNOSTIC_UNSTEPPED, 1000, first=finding.first_step)
    return bool(named) and all(n.cause == semconv.UNSTEPPED_LOW_PRECISION_MASTER for n, _ in named)


NO_FP32_MASTER_FINDING = "no fp32 master weights: updates below the main dtype's resolution round away"
NO_FP32_MASTER_ADVICE = (
    "the parameters named get grads, and their bfloat16/float16 main weights do not change: an update smaller than "
    "half the main dtype's spacing at the weight's magnitude (2^-8 of it in bfloat16) is lost at every step. Keep "
    "fp32 main weights (fully_shard: MixedPrecisionPolicy(main_params_dtype=torch.float32); torch FSDP2: fp32 "
    "parameters with MixedPrecisionPolicy(param_dtype=torch.bfloat16)) instead of model.bfloat16() on the optimizer's "
    "parameters."
)


def _advice(run: RunTrace, finding: Finding) -> str:
    if finding.threshold.check in _OP_KIND_OF_CHECK:
        return run.ops.of_kind(_OP_KIND_OF_CHECK[finding.threshold.check])[0].fix
    first = run.iterations.first()
    if finding.threshold.check == thresholds.NAN_ORIGIN.check and first is not None:
        return advice(first)
    if _no_fp32_master(run, finding):
        return NO_FP32_MASTER_ADVICE
    return finding.threshold.advice


def _finding_text(run: RunTrace, finding: Finding) -> str:
    if finding.threshold.check in _OP_KIND_OF_CHECK:
        return f"{finding.threshold.finding}: {place(run.ops.of_kind(_OP_KIND_OF_CHECK[finding.threshold.check])[0])}"
    first = run.iterations.first()
    if finding.threshold.check == thresholds.NAN_ORIGIN.check and first is not None:
        operation = _origin_operation(run)
        at = f", at {place(operation)}" if operation is not None else ""
        return f"NaN/Inf began in {_stage_phrase(first)}{at}"
    jump = run.iterations.lr_jump_before(first) if first is not None else None
    if finding.threshold.check == thresholds.LR_JUMP.check and jump is not None and first is not None:
        return (
            f"the learning rate jumped x{jump.after / jump.before:.3g} ({jump.before:g} to {jump.after:g}, param "
            f"group {jump.group}) at step {jump.step}, then NaN/Inf began in {_stage_phrase(first)} at step "
            f"{first.step}"
        )
    if _no_fp32_master(run, finding):
        return NO_FP32_MASTER_FINDING
    return finding.threshold.finding


def _stage_phrase(origin: OriginSeen) -> str:
    return origin_text(origin).split(" began in ", 1)[1].split(" at step ", 1)[0]


def _all_findings(run: RunTrace, lines: list[RangeLine]) -> list[Finding]:
    findings: dict[str, Finding] = {}
    for finding in iteration_findings(run):
        findings.setdefault(finding.threshold.check, finding)
    for line in lines:
        for finding in line.findings:
            findings.setdefault(finding.threshold.check, finding)
    if any(_no_fp32_master(run, f) for f in findings.values()):
        # The optimizer's own updates lost in bfloat16/float16 main weights and state are what that
        # finding names (with its fix); the audit's operations inside the optimizer say it again.
        for kind, threshold in thresholds.OP_CHECKS.items():
            seen = run.ops.of_kind(kind)
            if seen and all(s.phase == "optimizer" for s in seen):
                findings.pop(threshold.check, None)
    zeroed = {z.step for z in run.iterations.zeroed_steps()}
    grad_zero = findings.get("grad_zero")
    if grad_zero is not None and grad_zero.first_step in zeroed:
        # Zero grads at the step are what the zeroing left: its finding names the cause, this
        # one's advice (a detached loss, frozen parameters) would lead away from it.
        del findings["grad_zero"]
    return _ordered(findings.values())


def _ordered(findings: Iterable[Finding]) -> list[Finding]:
    return sorted(findings, key=lambda f: thresholds.precedence(f.threshold, f.first_step))


def _verdict_text(line: RangeLine) -> str:
    verdict = line.verdict
    if verdict == thresholds.HEALTHY:
        return verdict
    return f"{verdict}: " + "; ".join(f.threshold.finding for f in _ordered(line.findings))


def render(run: RunTrace, lines: list[RangeLine], source: str, step_offset: int = 0) -> str:
    """The report as text.

    Args:
        run: What :func:`read_run` read.
        lines: The judged ranges.
        source: Where the traces came from (for the header).
        step_offset: Added to every step number shown: steps this process's optimizer counts
            from 1 after a resume from step ``step_offset``.
    """
    ranks = ", ".join(str(r) for r in sorted(run.ranks))
    of = f" of {run.world_size}" if run.world_size else ""
    last = run.last_step + step_offset
    kept = f", steps {run.first_step + step_offset}-{last} in these files" if run.first_step > 1 else ""
    out = [
        f"precision report: {source} (rank{'s' if len(run.ranks) > 1 else ''} {ranks}{of}, "
        f"{run.last_step} optimizer step{'s' if run.last_step != 1 else ''}{kept}, diagnostics on {len(run.samples)})"
    ]
    missing = _missing_steps(run, step_offset)
    if missing:
        out.append(missing)
    accounting = _accounting(run)
    if accounting:
        out.append(accounting)
    ordered = _all_findings(run, lines)
    if not lines:
        if run.last_step == 0 and run.iterations.skipped()[0]:
            out.append("  no precision diagnostics: they run at optimizer steps, and no step ran")
        else:
            out.append(
                "  no precision diagnostics in these traces: they run on steps 1-3, 5, 10, 20, 50 and every "
                "FSDP_PATCH_PRECISION_EVERY steps (0 turns them off), and need telemetry on (FSDP_PATCH_TELEMETRY=1) with a traced rank."
            )
        if not ordered:
            return "\n".join(out) + "\n"
    else:
        header = "  {:<13}".format("steps") + " ".join(h.rjust(len(fmt.format(0))) for _, h, fmt in COLUMNS)
        out.append(header + "  failed  verdict")
        for line in lines:
            steps = f"{line.first + step_offset}-{line.last + step_offset}"
            cells = " ".join(_format(key, line.values.get(key), fmt) for key, _, fmt in COLUMNS)
            out.append(f"  {steps:<13}{cells}  {line.failed:>6}  {_verdict_text(line)}")
        out.append("  (each line: the largest value over the range's diagnosed steps; values are over all ranks)")
    costliest = costliest_text(run.shadow, step_offset)
    if costliest:
        out.append(costliest)
    overall = thresholds.worst([f.threshold.severity for f in ordered])
    if not ordered:
        out.append("overall: healthy (no threshold of telemetry/README.md's precision report crossed)")
        return "\n".join(out) + "\n"
    lead = ordered[0]
    out.append(f"overall: {overall}: {_finding_text(run, lead)}, from step {lead.first_step + step_offset}")
    out.append("where to look next:")
    for finding in ordered:
        threshold = finding.threshold
        alert = f" [alert {threshold.alert}]" if threshold.alert else ""
        out.append(
            f"  - {_finding_text(run, finding)} (first at step {finding.first_step + step_offset}){alert}: "
            f"{_advice(run, finding)}"
        )
        for detail in _origin_lines(run, threshold.check, step_offset):
            out.append(f"      {detail}")
        for detail in details(run.attribution, threshold.check, finding.first_step, NAMED_PER_FINDING, step_offset):
            out.append(f"      {detail}")
    return "\n".join(out) + "\n"


def _accounting(run: RunTrace) -> str | None:
    """A line on iterations when some ran no optimizer step: steps, skips, backward passes."""
    skipped, iterations, scale_first, scale_last = run.iterations.skipped()
    if not skipped and not run.iterations.backward_without_steps():
        return None
    backward = max((r.backward for r in run.iterations.ranks.values()), default=0)
    scale = f" (GradScaler scale {scale_first:g} at the first skip, {scale_last:g} at the last)" if skipped else ""
    return f"  iterations: {iterations - skipped} optimizer steps, {skipped} skipped{scale}, {backward} backward passes"


def report(directory: str, max_lines: int = DEFAULT_MAX_LINES, step_offset: int = 0) -> str:
    """Read ``directory``'s trace files and return the precision report.

    Raises:
        TraceFileError: See :func:`read_run`.
    """
    run = read_run(directory)
    return render(run, range_lines(run, max_lines), directory, step_offset)


def report_json(directory: str, max_lines: int = DEFAULT_MAX_LINES, step_offset: int = 0) -> dict[str, object]:
    """The report as plain data (``fsdp-patch report --json``): the same ranges, verdicts and
    findings as the text, and per finding the parameters named.

    Raises:
        TraceFileError: See :func:`read_run`.
    """
    run = read_run(directory)
    lines = range_lines(run, max_lines)
    ordered = _all_findings(run, lines)
    first = run.iterations.first()
    diverged = run.iterations.divergence_steps()
    skipped, iterations, scale_first, scale_last = run.iterations.skipped()

    def clean(value: float) -> float | str:
        return value if math.isfinite(value) else str(value)  # JSON has no NaN/Inf

    return {
        "source": directory,
        "ranks": sorted(run.ranks),
        "world_size": run.world_size,
        "steps": run.last_step + step_offset,
        "diagnosed_steps": len(run.samples),
        "verdict": thresholds.worst([f.threshold.severity for f in ordered]),
        "lines": [
            {
                "first": line.first + step_offset,
                "last": line.last + step_offset,
                "failed": line.failed,
                "values": {key: clean(value) for key, value in line.values.items()},
                "verdict": line.verdict,
                "findings": [f.threshold.check for f in _ordered(line.findings)],
            }
            for line in lines
        ],
        "origin": None
        if first is None
        else {
            **origin_json(first, step_offset),
            "refined": [origin_json(o, step_offset) for o in run.iterations.refinements(first)],
            "operation": None if (operation := _origin_operation(run)) is None else op_json(operation, step_offset),
        },
        "ops": [op_json(seen, step_offset) for kind in run.ops.kinds() for seen in run.ops.of_kind(kind)],
        "headroom_forecasts": [forecast_json(f, step_offset) for f in run.headroom.forecasts()],
        "shadow": [shadow_json(seen, step_offset) for step in run.shadow.steps() for seen in run.shadow.at(step)],
        "mesh_coordinates": {str(rank): c for rank, c in sorted(run.iterations.coordinates.items())},
        "replica_divergence": divergence_json(diverged, step_offset) if diverged else None,
        "iterations": {
            "optimizer_steps": iterations - skipped,
            "skipped": skipped,
            "scale_first": clean(scale_first),
            "scale_last": clean(scale_last),
            "backward_without_steps": run.iterations.backward_without_steps(),
        },
        "findings": [
            {
                "check": f.threshold.check,
                "severity": f.threshold.severity,
                "finding": _finding_text(run, f),
                "first_step": f.first_step + step_offset,
                "alert": f.threshold.alert,
                "advice": _advice(run, f),
                **details_json(run.attribution, f.threshold.check, f.first_step, NAMED_PER_FINDING, step_offset),
            }
            for f in ordered
        ],
    }


def overall_findings(directory: str) -> list[str]:
    """Names of the checks that fired anywhere in ``directory``'s traces (for scripts and tests)."""
    run = read_run(directory)
    return sorted({f.threshold.check for f in _all_findings(run, range_lines(run))})
