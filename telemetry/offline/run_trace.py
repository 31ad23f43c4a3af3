"""A run's trace files read into what the precision reports judge: per-step diagnostics, failed
steps, and what the per-iteration checks, the attribution, the operation audit, the headroom
forecast and the float32 shadow recorded.

Reads the ``fsdp.optimizer.precision`` spans (their attributes hold the step's diagnostics,
already reduced over ranks) and the ``fsdp.optimizer.step`` spans (step numbers, and steps
that raised) from every rank's trace files, rotated segments included, streaming. No torch and
no OpenTelemetry here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .. import semconv
from .attribution_report import AttributionTrace
from .float8_report import Float8Trace
from .headroom_report import HeadroomTrace
from .op_report import OpTrace
from .origin_report import OriginTrace
from .shadow_report import ShadowTrace
from .trace_reading import TraceFileError, iter_events, rank_segments

# -- Names read from the trace ---------------------------------------------------------
# Span names and attribute keys come from semconv; the precision span's attributes are named
# after the metrics they mirror (docs/conventions.md).
RESOURCE_SERVICE = "service.name"  # OpenTelemetry's own resource attribute
# Written by the trace-file exporter next to the span attributes.
SPAN_ID, PARENT_SPAN_ID, STATUS, STATUS_DESCRIPTION = "span_id", "parent_span_id", "status", "status_description"
RESOURCE = "otel.resource"

# The per-step diagnostics the reports show, as (attribute, header, text format).
COLUMNS: tuple[tuple[str, str, str], ...] = (
    (semconv.METRIC_NONFINITE, "nonfinite", "{:>9.0f}"),
    (semconv.METRIC_REFRESH_OVERFLOW, "overflow", "{:>8.0f}"),
    (semconv.METRIC_REFRESH_UNDERFLOW, "underflow", "{:>9.0f}"),
    (semconv.METRIC_REFRESH_ERROR, "refresh err", "{:>11.3g}"),
    (semconv.METRIC_LOST_RATIO, "lost upd", "{:>8.3f}"),
    (semconv.METRIC_GRAD_AMAX, "grad amax", "{:>9.3g}"),
)
# Judged but not shown as columns: the attribution's whole-model values (its parameters are named
# under "where to look next").
JUDGED = (*(key for key, _, _ in COLUMNS), *semconv.ATTRIBUTION_SPAN_ATTRIBUTES)
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
        float8: What the float8 casts of each float8 module kept.
        rank_samples: Diagnostics by rank, then step, as each rank's file holds them (they are
            reduced over ranks, so they differ only where a rank's diagnostics did not run).
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
    float8: Float8Trace = field(default_factory=Float8Trace)
    rank_samples: dict[int, dict[int, dict[str, float]]] = field(default_factory=dict)


def _number(value: object) -> float | None:
    # The trace file writes non-finite floats as strings ("nan", "inf"): JSON has no literal for them.
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None


def worse(old: float | None, new: float) -> float:
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
    precision: list[tuple[str | None, dict[str, float], int]] = []
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
                    precision.append((args.get(PARENT_SPAN_ID), values, segment.rank))
            elif event.get("ph") == "i":
                run.attribution.feed(event)
                run.iterations.feed_instant(args, str(event.get("name", "")))
                run.ops.feed_instant(args, str(event.get("name", "")))
                run.headroom.feed_instant(args, str(event.get("name", "")))
                run.shadow.feed_instant(args, str(event.get("name", "")))
                run.float8.feed_instant(args, str(event.get("name", "")))
    for parent, values, rank in precision:
        # The step span ends after its precision child, possibly in the next (still kept) segment;
        # a parent rotated away belongs to the oldest, dropped steps.
        step = step_of_span.get(parent or "")
        if step is None:
            continue
        sample = run.samples.setdefault(step, {})
        rank_sample = run.rank_samples.setdefault(rank, {}).setdefault(step, {})
        for key, value in values.items():
            sample[key] = worse(sample.get(key), value)
            rank_sample[key] = worse(rank_sample.get(key), value)
    steps_of_precision = {
        span: step_of_span[parent]
        for span, parent in precision_parent.items()
        if parent is not None and parent in step_of_span
    }
    run.attribution.resolve(steps_of_precision)
    return run
