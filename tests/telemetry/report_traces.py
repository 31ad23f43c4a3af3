"""Trace files for the precision report's tests (``test_precision_report*.py``), written by the real
exporter: step spans with chosen diagnostic values on their precision child, the per-iteration
checks' spans and events.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fsdp_patch.telemetry.export import trace_files
from fsdp_patch.telemetry.offline import precision_report
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


def rank_tracer(directory: Path, rank: int, ranks: int) -> tuple[TracerProvider, Any]:
    """A tracer writing rank ``rank``'s trace file (of ``ranks``) with the real exporter; shut the
    provider down to write it."""
    exporter = trace_files.TraceFileExporter(str(directory), rank, {"fsdp.world_size": ranks}, jaeger_at_shutdown=False)
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, provider.get_tracer("t")


def write_steps(
    directory: Path, diagnostics: dict[int, dict], steps: int, failed: tuple[int, ...] = (), ranks: int = 2
) -> None:
    """Step spans 1..steps per rank, a precision child on the steps in ``diagnostics``."""
    for rank in range(ranks):
        provider, tracer = rank_tracer(directory, rank, ranks)
        for step in range(1, steps + 1):
            with tracer.start_as_current_span("fsdp.optimizer.step", attributes={"fsdp.step": step}) as span:
                if step in diagnostics:
                    with tracer.start_as_current_span("fsdp.optimizer.precision") as child:
                        child.set_attributes({**HEALTHY, **diagnostics[step]})
                if step in failed:
                    span.set_status(Status(StatusCode.ERROR, "TypeError: rejected"))
        provider.shutdown()


def range_verdicts(directory: Path, lines: int = 10) -> list[tuple[int, int, str, list[str]]]:
    run = precision_report.read_run(str(directory))
    return [
        (line.first, line.last, line.verdict, sorted(f.threshold.check for f in line.findings))
        for line in precision_report.range_lines(run, lines)
    ]


def write_iterations(
    directory: Path,
    ranks: dict[int, list[tuple[str, int, dict]]],
    events: dict[int, list[tuple[str, dict]]] | None = None,
    diagnostics: dict[int, dict] | None = None,
) -> None:
    """Per rank, spans in order: ``(name, step, extra attributes)`` (a step, a skipped step,
    checks); on the step span of each step in ``events`` those events (the same on every rank,
    the rank added), and a precision child on each step in ``diagnostics``."""
    for rank, spans in ranks.items():
        provider, tracer = rank_tracer(directory, rank, len(ranks))
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


def steps(count: int) -> list[tuple[str, int, dict]]:
    return [("fsdp.optimizer.step", s, {"fsdp.backward.count": 1}) for s in range(1, count + 1)]


def origin_event(step: int, stage: str, where: str) -> tuple[str, dict]:
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
