"""Bounded trace files: a size cap per rank with rotation, and streaming conversions.

A long run under a small ``max_bytes`` cap keeps each rank's files (Chrome segments and the
Jaeger file written at exit) under the cap, keeps the newest steps, and leaves every file
valid JSON. The Jaeger conversion and the merge read files larger than the cap in bounded
memory (measured with tracemalloc). The streaming reader takes any Chrome document layout.
"""

from __future__ import annotations

import json
import os
import re
import tracemalloc
from pathlib import Path

import pytest
from fsdp_patch.telemetry import trace_limits
from fsdp_patch.telemetry.export import trace_files
from fsdp_patch.telemetry.offline import trace_conversion, trace_reading
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

CAP = 64 << 10
PHASES = ("cast_grads", "inner_step", "restore_grads", "refresh")


def _write_steps(
    directory: Path, rank: int, steps: int, max_bytes: int, jaeger: bool = True
) -> trace_files.TraceFileExporter:
    """What the adapter emits per step (a step span and its phases), through a real SDK provider."""
    exporter = trace_files.TraceFileExporter(
        str(directory), rank, {"service.name": "svc", "fsdp.rank": rank}, jaeger_at_shutdown=jaeger, max_bytes=max_bytes
    )
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    for step in range(1, steps + 1):
        with tracer.start_as_current_span("fsdp.optimizer.step", attributes={"fsdp.step": step, "fsdp.rank": rank}):
            for phase in PHASES:
                with tracer.start_as_current_span(f"fsdp.optimizer.{phase}"):
                    pass
    provider.shutdown()
    return exporter


def _steps_in(path: str) -> list[int]:
    with open(path, encoding="utf-8") as f:
        document = json.load(f)  # raises if the file is not valid JSON
    return [e["args"]["fsdp.step"] for e in document["traceEvents"] if e.get("name") == "fsdp.optimizer.step"]


def test_long_run_under_small_cap_keeps_newest_steps_in_valid_files(tmp_path: Path) -> None:
    steps = 600  # about 1.3 MB of trace per rank uncapped: twenty times the cap
    for rank in (0, 1):
        _write_steps(tmp_path, rank, steps, CAP)
    for rank in (0, 1):
        files = sorted(p for p in tmp_path.iterdir() if p.name.startswith(f"rank{rank}."))
        names = [p.name for p in files]
        assert names == [f"rank{rank}.1.trace.json", f"rank{rank}.jaeger.json", f"rank{rank}.trace.json"], names
        total = sum(p.stat().st_size for p in files)
        assert total <= CAP, f"rank {rank}: files take {total} bytes, cap {CAP}"
        older = _steps_in(str(tmp_path / f"rank{rank}.1.trace.json"))
        newest = _steps_in(str(tmp_path / f"rank{rank}.trace.json"))
        kept = older + newest
        assert kept[-1] == steps, f"rank {rank}: newest kept step {kept[-1]}, want {steps}"
        assert kept == list(range(kept[0], steps + 1)), f"rank {rank}: kept steps are not the newest, contiguous ones"
        assert kept[0] > 1, f"rank {rank}: the oldest steps were kept (from {kept[0]}), the cap did not rotate"
        for segment in (older, newest):
            assert segment, f"rank {rank}: an empty segment"
        jaeger = json.loads((tmp_path / f"rank{rank}.jaeger.json").read_text())["data"]
        jaeger_steps = sorted(
            tag["value"]
            for trace in jaeger
            for span in trace["spans"]
            for tag in span["tags"]
            if span["operationName"] == "fsdp.optimizer.step" and tag["key"] == "fsdp.step"
        )
        assert jaeger_steps[-1] == steps and len(jaeger_steps) >= len(newest), (
            f"rank {rank}: the Jaeger file holds steps {jaeger_steps[:1]}..{jaeger_steps[-1:]}, want up to {steps}"
        )


