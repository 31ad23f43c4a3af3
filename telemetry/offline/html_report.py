"""The precision report as one HTML page: ``fsdp-patch report TRACE_DIR --html OUT.html``.

The page holds per-step plots of what the text report tabulates (every diagnostic the precision
spans carry, each with the thresholds that judge it), the GradScaler's skipped iterations, the
step where the first NaN/Inf began and the escalated iterations marked on every plot, one line
per rank where the ranks' files differ, and the findings with the places they name: the same
findings, advice and detail lines as the text report (:mod:`.findings`).

It is one self-contained file: the run's data sits in the page as JSON and a small script draws
the plots as SVG when the page opens, so it needs no network, no server and no plotting
package, and opens in any browser wherever the file is copied. No torch and no OpenTelemetry
here.

[Note: why the browser draws the plots]
The alternative, SVG drawn in Python, would put every point's markup in the file; drawing from
the data keeps the file a few kilobytes per diagnosed step and the data readable in one place
(``<script id="report-data">``), which is also what a reader copies into a notebook.
"""

from __future__ import annotations

import html
import json
import math
import os
import re
import tempfile
from importlib import resources
from typing import Any

from .. import precision_thresholds as thresholds
from .. import semconv
from .findings import DEFAULT_MAX_LINES, range_lines
from .precision_report import render, run_json
from .run_trace import COLUMNS, RunTrace, read_run

# The report columns' headers label their plots; the other diagnostics (the attribution's
# whole-model values) are labelled from their names.
_LABELS = {key: header for key, header, _ in COLUMNS}
PAGE_FILES = "report_page"
SKIPPED_SERIES = "gradscaler.skipped.scale"
"""The series of GradScaler scales at skipped iterations (no precision attribute: its own key)."""


def _value(key: str, value: float) -> float | str:
    """A value as the page's JSON holds it: non-finite values and the grad amax's "no finite
    largest value" marker as strings, which the plots draw as crosses at the top."""
    if math.isnan(value):
        return "nan"
    if math.isinf(value) or (key == semconv.METRIC_GRAD_AMAX and value >= thresholds.GRAD_AMAX_NONFINITE_MARK):
        return "inf"
    return value


def _points(samples: dict[int, dict[str, float]], key: str, step_offset: int) -> list[list[float | str]]:
    return [[step + step_offset, _value(key, values[key])] for step, values in sorted(samples.items()) if key in values]


def _ranks_differ(run: RunTrace, key: str) -> bool:
    seen = [_points(samples, key, 0) for _, samples in sorted(run.rank_samples.items())]
    return any(points != seen[0] for points in seen[1:])


def _thresholds(key: str) -> list[dict[str, Any]]:
    return [
        {
            "check": t.check,
            "severity": t.severity,
            "above": t.above,
            "at_most": t.at_most,
        }
        for t in thresholds.THRESHOLDS
        if t.metric == key
    ]


def series(run: RunTrace, step_offset: int = 0) -> list[dict[str, Any]]:
    """One plot's data per diagnostic the run's precision spans carry, in the text report's column
    order then the attribution's, and the GradScaler's skipped iterations when there are any."""
    present = {key for values in run.samples.values() for key in values}
    keys = [key for key, _, _ in COLUMNS if key in present]
    keys += sorted(present - set(keys))
    out: list[dict[str, Any]] = []
    for key in keys:
        entry: dict[str, Any] = {
            "key": key,
            "label": _LABELS.get(key, key.removeprefix("fsdp.precision.").replace(".", " ").replace("_", " ")),
            "points": _points(run.samples, key, step_offset),
            "thresholds": _thresholds(key),
        }
        if _ranks_differ(run, key):
            entry["ranks"] = {
                str(rank): _points(samples, key, step_offset) for rank, samples in sorted(run.rank_samples.items())
            }
        out.append(entry)
    by_rank = {
        str(rank): [[step + step_offset, _value("", scale)] for _, scale, step in sorted(steps.skipped)]
        for rank, steps in sorted(run.iterations.ranks.items())
        if steps.skipped
    }
    if by_rank:
        merged = sorted({(p[0], p[1]) for points in by_rank.values() for p in points}, key=lambda p: p[0])
        skipped: dict[str, Any] = {
            "key": SKIPPED_SERIES,
            "label": "GradScaler scale at skipped iterations",
            "points": [list(p) for p in merged],
            "thresholds": [],
            "scatter": True,
        }
        if len({json.dumps(points) for points in by_rank.values()}) > 1:
            skipped["ranks"] = by_rank
        out.append(skipped)
    return out


