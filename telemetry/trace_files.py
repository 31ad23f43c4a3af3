"""The embedded default for spans: local trace files a person opens without any server.

Each rank writes, in the trace directory:

* ``rank{R}.trace.json``: Chrome trace-event JSON, which https://ui.perfetto.dev and
  ``chrome://tracing`` open. It is a complete JSON document after every export batch (the
  closing brackets are rewritten after each append), so a crashed run still leaves a
  readable trace.
* ``rank{R}.jaeger.json``: the JSON of Jaeger's query API, which the Jaeger UI's Search >
  "JSON File" upload accepts. It is converted from the Chrome file at shutdown rather than
  written live: live writing would double the exporter's CPU time, which competes with the
  training thread for the GIL.

Offline, for a crashed run or to combine ranks::

    python -m fsdp_patch.telemetry.trace_files merge  all.trace.json   fsdp_patch_traces/rank*.trace.json
    python -m fsdp_patch.telemetry.trace_files jaeger all.jaeger.json  fsdp_patch_traces/rank*.trace.json

``merge`` puts every rank in one Perfetto view (one process row per rank).
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.trace import StatusCode

_logger = logging.getLogger(__name__)
_encode = json.JSONEncoder(separators=(",", ":")).encode

# Larger traces are not converted at exit (it would hold up interpreter exit, and the Jaeger
# UI struggles with them anyway); the command line converts them, or a part of them, on demand.
JAEGER_AT_EXIT_MAX_BYTES = 64 << 20


class JsonDocumentFile:
    """A file holding ``prefix + items joined by commas + suffix``, valid JSON after every append.

    The file is created on the first append (so ranks that emit nothing leave nothing),
    truncating any file of an earlier run. After an ``OSError`` the file is abandoned: every
    later append is a no-op, since its state on disk is unknown.

    Args:
        path: File to write.
        prefix: JSON text before the first item.
        suffix: JSON text after the last item.
    """

    def __init__(self, path: str, prefix: str, suffix: str) -> None:
        self.path = path
        self._prefix = prefix.encode()
        self._suffix = suffix.encode()
        self._file: Any = None
        self._end_of_items = 0
        self._count = 0
        self._broken = False
        self._lock = threading.Lock()

    def _open(self) -> None:
        directory = os.path.dirname(self.path) or "."
        created = not os.path.isdir(directory)
        os.makedirs(directory, exist_ok=True)
        if created:
            # Like .pytest_cache: a directory we created should not end up in a commit.
            with open(os.path.join(directory, ".gitignore"), "w", encoding="utf-8") as ignore:
                ignore.write("# created by fsdp_patch telemetry\n*\n")
        self._file = open(self.path, "wb")  # noqa: SIM115 - kept open across appends
        self._file.write(self._prefix)
        self._end_of_items = len(self._prefix)

    def append(self, items: Iterable[str]) -> None:
        """Write items (JSON texts) and re-close the document.

        Raises:
            OSError: The first write error (disk full, unwritable directory, ...).
        """
        body = ",\n".join(items).encode()
        if not body:
            return
        with self._lock:
            if self._broken:
                return
            try:
                if self._file is None:
                    self._open()
                if self._count:
                    body = b",\n" + body
                self._file.seek(self._end_of_items)
                self._file.write(body + self._suffix)
                self._file.flush()
                self._end_of_items += len(body)
                self._count += 1
            except OSError:
                self._broken = True
                raise

    @property
    def written(self) -> bool:
        """Whether this object wrote the file (a file of an earlier run does not count)."""
        return self._count > 0

    def close(self) -> None:
        """Close the file; the document on disk is already complete."""
        with self._lock:
            if self._file is not None:
                try:
                    self._file.close()
                except OSError:
                    pass
                self._file = None


def _json_value(value: Any) -> Any:
    # Browsers' JSON.parse rejects NaN and Infinity, which json.dumps would write bare.
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, (tuple, list)):
        return [_json_value(v) for v in value]
    return value


def _attributes(attributes: Mapping[str, Any] | None) -> dict[str, Any]:
    return {k: _json_value(v) for k, v in (attributes or {}).items()}


def chrome_events(span: ReadableSpan, pid: int, tid: int = 1) -> list[str]:
    """Chrome trace events (JSON texts) for one span: a complete ("X") event, and an instant
    ("i") event per span event such as a recorded exception.

    ``args`` carries the attributes plus ``trace_id``, ``span_id``, ``parent_span_id`` and
    ``status``, enough to rebuild the span tree (see :func:`chrome_to_jaeger`).
    """
    start_ns = span.start_time or 0
    end_ns = span.end_time or start_ns
    span_id = f"{span.context.span_id:016x}"
    args = _attributes(span.attributes)
    args["trace_id"] = f"{span.context.trace_id:032x}"
    args["span_id"] = span_id
    if span.parent is not None:
        args["parent_span_id"] = f"{span.parent.span_id:016x}"
    if span.status.status_code is not StatusCode.UNSET:
        args["status"] = span.status.status_code.name
        if span.status.description:
            args["status_description"] = span.status.description
    # Hand-assembled around the two dynamic parts: about twice as fast as encoding a dict.
    events = [
        f'{{"name":{_encode(span.name)},"ph":"X","ts":{start_ns / 1000:.3f},'
        f'"dur":{(end_ns - start_ns) / 1000:.3f},"pid":{pid},"tid":{tid},"args":{_encode(args)}}}'
    ]
    for event in span.events:
        event_args = _attributes(event.attributes)
        event_args["span_id"] = span_id
        events.append(
            f'{{"name":{_encode(event.name)},"ph":"i","s":"t","ts":{event.timestamp / 1000:.3f},'
            f'"pid":{pid},"tid":{tid},"args":{_encode(event_args)}}}'
        )
    return events


class TraceFileExporter(SpanExporter):
    """Writes one rank's spans to ``{directory}/rank{rank}.trace.json`` (Chrome trace-event JSON).

    Args:
        directory: Directory of the files; created on the first span.
        rank: Rank of this process; names the files and is the Chrome process id.
        resource_attributes: Resource of the spans, kept in the process metadata event.
        jaeger_at_shutdown: Convert the Chrome file to ``rank{rank}.jaeger.json`` at shutdown.
    """

    def __init__(
        self, directory: str, rank: int, resource_attributes: Mapping[str, Any], jaeger_at_shutdown: bool = True
    ) -> None:
        self.rank = rank
        self.jaeger_path = os.path.join(directory, f"rank{rank}.jaeger.json") if jaeger_at_shutdown else None
        self._jaeger_written = False
        self.file = JsonDocumentFile(
            os.path.join(directory, f"rank{rank}.trace.json"),
            '{"displayTimeUnit":"ms","traceEvents":[\n',
            "\n]}\n",
        )
        service = str(resource_attributes.get("service.name", "fsdp_patch"))
        header = [
            {
                "name": "process_name",
                "ph": "M",
                "pid": rank,
                "args": {"name": f"rank {rank} ({service})", "otel.resource": _attributes(resource_attributes)},
            },
            {"name": "process_sort_index", "ph": "M", "pid": rank, "args": {"sort_index": rank}},
            {"name": "thread_name", "ph": "M", "pid": rank, "tid": 1, "args": {"name": "spans"}},
        ]
        self._header = [_encode(e) for e in header]

    def written_paths(self) -> list[str]:
        """Files written so far by this exporter (the Jaeger file appears at shutdown)."""
        paths = [self.file.path] if self.file.written else []
        if paths and self.jaeger_path and self._jaeger_written:
            paths.append(self.jaeger_path)
        return paths

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        events, self._header = self._header, []
        for span in spans:
            events.extend(chrome_events(span, self.rank))
        self.file.append(events)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        self.file.close()
        chrome = self.file.path
        if self.jaeger_path is None or not self.file.written or self._jaeger_written:
            return
        if os.path.getsize(chrome) > JAEGER_AT_EXIT_MAX_BYTES:
            _logger.info("%s is too large to convert at exit; run `python -m fsdp_patch.telemetry.trace_files jaeger`.", chrome)
            return
        # Written aside and renamed, so an exit that cuts the conversion short leaves no torn file.
        partial = f"{self.jaeger_path}.partial"
        write_jaeger([chrome], partial)
        os.replace(partial, self.jaeger_path)
        self._jaeger_written = True

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def _load_events(paths: Sequence[str]) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            document = json.load(f)
        events.extend(document["traceEvents"] if isinstance(document, dict) else document)
    return events


def merge_chrome_traces(inputs: Sequence[str], output: str) -> int:
    """Merge per-rank Chrome trace files into one (each rank keeps its own process row).

    Returns:
        The number of events written.
    """
    events = _load_events(inputs)
    with open(output, "w", encoding="utf-8") as f:
        json.dump({"displayTimeUnit": "ms", "traceEvents": events}, f)
    return len(events)


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


def chrome_to_jaeger(events: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Rebuild Jaeger query-API JSON (``{"data": [trace, ...]}``) from our Chrome trace events."""
    processes: dict[str, dict[str, Any]] = {}
    logs: dict[str, list[dict[str, Any]]] = {}
    spans: list[tuple[Mapping[str, Any], str]] = []
    for event in events:
        args = event.get("args", {})
        process_id = f"p{event.get('pid', 0)}"
        if event.get("ph") == "M" and event.get("name") == "process_name":
            resource = args.get("otel.resource", {})
            processes[process_id] = {
                "serviceName": str(resource.get("service.name", args.get("name", "fsdp_patch"))),
                "tags": [_jaeger_tag(k, v) for k, v in resource.items()],
            }
        elif event.get("ph") == "X" and "trace_id" in args:
            spans.append((event, process_id))
        elif event.get("ph") == "i" and "span_id" in args:
            fields = [_jaeger_tag("event", event["name"])]
            fields += [_jaeger_tag(k, v) for k, v in args.items() if k != "span_id"]
            logs.setdefault(args["span_id"], []).append({"timestamp": int(event["ts"]), "fields": fields})
    traces: dict[str, dict[str, Any]] = {}
    for event, process_id in spans:
        args = event["args"]
        trace_id = args["trace_id"]
        processes.setdefault(process_id, {"serviceName": "fsdp_patch", "tags": []})
        tags = [_jaeger_tag(k, v) for k, v in args.items() if k not in _SPAN_ARGS]
        if args.get("status") == "ERROR":
            tags.append(_jaeger_tag("error", True))
            tags.append(_jaeger_tag("otel.status_code", "ERROR"))
            if "status_description" in args:
                tags.append(_jaeger_tag("otel.status_description", args["status_description"]))
        parent = args.get("parent_span_id")
        trace = traces.setdefault(trace_id, {"traceID": trace_id, "spans": [], "processes": {}})
        trace["processes"][process_id] = processes[process_id]
        trace["spans"].append(
            {
                "traceID": trace_id,
                "spanID": args["span_id"],
                "operationName": event["name"],
                "references": [{"refType": "CHILD_OF", "traceID": trace_id, "spanID": parent}] if parent else [],
                "flags": 1,
                "startTime": int(event["ts"]),
                "duration": int(event.get("dur", 0)),
                "tags": tags,
                "logs": logs.get(args["span_id"], []),
                "processID": process_id,
                "warnings": None,
            }
        )
    return {"data": list(traces.values())}


def write_jaeger(inputs: Sequence[str], output: str) -> int:
    """Convert Chrome trace files written by :class:`TraceFileExporter` into one Jaeger upload file.

    Returns:
        The number of traces written.
    """
    document = chrome_to_jaeger(_load_events(inputs))
    with open(output, "w", encoding="utf-8") as f:
        json.dump(document, f)
    return len(document["data"])


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: ``merge|jaeger OUTPUT INPUT [INPUT ...]``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 3 or args[0] not in ("merge", "jaeger"):
        print("usage: python -m fsdp_patch.telemetry.trace_files {merge|jaeger} OUTPUT INPUT [INPUT ...]", file=sys.stderr)
        return 2
    command, output, inputs = args[0], args[1], args[2:]
    if command == "merge":
        print(f"wrote {merge_chrome_traces(inputs, output)} events to {output}")
    else:
        print(f"wrote {write_jaeger(inputs, output)} traces to {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
