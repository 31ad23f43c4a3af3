"""The demo's HTML report opened in headless Chromium: the plots render, one per series, with the
origin marked, and the screenshot is a drawn page (not blank).

The run is the demo's ``nan`` scenario on 2 ranks, every step diagnosed, a NaN planted at step 3.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from typing import Any

import pytest

from tests.browser import Elements, dump_dom, png_pixels, screenshot

ORIGIN_RED = (214, 39, 40)  # --origin in report.css
LINE_BLUE = (31, 119, 180)  # --line


def _demo_page(work: Any, scenario: str, *args: str) -> dict[str, Any]:
    command = [
        sys.executable,
        "-m",
        "fsdp_patch",
        "demo",
        "--scenario",
        scenario,
        "--steps",
        "6",
        "--precision-every",
        "1",
        "--trace-dir",
        "traces",
        "--progress",
        "lines",
        *args,
    ]
    done = subprocess.run(command, cwd=work, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{' '.join(command)} exited {done.returncode}:\n{done.stderr[-3000:]}"
    path = work / "traces" / "report.html"
    text = path.read_text(encoding="utf-8")
    found = re.search(r'<script type="application/json" id="report-data">(.*?)</script>', text, re.S)
    assert found is not None, "report.html holds no report-data script"
    return {"path": path, "data": json.loads(found.group(1)), "dom": Elements(dump_dom(path)), "work": work}


@pytest.fixture(scope="module")
def page(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _demo_page(tmp_path_factory.mktemp("html"), "nan")


def test_the_float8_casts_are_tabled_with_the_flushed_input(tmp_path: Any) -> None:
    """The demo's fp8-outlier run (a feature of blocks.0.fc1's output 1e6 from step 3): the page
    tables every float8 cast the JSON holds, blocks.0.fc2's input among them with its share flushed
    and its scale's fall over the run."""
    from tests.fsdp.float8_models import require_torchao

    require_torchao()
    page = _demo_page(tmp_path, "fp8-outlier", "--plant-step", "3")
    casts, texts = page["data"]["float8"], page["dom"].texts
    captions = [text for tag, text in texts if tag == "h3" and text.startswith("Float8 casts")]
    assert len(captions) == 1, f"want the float8 table's caption once, got {captions}"
    cells = [text for tag, text in texts if tag == "td"]
    rows = [(cells[i], cells[i + 1]) for i in range(len(cells) - 1) if cells[i].startswith("blocks.")]
    want = {(c["module"], c["role"]) for c in casts}
    assert want and want <= set(rows), f"every cast of the JSON tabled: missing {sorted(want - set(rows))}"
    flushed = next(c for c in casts if (c["module"], c["role"]) == ("blocks.0.fc2", "input"))
    assert flushed["flushed"] > 0.9 and len(flushed["scale_trend"]) == 6, f"blocks.0.fc2's input: {flushed}"
    assert any("(step 1) to" in text for tag, text in texts if tag == "td"), "no scale trend drawn in the table"


def test_every_series_is_drawn_once_with_all_its_points(page: dict[str, Any]) -> None:
    data, dom = page["data"], page["dom"]
    figures = dom.with_class("plot")
    got = [f.get("data-series") for f in figures]
    want = [s["key"] for s in data["series"]]
    assert got == want, f"one plot per series in order: want {want}, got {got}"
    assert len(want) >= 6, f"the report's six columns at least; got {want}"
    drawn = {f["data-series"]: int(f.get("data-rendered", "-1")) for f in figures}
    points = {s["key"]: len(s["points"]) for s in data["series"]}
    assert drawn == points, f"points drawn per plot: want {points}, got {drawn}"
    body = [attrs for tag, attrs in dom.found if tag == "body"]
    assert body and body[0].get("data-rendered") == "true", "the page's script did not run to its end"


def test_the_origin_is_marked_on_every_plot_and_named_first(page: dict[str, Any]) -> None:
    data, dom = page["data"], page["dom"]
    origin = data["markers"]["origin"]
    assert origin is not None and origin["step"] == 3, f"the NaN was planted at step 3; got {origin}"
    marks = dom.with_class("marker-origin")
    assert len(marks) == len(data["series"]), f"one origin line per plot: {len(data['series'])}, got {len(marks)}"
    findings = dom.with_class("finding")
    got = [f.get("data-check") for f in findings]
    want = [f["check"] for f in data["findings"]]
    assert got == want and got[0] == "origin", f"findings in the report's order, origin first: got {got}"
    # A NaN-holding step is drawn as a cross at the top of the grad amax's plot.
    assert dom.with_class("point-nonfinite"), "no NaN/Inf point drawn"


def test_the_screenshot_is_a_drawn_page_with_the_origin_line(page: dict[str, Any]) -> None:
    shot = screenshot(page["path"], page["work"] / "report.png", width=1000, height=1500)
    width, height, pixels = png_pixels(shot)
    inked = sum(1 for p in pixels if p != (255, 255, 255)) / len(pixels)
    colors = len(set(pixels))

    def near(want: tuple[int, int, int]) -> int:
        return sum(1 for p in pixels if all(abs(a - b) <= 12 for a, b in zip(p, want, strict=True)))

    assert 0.02 < inked < 0.9, f"share of non-white pixels in {width}x{height}: want 2-90%, got {inked:.1%}"
    assert colors > 50, f"a drawn page has many colours (text, lines, badges); got {colors}"
    assert near(ORIGIN_RED) > 200, f"the red origin line and badges are visible: got {near(ORIGIN_RED)} red pixels"
    assert near(LINE_BLUE) > 200, f"the series' blue lines are visible: got {near(LINE_BLUE)} blue pixels"