def page_data(run: RunTrace, source: str, max_lines: int = DEFAULT_MAX_LINES, step_offset: int = 0) -> dict[str, Any]:
    """Everything the page shows: :func:`.precision_report.run_json` (ranges, verdict, findings
    with their detail lines, origin, audits) plus the plots' series and markers, and the text
    report itself."""
    lines = range_lines(run, max_lines)
    data: dict[str, Any] = run_json(run, lines, source, step_offset)
    first = run.iterations.first()
    origin_finding = next((f for f in data["findings"] if f["check"] == thresholds.NAN_ORIGIN.check), None)
    data["first_step"] = (run.first_step or 1) + step_offset
    data["series"] = series(run, step_offset)
    data["markers"] = {
        "origin": None
        if first is None
        else {
            "step": first.step + step_offset,
            "text": origin_finding["finding"] if origin_finding else "the first NaN/Inf began",
        },
        "escalations": sorted(step + step_offset for step in run.iterations.escalations),
        "failed": sorted(step + step_offset for step in run.failed_steps),
    }
    data["text_report"] = render(run, lines, source, step_offset)
    return data


def _asset(name: str) -> str:
    return resources.files(__package__).joinpath(PAGE_FILES).joinpath(name).read_text(encoding="utf-8")


def _json_safe(value: Any) -> Any:
    """``value`` with its non-finite floats as strings: JSON, and so the page's parser, has no NaN/Inf."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {key: _json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(item) for item in value]
    return value


def render_html(data: dict[str, Any]) -> str:
    """The page for :func:`page_data`'s data: the template with the style, script and data inlined."""
    # "<" escaped in the JSON (JSON.parse reads \u003c back): a parameter or module name holding
    # "</script>" or "<!--" would otherwise end or change the script element it sits in.
    parts = {
        "title": html.escape(f"precision report: {data['source']}"),
        "style": _asset("report.css"),
        "data": json.dumps(_json_safe(data), allow_nan=False).replace("<", "\\u003c"),
        "script": _asset("report.js"),
    }
    # One pass, so that a placeholder's text inside the data is never replaced in turn.
    return re.sub(r"\{\{(title|style|data|script)\}\}", lambda m: parts[m.group(1)], _asset("report.html"))


def report_html(directory: str, max_lines: int = DEFAULT_MAX_LINES, step_offset: int = 0) -> str:
    """Read ``directory``'s trace files and return the HTML report.

    Raises:
        TraceFileError: See :func:`.run_trace.read_run`.
    """
    return render_html(page_data(read_run(directory), directory, max_lines, step_offset))


class HtmlOutputError(ValueError):
    """The path given for the HTML report cannot hold it (a missing folder, a folder)."""


def write_report_html(directory: str, out: str, max_lines: int = DEFAULT_MAX_LINES, step_offset: int = 0) -> None:
    """Write the HTML report of ``directory``'s trace files to ``out``, whole or not at all: the
    page goes to a temporary file beside ``out`` that replaces it once written, so a reader never
    opens half a page and an earlier report survives a failed run of this one.

    Raises:
        HtmlOutputError: ``out`` is a folder, or its folder does not exist.
        TraceFileError: See :func:`.run_trace.read_run`.
    """
    folder = os.path.dirname(os.path.abspath(out))
    if os.path.isdir(out):
        raise HtmlOutputError(f"{out} is a folder; expected a file path such as {os.path.join(out, 'report.html')}")
    if not os.path.isdir(folder):
        raise HtmlOutputError(f"{out}: its folder does not exist; expected a file path in an existing folder")
    page = report_html(directory, max_lines, step_offset)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".fsdp-patch-report-", suffix=".html")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(page)
        os.chmod(tmp, 0o644)
        os.replace(tmp, out)
    except BaseException:
        os.unlink(tmp)
        raise