def test_every_segment_opens_alone_with_its_process_metadata(tmp_path: Path) -> None:
    _write_steps(tmp_path, 3, 300, CAP, jaeger=False)
    for name in ("rank3.1.trace.json", "rank3.trace.json"):
        events = json.loads((tmp_path / name).read_text())["traceEvents"]
        got = [(e["name"], e["pid"]) for e in events[:3]]
        assert got == [("process_name", 3), ("process_sort_index", 3), ("thread_name", 3)], f"{name}: {got}"


def test_a_new_run_removes_the_earlier_runs_older_segments(tmp_path: Path) -> None:
    _write_steps(tmp_path, 0, 300, CAP)
    assert (tmp_path / "rank0.1.trace.json").exists()
    exporter = _write_steps(tmp_path, 0, 2, CAP, jaeger=False)
    left = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("rank0"))
    assert left == ["rank0.trace.json"], f"files after a short second run: {left}"
    assert _steps_in(str(tmp_path / "rank0.trace.json")) == [1, 2]
    assert exporter.written_paths() == [str(tmp_path / "rank0.trace.json")]


def test_no_cap_writes_one_growing_file(tmp_path: Path) -> None:
    _write_steps(tmp_path, 0, 300, 0, jaeger=False)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("rank")) == ["rank0.trace.json"]
    assert _steps_in(str(tmp_path / "rank0.trace.json")) == list(range(1, 301))


