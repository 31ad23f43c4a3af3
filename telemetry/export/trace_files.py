"""The embedded default for spans: local trace files a person opens without any server.

Each rank writes, in the trace directory:

* ``rank{R}.trace.json``: Chrome trace-event JSON, which https://ui.perfetto.dev and
  ``chrome://tracing`` open. It is a complete JSON document after every export batch (the
  closing brackets are rewritten after each append), so a crashed run still leaves a
  readable trace.
  Under ``FSDP_PATCH_TRACE_MAX_BYTES`` it is a segment; older ones are ``rank{R}.1.trace.json``.
* ``rank{R}.jaeger.json``: the JSON of Jaeger's query API, which the Jaeger UI's Search >
  "JSON File" upload accepts. It is converted from the Chrome segments at shutdown rather than
  written live: live writing would double the exporter's CPU time, which competes with the
  training thread for the GIL.

Offline, for a crashed run or to combine ranks (inputs are files or trace directories)::

    fsdp-patch trace merge  all.trace.json   fsdp_patch_traces
    fsdp-patch trace jaeger all.jaeger.json  fsdp_patch_traces

``merge`` puts every rank in one Perfetto view (one process row per rank). Both stream.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import os
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.trace import StatusCode

from .. import env, trace_limits
from ..offline import trace_reading

_logger = logging.getLogger(__name__)
_encode = json.JSONEncoder(separators=(",", ":")).encode


class JsonDocumentFile:
    """A file holding ``prefix + items joined by commas + suffix``, valid JSON after every append.

    The file is created on the first append (so ranks that emit nothing leave nothing),
    truncating any file of an earlier run, and starts with ``leading_items``. After an
    ``OSError`` the file is abandoned: every later append is a no-op, since its state on disk
    is unknown.

    Args:
        path: File to write.
        prefix: JSON text before the first item.
        suffix: JSON text after the last item.
        leading_items: Items (JSON texts) every new file starts with.
    """

    def __init__(self, path: str, prefix: str, suffix: str, leading_items: Sequence[str] = ()) -> None:
        self.path = path
        self._prefix = prefix.encode()
        self._suffix = suffix.encode()
        self._leading = ",\n".join(leading_items).encode()
        self._file: Any = None
        self._end_of_items = 0
        self._has_items = False
        self._written = False
        self._broken = False
        self._lock = threading.Lock()

    def _open(self) -> None:
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        self._file = open(self.path, "wb")
        self._file.write(self._prefix + self._leading)
        self._end_of_items = len(self._prefix) + len(self._leading)
        self._has_items = bool(self._leading)

    def size_after(self, body_chars: int) -> int:
        """Size in bytes the file would have after appending items of ``body_chars`` ASCII characters."""
        end = self._end_of_items if self._file is not None else len(self._prefix) + len(self._leading)
        separator = 2 if (self._has_items if self._file is not None else self._leading) else 0
        return end + separator + body_chars + len(self._suffix)

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
                if self._has_items:
                    body = b",\n" + body
                self._file.seek(self._end_of_items)
                self._file.write(body + self._suffix)
                self._file.flush()
                self._end_of_items += len(body)
                self._has_items = True
                self._written = True
            except OSError:
                self._broken = True
                raise

    @property
    def written(self) -> bool:
        """Whether this object wrote the file (a file of an earlier run does not count)."""
        return self._written

    @property
    def broken(self) -> bool:
        """Whether a write failed, so that nothing more is written."""
        return self._broken

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

    Under a cap (``max_bytes``, from ``FSDP_PATCH_TRACE_MAX_BYTES`` by default) the file is a
    segment of at most :func:`~fsdp_patch.telemetry.trace_limits.chrome_segment_bytes`: when the
    next span would pass that size, the segment is renamed ``rank{rank}.1.trace.json``
    (replacing the older one) and a new one is started, each a complete JSON document beginning
    with the process metadata. So the newest steps are kept and the rank's files stay under
    the cap, the Jaeger file written at exit included.

    Args:
        directory: Directory of the files; created on the first span.
        rank: Rank of this process; names the files and is the Chrome process id.
        resource_attributes: Resource of the spans, kept in the process metadata event.
        jaeger_at_shutdown: Convert the Chrome segments to ``rank{rank}.jaeger.json`` at shutdown.
        max_bytes: Cap in bytes on all files of this rank; 0 for none.
    """

    def __init__(
        self,
        directory: str,
        rank: int,
        resource_attributes: Mapping[str, Any],
        jaeger_at_shutdown: bool = True,
        max_bytes: int = trace_limits.DEFAULT_TRACE_MAX_BYTES,
    ) -> None:
        self.rank = rank
        self.directory = directory
        self.max_bytes = max_bytes
        self._segment_bytes = trace_limits.chrome_segment_bytes(max_bytes)
        self.jaeger_path = trace_reading.jaeger_path(directory, rank) if jaeger_at_shutdown else None
        self._jaeger_written = False
        self._rotations = 0
        self._unwritable = False
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
        self.file = self._new_segment()

    def _new_segment(self) -> JsonDocumentFile:
        # Every segment starts with the process metadata, so each one opens (and converts) alone.
        return JsonDocumentFile(
            trace_reading.chrome_path(self.directory, self.rank), _CHROME_PREFIX, _CHROME_SUFFIX, self._header
        )

    def _older_segments(self) -> list[str]:
        kept = min(self._rotations, trace_limits.CHROME_SEGMENTS - 1)
        return [trace_reading.chrome_path(self.directory, self.rank, age) for age in range(kept, 0, -1)]

    def chrome_paths(self) -> list[str]:
        """Chrome segments this exporter wrote, oldest first."""
        return self._older_segments() + ([self.file.path] if self.file.written else [])

    def written_paths(self) -> list[str]:
        """Files written so far by this exporter (the Jaeger file appears at shutdown)."""
        paths = self.chrome_paths()
        if paths and self.jaeger_path and self._jaeger_written:
            paths.append(self.jaeger_path)
        return paths

    def _prepare_directory(self) -> None:
        # Created here, before anything in it is touched, so that a path that cannot be a
        # directory is reported as such rather than as the first file tried inside it.
        if os.path.isdir(self.directory):
            return
        try:
            os.makedirs(self.directory, exist_ok=True)
            # Like .pytest_cache: a directory we created should not end up in a commit.
            with open(os.path.join(self.directory, ".gitignore"), "w", encoding="utf-8") as ignore:
                ignore.write("# created by fsdp_patch telemetry\n*\n")
        except OSError as exc:
            self._unwritable = True
            raise OSError(
                f"cannot create the trace directory {self.directory} ({exc.strerror or exc}); no trace files are "
                f"written. Set {env.TRACE_DIR} to a directory that can be created"
            ) from None

    def _remove_earlier_run(self) -> None:
        # Older segments and a Jaeger file of an earlier run in this directory would read as
        # this run's (the newest segment is truncated when opened anyway).
        stale = [
            trace_reading.chrome_path(self.directory, self.rank, age) for age in range(1, trace_limits.CHROME_SEGMENTS)
        ]
        for path in [*stale, trace_reading.jaeger_path(self.directory, self.rank)]:
            try:
                os.remove(path)
            except FileNotFoundError:
                pass

    def _rotate(self) -> None:
        self.file.close()
        for age in range(trace_limits.CHROME_SEGMENTS - 1, 0, -1):
            older = trace_reading.chrome_path(self.directory, self.rank, age - 1)
            if os.path.exists(older):
                os.replace(older, trace_reading.chrome_path(self.directory, self.rank, age))
        self._rotations += 1
        self.file = self._new_segment()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        events = [event for span in spans for event in chrome_events(span, self.rank)]
        if not events or self.file.broken or self._unwritable:
            return SpanExportResult.SUCCESS
        if not self.file.written and not self._rotations:
            self._prepare_directory()
            self._remove_earlier_run()
        if not self._segment_bytes:
            self.file.append(events)
            return SpanExportResult.SUCCESS
        # Split the batch where the segment fills up; a span's events may straddle two segments.
        chunk: list[str] = []
        chunk_chars = 0
        for event in events:
            added = len(event) + (2 if chunk else 0)
            if chunk and self.file.size_after(chunk_chars + added) > self._segment_bytes:
                self.file.append(chunk)
                chunk, chunk_chars, added = [], 0, len(event)
            if not chunk and self.file.written and self.file.size_after(added) > self._segment_bytes:
                self._rotate()
            chunk.append(event)
            chunk_chars += added
        self.file.append(chunk)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        self.file.close()
        chrome = self.chrome_paths()
        if self.jaeger_path is None or not chrome or self._jaeger_written:
            return
        chrome_bytes = sum(os.path.getsize(path) for path in chrome)
        if chrome_bytes > trace_limits.JAEGER_AT_EXIT_MAX_BYTES:
            _logger.info("%s is too large to convert at exit; run `fsdp-patch trace jaeger`.", self.directory)
            return
        budget = self.max_bytes - chrome_bytes if self.max_bytes else None
        result = write_jaeger(chrome, self.jaeger_path, max_bytes=budget)
        if result.cut_short and len(chrome) > 1:
            # Over budget (an unusually high Jaeger/Chrome ratio): the newest segment alone.
            result = write_jaeger(chrome[-1:], self.jaeger_path, max_bytes=budget)
        self._jaeger_written = True
        if result.cut_short:
            _logger.info(
                "%s holds %d of %d traces (%s caps this rank's trace files); `fsdp-patch trace jaeger` converts all.",
                self.jaeger_path, result.traces, result.traces_seen, trace_limits.TRACE_MAX_BYTES,
            )  # fmt: skip

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


