"""Reading the trace files back: which files a directory holds, and their events one at a time.

No OpenTelemetry and no torch here: the report and the command-line tools read files of any
size in bounded memory, and a file of a crashed or rotated run reads like any other.

File names (see :class:`~fsdp_patch.telemetry.export.trace_files.TraceFileExporter`):
``rank{R}.trace.json`` is a rank's newest segment, ``rank{R}.{N}.trace.json`` its older
ones (``N`` larger is older), ``rank{R}.jaeger.json`` the Jaeger conversion written at exit.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

CHROME_SUFFIX = ".trace.json"
JAEGER_SUFFIX = ".jaeger.json"
_SEGMENT_NAME = re.compile(r"^rank(\d+)(?:\.(\d+))?\.trace\.json$")
_READ_CHUNK = 1 << 16


class TraceFileError(ValueError):
    """A file that is not a Chrome trace-event JSON document (or a directory without any)."""


def chrome_path(directory: str, rank: int, segment: int = 0) -> str:
    """Path of ``rank``'s Chrome segment: 0 is the newest (``rank{R}.trace.json``), N > 0 older ones."""
    name = f"rank{rank}{CHROME_SUFFIX}" if segment == 0 else f"rank{rank}.{segment}{CHROME_SUFFIX}"
    return os.path.join(directory, name)


def jaeger_path(directory: str, rank: int) -> str:
    """Path of ``rank``'s Jaeger file, written at exit."""
    return os.path.join(directory, f"rank{rank}{JAEGER_SUFFIX}")


@dataclass(frozen=True)
class Segment:
    """One Chrome trace file of one rank.

    Attributes:
        path: The file.
        rank: Rank that wrote it.
        age: 0 for the newest segment, larger for older ones.
    """

    path: str
    rank: int
    age: int


def rank_segments(directory: str) -> list[Segment]:
    """The Chrome trace files in ``directory``, by rank, oldest segment first within a rank.

    Raises:
        TraceFileError: ``directory`` is not a directory.
    """
    if not os.path.isdir(directory):
        raise TraceFileError(f"{directory} is not a directory (expected a trace directory holding rank*.trace.json)")
    segments = []
    for name in os.listdir(directory):
        match = _SEGMENT_NAME.match(name)
        if match:
            segments.append(Segment(os.path.join(directory, name), int(match[1]), int(match[2] or 0)))
    return sorted(segments, key=lambda s: (s.rank, -s.age))


def expand_inputs(inputs: Sequence[str]) -> list[str]:
    """Trace files named by ``inputs``: files as given, directories replaced by their segments in order.

    Raises:
        TraceFileError: An input that does not exist, or a directory with no trace file.
    """
    paths: list[str] = []
    for item in inputs:
        if os.path.isdir(item):
            found = [segment.path for segment in rank_segments(item)]
            if not found:
                raise TraceFileError(f"{item} holds no rank*.trace.json file")
            paths.extend(found)
        elif os.path.isfile(item):
            paths.append(item)
        else:
            raise TraceFileError(f"{item} does not exist (expected a *.trace.json file or a trace directory)")
    return paths


class _Cursor:
    """A read position in a text file that keeps only the unread part in memory."""

    def __init__(self, path: str, file: Any) -> None:
        self.path = path
        self._file = file
        self.text = ""
        self.pos = 0
        self.eof = False
        self._consumed = 0  # characters dropped from the front, for error positions

    def more(self) -> bool:
        """Read another chunk; ``False`` at the end of the file."""
        if self.eof:
            return False
        chunk = self._file.read(_READ_CHUNK)
        if not chunk:
            self.eof = True
            return False
        if self.pos > _READ_CHUNK:
            self._consumed += self.pos
            self.text, self.pos = self.text[self.pos :], 0
        self.text += chunk
        return True

    def skip_space(self) -> str:
        """Skip whitespace; the next character, or ``""`` at the end of the file."""
        while True:
            while self.pos < len(self.text) and self.text[self.pos] in " \t\r\n":
                self.pos += 1
            if self.pos < len(self.text):
                return self.text[self.pos]
            if not self.more():
                return ""

    def expect(self, char: str, what: str) -> None:
        if self.skip_space() != char:
            raise self.error(f"expected {char!r} {what}")
        self.pos += 1

    def value(self, decoder: json.JSONDecoder) -> Any:
        """Decode one JSON value at the cursor, reading more of the file while it is cut short."""
        self.skip_space()
        while True:
            try:
                value, end = decoder.raw_decode(self.text, self.pos)
            except json.JSONDecodeError as exc:
                # A value cut at the chunk boundary fails like a malformed one: read on and retry.
                if self.more():
                    continue
                raise self.error(exc.msg) from None
            # A number ending exactly at the chunk's end may go on in the next chunk.
            if end >= len(self.text) and self.more():
                continue
            self.pos = end
            return value

    def error(self, message: str) -> TraceFileError:
        return TraceFileError(
            f"{self.path} is not a Chrome trace-event JSON file: {message} at character {self._consumed + self.pos}"
        )


def iter_events(path: str) -> Iterator[dict[str, Any]]:
    """The events of one Chrome trace file, one at a time, in file order.

    Accepts ``{"traceEvents": [...], ...}`` (keys before ``traceEvents`` are skipped, keys after
    it are not read) and a bare ``[...]`` array. Memory stays at about one read chunk plus one
    event, whatever the file's size.

    Raises:
        TraceFileError: The file cannot be read or is not such a document.
        OSError: Propagated from opening the file.
    """
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as file:
        cursor = _Cursor(path, file)
        first = cursor.skip_space()
        if first == "{":
            cursor.pos += 1
            while True:
                key = cursor.value(decoder)
                if not isinstance(key, str):
                    raise cursor.error("expected an object key")
                cursor.expect(":", "after an object key")
                if key == "traceEvents":
                    break
                cursor.value(decoder)
                if cursor.skip_space() != ",":
                    raise cursor.error('no "traceEvents" array')
                cursor.pos += 1
        elif first != "[":
            raise cursor.error("expected '{' or '['")
        cursor.expect("[", "opening the event array")
        if cursor.skip_space() == "]":
            return
        while True:
            event = cursor.value(decoder)
            if isinstance(event, dict):
                yield event
            separator = cursor.skip_space()
            cursor.pos += 1
            if separator == "]":
                return
            if separator != ",":
                raise cursor.error("expected ',' or ']' between events")
