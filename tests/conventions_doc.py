"""Reading docs/conventions.md, the page that fixes the names dashboards and users rely on.

The tests compare the code with this page's sections and tables; these helpers find a section by
its heading and read a Markdown table's rows as lists of cells.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONVENTIONS = REPO / "docs" / "conventions.md"


def conventions_text() -> str:
    """The whole page."""
    return CONVENTIONS.read_text(encoding="utf-8")


def section(heading: str, text: str | None = None) -> str:
    """The body under the heading ``heading`` (any level), up to the next heading of that level or above."""
    text = conventions_text() if text is None else text
    match = re.search(rf"^(#+) {re.escape(heading)}\n", text, re.M)
    assert match, f"{CONVENTIONS.name} has no heading {heading!r}"
    level = len(match[1])
    rest = text[match.end() :]
    end = re.search(rf"^#{{1,{level}}} ", rest, re.M)
    return rest[: end.start()] if end else rest


def table_rows(body: str, first_column: str) -> list[list[str]]:
    """The rows (cells stripped, header and rule left out) of the table in ``body`` whose header's
    first column is ``first_column``."""
    lines = body.splitlines()
    for i, line in enumerate(lines):
        cells = _cells(line)
        if cells and cells[0] == first_column:
            rows = []
            for row in lines[i + 2 :]:
                if not row.startswith("|"):
                    break
                rows.append(_cells(row))
            return rows
    raise AssertionError(f"no table with first column {first_column!r} in {CONVENTIONS.name}:\n{body}")


def code_spans(cell: str) -> list[str]:
    """The `quoted` names in a cell, in order."""
    return re.findall(r"`([^`]+)`", cell)


def _cells(line: str) -> list[str]:
    if not line.startswith("|"):
        return []
    return [c.strip() for c in line.strip().strip("|").split("|")]
