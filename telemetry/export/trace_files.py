"""The embedded default for spans: local trace files a person opens without any server.

Each rank writes, in the trace directory:

* ``rank{R}.trace.json``: Chrome trace-event JSON, which https://ui.perfetto.dev and
  ``chrome://tracing`` open. It is a complete JSON document after every export batch (a
  :class:`~.json_document.JsonDocumentFile`), so a crashed run still leaves a readable trace.
  Under ``FSDP_PATCH_TRACE_MAX_BYTES`` it is a segment; older ones are ``rank{R}.1.trace.json``.
* ``rank{R}.jaeger.json``: the JSON of Jaeger's query API, which the Jaeger UI's Search >
  "JSON File" upload accepts. It is converted from the Chrome segments at shutdown rather than
  written live: live writing would double the exporter's CPU time, which competes with the
  training thread for the GIL.

Offline, for a crashed run or to combine ranks, ``fsdp-patch trace merge`` and ``fsdp-patch
trace jaeger`` convert the files (:mod:`fsdp_patch.telemetry.offline.trace_conversion`).
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.trace import StatusCode

from .. import env, trace_limits
from ..offline import trace_reading
from ..offline.trace_conversion import CHROME_DOCUMENT_PREFIX, CHROME_DOCUMENT_SUFFIX, write_jaeger
from .json_document import JsonDocumentFile

_logger = logging.getLogger(__name__)
_encode = json.JSONEncoder(separators=(",", ":")).encode


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
    ``status``, enough to rebuild the span tree (see :mod:`~fsdp_patch.telemetry.offline.jaeger`).
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
            trace_reading.chrome_path(self.directory, self.rank),
            CHROME_DOCUMENT_PREFIX,
            CHROME_DOCUMENT_SUFFIX,
            self._header,
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
                self.jaeger_path,
                result.traces,
                result.traces_seen,
                trace_limits.TRACE_MAX_BYTES,
            )

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