@pytest.fixture(scope="module")
def traces(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Uncapped traces of one rank: a small one, and a large one four times its size and far over CAP."""
    made = {}
    for name, steps in (("small", 1000), ("large", 4000)):
        directory = tmp_path_factory.mktemp(name)
        _write_steps(directory, 0, steps, 0, jaeger=False)
        made[name] = directory / "rank0.trace.json"
    return made


def _peak_bytes(fn, *args) -> int:
    tracemalloc.start()
    try:
        fn(*args)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize(
    "convert", [trace_conversion.write_jaeger, trace_conversion.merge_chrome_traces], ids=["jaeger", "merge"]
)
def test_conversion_memory_does_not_grow_with_the_file(traces: dict[str, Path], tmp_path: Path, convert) -> None:
    small, large = traces["small"].stat().st_size, traces["large"].stat().st_size
    assert large > 50 * CAP, f"the large input is only {large} bytes"
    peak_small = _peak_bytes(convert, [str(traces["small"])], str(tmp_path / "small.out"))
    peak_large = _peak_bytes(convert, [str(traces["large"])], str(tmp_path / "large.out"))
    # Loading a document whole takes several times its size; streaming holds a read chunk and
    # one trace, whatever the size: four times the input, (almost) the same peak.
    assert peak_large < 1.25 * peak_small, (
        f"peak Python memory {peak_large} bytes on {large} bytes of trace, {peak_small} on {small}: it grows with the file"
    )
    assert peak_large < large / 4, f"peak Python memory {peak_large} bytes on a {large}-byte trace, want < {large // 4}"


def test_streamed_jaeger_holds_every_trace(traces: dict[str, Path], tmp_path: Path) -> None:
    output = tmp_path / "out.jaeger.json"
    result = trace_conversion.write_jaeger([str(traces["small"])], str(output))
    data = json.loads(output.read_text())["data"]
    assert (len(data), result.traces, result.cut_short) == (1000, 1000, False)
    assert all(len(trace["spans"]) == 1 + len(PHASES) for trace in data)
    roots = [span for trace in data for span in trace["spans"] if not span["references"]]
    assert [span["operationName"] for span in roots] == ["fsdp.optimizer.step"] * 1000


def test_merge_keeps_every_event(traces: dict[str, Path], tmp_path: Path) -> None:
    output = tmp_path / "all.trace.json"
    count = trace_conversion.merge_chrome_traces([str(traces["small"])], str(output))
    merged = json.loads(output.read_text())["traceEvents"]
    original = json.loads(traces["small"].read_text())["traceEvents"]
    assert merged == original and count == len(original), "the merge changed the events"


def test_jaeger_output_cut_short_at_max_bytes_stays_valid(traces: dict[str, Path], tmp_path: Path) -> None:
    output = tmp_path / "cut.jaeger.json"
    result = trace_conversion.write_jaeger([str(traces["small"])], str(output), max_bytes=50_000)
    size = output.stat().st_size
    assert result.cut_short and size <= 50_000, f"cut_short={result.cut_short}, {size} bytes, want <= 50000"
    data = json.loads(output.read_text())["data"]
    assert len(data) == result.traces > 0


def test_directory_inputs_read_rotated_segments_oldest_first(tmp_path: Path) -> None:
    for rank in (1, 0):
        _write_steps(tmp_path, rank, 300, CAP, jaeger=False)
    got = [(s.rank, s.age) for s in trace_reading.rank_segments(str(tmp_path))]
    assert got == [(0, 1), (0, 0), (1, 1), (1, 0)], got
    output = tmp_path / "merged.json"
    count = trace_conversion.merge_chrome_traces([str(tmp_path)], str(output))
    steps = [
        e["args"]["fsdp.step"]
        for e in json.loads(output.read_text())["traceEvents"]
        if e["name"] == "fsdp.optimizer.step" and e["pid"] == 0
    ]
    assert steps == sorted(steps) and steps[-1] == 300, f"rank 0's steps in the merge: {steps[:3]}..{steps[-3:]}"
    assert count > 0


@pytest.mark.parametrize(
    "text",
    [
        '{"displayTimeUnit":"ms","traceEvents":[{"a":1},{"b":[1,2,{"c":"]"}]}]}',
        '{"other": {"x": [1, 2]}, "traceEvents" : [ {"a":1} , {"b":[1,2,{"c":"]"}]} ] , "later": 1}',
        '[{"a":1},{"b":[1,2,{"c":"]"}]}]',
    ],
    ids=["ours", "keys-before-and-after", "bare-array"],
)
def test_streaming_reader_accepts_chrome_layouts(tmp_path: Path, text: str) -> None:
    path = tmp_path / "t.json"
    path.write_text(text)
    got = list(trace_reading.iter_events(str(path)))
    assert got == [{"a": 1}, {"b": [1, 2, {"c": "]"}]}], got


def test_streaming_reader_reads_across_chunk_boundaries(tmp_path: Path) -> None:
    events = [{"name": "x" * (i % 97), "ts": 1000.5 + i, "args": {"n": i}} for i in range(5000)]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    assert os.path.getsize(path) > 4 * (1 << 16)
    got = list(trace_reading.iter_events(str(path)))
    assert got == events


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "expected '{' or '['"),
        ('{"x": 1}', 'no "traceEvents" array'),
        ('{"traceEvents": [{"a": 1} {"b": 2}]}', "expected ',' or ']'"),
    ],
    ids=["empty", "no-events", "missing-comma"],
)
def test_streaming_reader_names_what_is_wrong(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(text)
    both = f"(?s)(?=.*{re.escape(message)})(?=.*{re.escape(str(path))})"  # what is wrong and where, in any order
    with pytest.raises(trace_reading.TraceFileError, match=both):
        list(trace_reading.iter_events(str(path)))


@pytest.mark.parametrize(
    ("value", "want"),
    [
        ("", trace_limits.DEFAULT_TRACE_MAX_BYTES),
        ("0", 0),
        ("65536", 65536),
        ("64K", 65536),
        ("128M", 128 << 20),
        ("1GiB", 1 << 30),
    ],
)
def test_trace_max_bytes_values(value: str, want: int) -> None:
    got = trace_limits.trace_max_bytes({trace_limits.TRACE_MAX_BYTES: value})
    assert got == want, f"{value!r}: got {got}, want {want}"


@pytest.mark.parametrize("value", ["-1", "12X", "1.5M", "1000"])
def test_trace_max_bytes_rejects_bad_values_naming_them(value: str) -> None:
    both = f"(?s)(?=.*{re.escape(trace_limits.TRACE_MAX_BYTES)})(?=.*{re.escape(repr(value))})"
    with pytest.raises(ValueError, match=both):
        trace_limits.trace_max_bytes({trace_limits.TRACE_MAX_BYTES: value})
