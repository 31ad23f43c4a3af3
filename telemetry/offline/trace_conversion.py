"""``fsdp-patch trace``: Chrome trace files (or trace directories) merged into one, or converted to Jaeger.

Offline, for a crashed run or to combine ranks::

    fsdp-patch trace merge  all.trace.json   fsdp_patch_traces
    fsdp-patch trace jaeger all.jaeger.json  fsdp_patch_traces

``merge`` puts every rank in one Perfetto view (one process row per rank). Both stream: memory
does not grow with the inputs' size. An output is written aside and replaces the file of its name
only once complete. The trace-file exporter writes the same Chrome document
(:data:`CHROME_DOCUMENT_PREFIX`, :data:`CHROME_DOCUMENT_SUFFIX`) and converts its own segments
with :func:`write_jaeger` at shutdown. No OpenTelemetry and no torch here.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Sequence
from typing import Any, TextIO

from . import trace_reading
from .jaeger import JaegerResult, JaegerStream

__all__ = ["CHROME_DOCUMENT_PREFIX", "CHROME_DOCUMENT_SUFFIX", "merge_chrome_traces", "write_jaeger"]

# What every Chrome trace file we write holds around its events.
CHROME_DOCUMENT_PREFIX = '{"displayTimeUnit":"ms","traceEvents":[\n'
CHROME_DOCUMENT_SUFFIX = "\n]}\n"
_encode = json.JSONEncoder(separators=(",", ":")).encode


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
        out.write(CHROME_DOCUMENT_PREFIX)
        for event in _iter_inputs(inputs):
            out.write((",\n" if count else "") + _encode(event))
            count += 1
        out.write(CHROME_DOCUMENT_SUFFIX)
    return count


def write_jaeger(inputs: Sequence[str], output: str, max_bytes: int | None = None) -> JaegerResult:
    """Convert Chrome trace files (or trace directories) into one Jaeger upload file, streaming.

    Args:
        inputs: Files the trace-file exporter wrote (rotated segments oldest first), or
            directories holding them.
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
