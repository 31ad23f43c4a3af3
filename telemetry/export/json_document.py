"""A JSON document on disk that is complete after every append: what the trace files are written with.

Items go between a fixed prefix and suffix; each append writes its items over the old suffix and
the suffix after them, so that a run that crashes between appends leaves a readable document.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["JsonDocumentFile"]


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
