"""The HTML report's data and file, on trace files written by the real exporter.

That the page draws its plots in a browser: tests/cli/test_html_report_in_browser.py.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
from fsdp_patch.app.cli import main
from fsdp_patch.telemetry import semconv
from fsdp_patch.telemetry.export import trace_files
from fsdp_patch.telemetry.offline import html_report
from fsdp_patch.telemetry.offline.run_trace import read_run
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

AMAX_MARK = 3.4028234663852886e38  # what the diagnostics record as grad amax once a grad holds NaN/Inf


def _write(directory: Path, values: dict[int, dict[int, dict[str, float]]], steps: int) -> None:
    """Step spans 1..steps on each rank of ``values`` (rank -> step -> precision attributes), with a
    precision child where that rank's step has values."""
    for rank, by_step in values.items():
        exporter = trace_files.TraceFileExporter(
            str(directory), rank, {"fsdp.world_size": len(values)}, jaeger_at_shutdown=False
        )
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        tracer = provider.get_tracer("t")
        for step in range(1, steps + 1):
            with tracer.start_as_current_span(semconv.SPAN_STEP, attributes={semconv.ATTR_STEP: step}):
                if step in by_step:
                    with tracer.start_as_current_span(semconv.SPAN_PRECISION) as child:
                        child.set_attributes(by_step[step])
        provider.shutdown()


def _embedded(page: str) -> dict:
    found = re.search(r'<script type="application/json" id="report-data">(.*?)</script>', page, re.S)
    assert found is not None, "the page holds no report-data script"
    return json.loads(found.group(1))


AMAX, LOST = semconv.METRIC_GRAD_AMAX, semconv.METRIC_LOST_RATIO


def test_one_series_per_diagnostic_with_every_diagnosed_step(tmp_path: Path) -> None:
    same = {1: {AMAX: 0.5, LOST: 0.1}, 2: {AMAX: 0.7, LOST: 0.2}, 5: {AMAX: float("nan"), LOST: 0.3}}
    _write(tmp_path, {0: same, 1: same}, steps=6)
    series = {s["key"]: s for s in html_report.series(read_run(str(tmp_path)))}

    assert sorted(series) == sorted([AMAX, LOST]), f"want one series per diagnostic written, got {sorted(series)}"
    got = series[AMAX]["points"]
    assert got == [[1, 0.5], [2, 0.7], [5, "nan"]], f"grad amax points: got {got}"
    assert "ranks" not in series[AMAX], "ranks that agree are drawn as one line"
    checks = {t["check"] for t in series[LOST]["thresholds"]}
    assert "lost_updates" in checks, f"the lost-update plot carries its thresholds; got {checks}"


def test_ranks_that_differ_get_a_line_each_and_the_amax_marker_is_not_a_value(tmp_path: Path) -> None:
    rank0 = {1: {AMAX: 0.5}, 2: {AMAX: AMAX_MARK}}
    rank1 = {1: {AMAX: 0.5}}  # rank 1 did not diagnose step 2
    _write(tmp_path, {0: rank0, 1: rank1}, steps=2)
    (amax,) = html_report.series(read_run(str(tmp_path)), step_offset=100)

    assert amax["points"] == [[101, 0.5], [102, "inf"]], f"worst over ranks, offset steps: got {amax['points']}"
    want = {"0": [[101, 0.5], [102, "inf"]], "1": [[101, 0.5]]}
    assert amax.get("ranks") == want, f"per-rank lines: want {want}, got {amax.get('ranks')}"


def test_the_page_is_self_contained_and_its_data_survives_any_name(tmp_path: Path) -> None:
    _write(tmp_path, {0: {1: {AMAX: 0.5, LOST: 0.1}}}, steps=1)
    data = html_report.page_data(read_run(str(tmp_path)), "run </script><script>alert(1)</script>")
    data["extra"] = [float("inf"), float("nan")]
    page = html_report.render_html(data)

    got = _embedded(page)
    assert got["source"] == data["source"], f"the source name round-trips; got {got['source']!r}"
    assert got["extra"] == ["inf", "nan"], f"non-finite floats become strings JSON can hold; got {got['extra']}"
    assert page.count("<script") == 2, "a name holding </script> must not open or close a script element"
    # The only URL in the page is SVG's namespace, an identifier the browser never fetches.
    urls = set(re.findall(r"https?://[^\s\"')<]+", page))
    assert urls == {"http://www.w3.org/2000/svg"}, f"the page must fetch nothing; it names {urls}"
    for fetching in ("<link", " src=", "@import", "url("):
        assert fetching not in page, f"the page must load nothing from outside; it holds {fetching!r}"