_CHROME_PREFIX = '{"displayTimeUnit":"ms","traceEvents":[\n'
_CHROME_SUFFIX = "\n]}\n"


@contextlib.contextmanager
def _written_whole(output: str) -> Iterator[TextIO]:
    """``output`` for writing, written aside (``OUTPUT.partial``) and renamed over it once complete.

    A bad input met part way, a full disk or an exit that cuts the writing short leave no torn
    output, and an earlier file at ``output`` as it was (a process killed part way leaves the
    ``.partial`` file only).
    """
    partial = f"{output}.partial"
    try:
        file = open(partial, "w", encoding="utf-8")
    except OSError as exc:  # named after the output the caller asked for, not the file aside
        raise OSError(exc.errno, f"cannot write {output}: {exc.strerror}") from exc
    try:
        with file as out:
            yield out
        os.replace(partial, output)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(partial)
        raise


def _iter_inputs(inputs: Sequence[str]) -> Iterator[dict[str, Any]]:
    for path in trace_reading.expand_inputs(inputs):
        yield from trace_reading.iter_events(path)


def merge_chrome_traces(inputs: Sequence[str], output: str) -> int:
    """Merge Chrome trace files (or trace directories) into one; each rank keeps its process row.

    Streams: memory does not grow with the inputs' size.

    Returns:
        The number of events written.
    """
    count = 0
    with _written_whole(output) as out:
        out.write(_CHROME_PREFIX)
        for event in _iter_inputs(inputs):
            out.write((",\n" if count else "") + _encode(event))
            count += 1
        out.write(_CHROME_SUFFIX)
    return count


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


def chrome_to_jaeger(events: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Rebuild Jaeger query-API JSON (``{"data": [trace, ...]}``) from our Chrome trace events, in memory."""
    buffer = io.StringIO()
    stream = JaegerStream(buffer)
    for event in events:
        stream.feed(event)
    stream.close()
    return json.loads(buffer.getvalue())


def write_jaeger(inputs: Sequence[str], output: str, max_bytes: int | None = None) -> JaegerResult:
    """Convert Chrome trace files (or trace directories) into one Jaeger upload file, streaming.

    Args:
        inputs: Files written by :class:`TraceFileExporter` (rotated segments oldest first),
            or directories holding them.
        output: The Jaeger JSON file.
        max_bytes: Largest output size; whole traces past it are left out.

    Returns:
        What was written.
    """
    with _written_whole(output) as out:
        stream = JaegerStream(out, max_bytes)
        for event in _iter_inputs(inputs):
            stream.feed(event)
        return stream.close()
