"""Jaeger query-API JSON (``{"data": [trace, ...]}``), which the Jaeger UI's Search > "JSON File"
upload accepts, converted from the Chrome trace events the trace-file exporter writes.

The events carry what a span tree needs (``trace_id``, ``span_id``, ``parent_span_id``,
``status`` in their ``args``: see :func:`~fsdp_patch.telemetry.export.trace_files.chrome_events`);
:class:`JaegerStream` rebuilds the traces one event at a time, in bounded memory. No
OpenTelemetry and no torch here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TextIO

__all__ = ["MAX_PENDING_SPANS", "JaegerResult", "JaegerStream"]


def _jaeger_tag(key: str, value: Any) -> dict[str, Any]:
    if isinstance(value, bool):
        kind = "bool"
    elif isinstance(value, int):
        kind = "int64"
    elif isinstance(value, float):
        kind = "float64"
    else:
        kind = "string"
        value = value if isinstance(value, str) else json.dumps(value)
    return {"key": key, "type": kind, "value": value}


_SPAN_ARGS = ("trace_id", "span_id", "parent_span_id", "status", "status_description")
# Spans held while their trace's root has not been read yet. A trace whose root ends much
# later (an application span around the whole run) is written in parts under the same ID.
MAX_PENDING_SPANS = 10_000


@dataclass
class JaegerResult:
    """What :func:`write_jaeger` wrote.

    Attributes:
        traces: Traces (or parts of traces) written.
        traces_seen: Traces read from the inputs.
        cut_short: Whether ``max_bytes`` stopped the output before the end.
    """

    traces: int = 0
    traces_seen: int = 0
    cut_short: bool = False


class JaegerStream:
    """Converts Chrome trace events, fed one at a time, into Jaeger query-API JSON written as it goes.

    Our exporter writes a span after its children and a span's instant events (exceptions)
    right after it, so a trace is complete once its root span and the events after it were
    read; it is written then and forgotten. Memory is bounded by :data:`MAX_PENDING_SPANS`.

    Args:
        out: Text stream receiving ``{"data": [trace, ...]}``.
        max_bytes: Stop before the output would pass this size (whole traces only; the
            document is still closed and valid).
    """

    def __init__(self, out: TextIO, max_bytes: int | None = None) -> None:
        self._out = out
        self._max_bytes = max_bytes
        self._processes: dict[str, dict[str, Any]] = {}
        self._pending: dict[str, list[dict[str, Any]]] = {}
        self._spans_by_id: dict[str, dict[str, Any]] = {}
        self._complete: list[str] = []
        self._pending_spans = 0
        self._closing = "]}\n"
        self._size = len('{"data":[') + len(self._closing)
        self.result = JaegerResult()
        out.write('{"data":[')

    def feed(self, event: Mapping[str, Any]) -> None:
        """Take one Chrome trace event."""
        args = event.get("args", {})
        process_id = f"p{event.get('pid', 0)}"
        phase = event.get("ph")
        if phase == "M" and event.get("name") == "process_name":
            resource = args.get("otel.resource", {})
            self._processes[process_id] = {
                "serviceName": str(resource.get("service.name", args.get("name", "fsdp_patch"))),
                "tags": [_jaeger_tag(k, v) for k, v in resource.items()],
            }
        elif phase == "X" and "trace_id" in args:
            self._write_complete()
            self._add_span(event, args, process_id)
        elif phase == "i" and "span_id" in args:
            span = self._spans_by_id.get(args["span_id"])
            if span is not None:
                fields = [_jaeger_tag("event", event["name"])]
                fields += [_jaeger_tag(k, v) for k, v in args.items() if k != "span_id"]
                span["logs"].append({"timestamp": int(event["ts"]), "fields": fields})

    def _add_span(self, event: Mapping[str, Any], args: Mapping[str, Any], process_id: str) -> None:
        trace_id = args["trace_id"]
        tags = [_jaeger_tag(k, v) for k, v in args.items() if k not in _SPAN_ARGS]
        if args.get("status") == "ERROR":
            tags.append(_jaeger_tag("error", True))
            tags.append(_jaeger_tag("otel.status_code", "ERROR"))
            if "status_description" in args:
                tags.append(_jaeger_tag("otel.status_description", args["status_description"]))
        parent = args.get("parent_span_id")
        span = {
            "traceID": trace_id,
            "spanID": args["span_id"],
            "operationName": event["name"],
            "references": [{"refType": "CHILD_OF", "traceID": trace_id, "spanID": parent}] if parent else [],
            "flags": 1,
            "startTime": int(event["ts"]),
            "duration": int(event.get("dur", 0)),
            "tags": tags,
            "logs": [],
            "processID": process_id,
            "warnings": None,
        }
        if trace_id not in self._pending:
            self.result.traces_seen += 1
        self._pending.setdefault(trace_id, []).append(span)
        self._spans_by_id[span["spanID"]] = span
        self._pending_spans += 1
        if not parent:
            self._complete.append(trace_id)
        while self._pending_spans > MAX_PENDING_SPANS and self._pending:
            self._write_trace(next(iter(self._pending)))

    def _write_complete(self) -> None:
        for trace_id in self._complete:
            if trace_id in self._pending:
                self._write_trace(trace_id)
        self._complete.clear()

    def _write_trace(self, trace_id: str) -> None:
        spans = self._pending.pop(trace_id)
        self._pending_spans -= len(spans)
        for span in spans:
            self._spans_by_id.pop(span["spanID"], None)
        if self.result.cut_short:
            return
        processes = {
            span["processID"]: self._processes.get(span["processID"], {"serviceName": "fsdp_patch", "tags": []})
            for span in spans
        }
        text = (", " if self.result.traces else "") + json.dumps(
            {"traceID": trace_id, "spans": spans, "processes": processes}
        )
        if self._max_bytes is not None and self._size + len(text) > self._max_bytes:
            self.result.cut_short = True
            return
        self._out.write(text)
        self._size += len(text)
        self.result.traces += 1

    def close(self) -> JaegerResult:
        """Write what is still pending and close the document."""
        self._write_complete()
        while self._pending:
            self._write_trace(next(iter(self._pending)))
        self._out.write(self._closing)
        return self.result