def test_skipped_iterations_are_a_series_of_their_own_per_rank_where_ranks_differ(tmp_path: Path) -> None:
    from fsdp_patch.telemetry.offline.origin_report import RankSteps

    _write(tmp_path, {0: {1: {AMAX: 0.5}}, 1: {1: {AMAX: 0.5}}}, steps=1)
    run = read_run(str(tmp_path))
    run.iterations.ranks[0] = RankSteps(skipped=[(1.0, 1024.0, 2), (2.0, 512.0, 3)])
    run.iterations.ranks[1] = RankSteps(skipped=[(1.0, 1024.0, 2)])
    (skipped,) = [s for s in html_report.series(run) if s["key"] == html_report.SKIPPED_SERIES]

    assert skipped["points"] == [[2, 1024.0], [3, 512.0]], f"every skipped step's scale: {skipped['points']}"
    want = {"0": [[2, 1024.0], [3, 512.0]], "1": [[2, 1024.0]]}
    assert skipped.get("ranks") == want and skipped["scatter"], f"per rank, as points: {skipped}"


def test_page_data_marks_the_origin_escalations_and_failed_steps(tmp_path: Path) -> None:
    _write(tmp_path, {0: {1: {AMAX: 0.5}, 2: {AMAX: math.inf}}}, steps=3)
    run = read_run(str(tmp_path))
    run.failed_steps[3] = "TypeError"
    run.iterations.escalations.add(2)
    data = html_report.page_data(run, "x")

    assert data["markers"]["escalations"] == [2], f"got {data['markers']}"
    assert data["markers"]["failed"] == [3], f"got {data['markers']}"
    assert data["markers"]["origin"] is None, "no origin event was written"
    assert "precision report: x" in data["text_report"], "the text report rides along"
    checks = [f["check"] for f in data["findings"]]
    assert "failed_steps" in checks, f"the failed step is a finding; got {checks}"


def test_report_html_writes_the_page_and_still_prints_the_text(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    traces, out = tmp_path / "traces", tmp_path / "report.html"
    traces.mkdir()
    _write(traces, {0: {1: {AMAX: 0.5}}}, steps=1)

    assert main(["report", str(traces), "--html", str(out)]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith(f"precision report: {traces}"), f"stdout: {captured.out[:200]}"
    assert f"html report: {out}" in captured.err, f"stderr: {captured.err}"
    assert _embedded(out.read_text(encoding="utf-8"))["series"][0]["key"] == AMAX


@pytest.mark.parametrize("where", ["missing-folder", "a-folder"])
def test_a_bad_html_path_is_refused_by_name(tmp_path: Path, capsys: pytest.CaptureFixture[str], where: str) -> None:
    traces = tmp_path / "traces"
    traces.mkdir()
    _write(traces, {0: {1: {AMAX: 0.5}}}, steps=1)
    out = tmp_path / "no" / "r.html" if where == "missing-folder" else tmp_path

    assert main(["report", str(traces), "--html", str(out)]) == 2
    err = capsys.readouterr().err
    want = "does not exist" if where == "missing-folder" else "is a folder"
    assert f"--html {out}" in err and want in err, f"want the path and {want!r} named; got {err!r}"


def test_a_report_that_fails_leaves_the_earlier_page_whole(tmp_path: Path) -> None:
    out = tmp_path / "report.html"
    out.write_text("the earlier report", encoding="utf-8")
    empty = tmp_path / "empty"
    empty.mkdir()

    assert main(["report", str(empty), "--html", str(out)]) == 2
    assert out.read_text(encoding="utf-8") == "the earlier report", "a failed report must not touch the page"
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["empty", "report.html"], f"no temporary file may stay behind; got {left}"
