"""The precision report: a verdict per step range from a run's trace files.

Each line covers a range of steps and shows the worst value of each diagnostic in it (read by
:mod:`.run_trace`, judged by :mod:`.findings` with the thresholds of the Prometheus alerts); the
report ends with where to look next for each finding. ``fsdp-patch report TRACE_DIR`` prints it,
``--json`` gives the same as data, ``--html`` a page of plots (:mod:`.html_report`).

No torch and no OpenTelemetry here: ``fsdp-patch report TRACE_DIR`` works on any machine the
files are copied to.
"""

from __future__ import annotations

import math

from .. import precision_thresholds as thresholds
from .. import semconv, trace_limits
from .attribution_report import details_json
from .findings import (
    DEFAULT_MAX_LINES,
    NAMED_PER_FINDING,
    RangeLine,
    advice_for,
    all_findings,
    finding_details,
    finding_text,
    ordered,
    origin_operation,
    range_lines,
)
from .float8_report import cast_json
from .headroom_report import forecast_json
from .op_report import op_json
from .origin_report import divergence_json, origin_json
from .run_trace import COLUMNS, RunTrace, read_run
from .shadow_report import costliest_text, shadow_json

__all__ = [
    "DEFAULT_MAX_LINES",
    "RunTrace",
    "overall_findings",
    "range_lines",
    "read_run",
    "render",
    "report",
    "report_json",
    "run_json",
]


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


def _verdict_text(line: RangeLine) -> str:
    verdict = line.verdict
    if verdict == thresholds.HEALTHY:
        return verdict
    return f"{verdict}: " + "; ".join(f.threshold.finding for f in ordered(line.findings))


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
    found = all_findings(run, lines)
    if not lines:
        if run.last_step == 0 and run.iterations.skipped()[0]:
            out.append("  no precision diagnostics: they run at optimizer steps, and no step ran")
        else:
            out.append(
                "  no precision diagnostics in these traces: they run on steps 1-3, 5, 10, 20, 50 and every "
                "FSDP_PATCH_PRECISION_EVERY steps (0 turns them off), and need telemetry on (FSDP_PATCH_TELEMETRY=1) with a traced rank."
            )
        if not found:
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
    overall = thresholds.worst([f.threshold.severity for f in found])
    if not found:
        out.append("overall: healthy (no threshold of telemetry/README.md's precision report crossed)")
        return "\n".join(out) + "\n"
    lead = found[0]
    out.append(f"overall: {overall}: {finding_text(run, lead)}, from step {lead.first_step + step_offset}")
    out.append("where to look next:")
    for finding in found:
        threshold = finding.threshold
        alert = f" [alert {threshold.alert}]" if threshold.alert else ""
        out.append(
            f"  - {finding_text(run, finding)} (first at step {finding.first_step + step_offset}){alert}: "
            f"{advice_for(run, finding)}"
        )
        out.extend(f"      {detail}" for detail in finding_details(run, finding, step_offset))
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
    return run_json(run, range_lines(run, max_lines), directory, step_offset)


def run_json(run: RunTrace, lines: list[RangeLine], source: str, step_offset: int = 0) -> dict[str, object]:
    """:func:`report_json` of a run already read; each finding also carries the text report's
    lines under it (``details``), which the HTML report shows."""
    found = all_findings(run, lines)
    first = run.iterations.first()
    diverged = run.iterations.divergence_steps()
    skipped, iterations, scale_first, scale_last = run.iterations.skipped()

    def clean(value: float) -> float | str:
        return value if math.isfinite(value) else str(value)  # JSON has no NaN/Inf

    return {
        "source": source,
        "ranks": sorted(run.ranks),
        "world_size": run.world_size,
        "steps": run.last_step + step_offset,
        "diagnosed_steps": len(run.samples),
        "verdict": thresholds.worst([f.threshold.severity for f in found]),
        "lines": [
            {
                "first": line.first + step_offset,
                "last": line.last + step_offset,
                "failed": line.failed,
                "values": {key: clean(value) for key, value in line.values.items()},
                "verdict": line.verdict,
                "findings": [f.threshold.check for f in ordered(line.findings)],
            }
            for line in lines
        ],
        "origin": None
        if first is None
        else {
            **origin_json(first, step_offset),
            "refined": [origin_json(o, step_offset) for o in run.iterations.refinements(first)],
            "operation": None if (operation := origin_operation(run)) is None else op_json(operation, step_offset),
        },
        "ops": [op_json(seen, step_offset) for kind in run.ops.kinds() for seen in run.ops.of_kind(kind)],
        "headroom_forecasts": [forecast_json(f, step_offset) for f in run.headroom.forecasts()],
        "shadow": [shadow_json(seen, step_offset) for step in run.shadow.steps() for seen in run.shadow.at(step)],
        "float8": [cast_json(seen, run.float8, step_offset) for seen in run.float8.latest()],
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
                "finding": finding_text(run, f),
                "first_step": f.first_step + step_offset,
                "alert": f.threshold.alert,
                "advice": advice_for(run, f),
                **details_json(run.attribution, f.threshold.check, f.first_step, NAMED_PER_FINDING, step_offset),
                "details": finding_details(run, f, step_offset),
            }
            for f in found
        ],
    }


def overall_findings(directory: str) -> list[str]:
    """Names of the checks that fired anywhere in ``directory``'s traces (for scripts and tests)."""
    run = read_run(directory)
    return sorted({f.threshold.check for f in all_findings(run, range_lines(run))})
