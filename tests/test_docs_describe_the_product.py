"""The documentation speaks of the product: figures name the hardware they were measured on (as
data, with the command that made them), never "this machine", "today" or a development machine's
load, which mean nothing to a reader elsewhere or later."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = [
    REPO / "README.md",
    REPO / "CHANGELOG.md",
    REPO / "telemetry" / "README.md",
    *sorted((REPO / "docs").glob("*.md")),
    *sorted((REPO / "dashboards").glob("*.md")),
]
# Words that place a figure relative to where or when it was written.
PLACED = re.compile(r"\bthis (machine|cpu|host|vm)\b|\btoday\b|\bdevelopment machine\b|\bload (about|of) \d", re.I)


def test_the_docs_place_no_figure_on_this_machine_or_today() -> None:
    found = [
        f"{path.relative_to(REPO)}:{number}: {line.strip()}"
        for path in DOCS
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1)
        if PLACED.search(line)
    ]
    assert found == [], "lines that place a figure on 'this machine' or 'today':\n" + "\n".join(found)
