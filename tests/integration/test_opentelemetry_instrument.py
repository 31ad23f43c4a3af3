"""``opentelemetry-instrument`` loads the instrumentor from the installed package metadata.

A 2-rank training script that never calls ``fully_shard_optimizer`` nor sets
``FSDP_PATCH_TELEMETRY`` runs under ``opentelemetry-instrument`` and torchrun with the console span
exporter; its step spans must appear, from both ranks, with the rank identity on every resource
(the resource detector ``fsdp_patch``). The entry point is found the way the command finds
it, through the ``opentelemetry_instrumentor`` entry points of installed distributions.

Which installation: the one the job itself sees, asked of the interpreter run outside the checkout
(inside it, the ``fsdp_patch.egg-info`` that an editable install leaves in the source tree would be
found first, and it records no install location). That is this checkout's after ``make test``'s
editable install; where it is another checkout's (or none), this checkout is installed for the
job alone, into a folder put first on its path, by the interpreter's own pip (never by the base
interpreter, whose packages, such as ``wheel``, the test must not depend on).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from fsdp_patch.telemetry import semconv

from tests.package_source import copy_package_source

REPO = Path(__file__).resolve().parents[2]
STEPS = 3
WORLD = 2

SCRIPT = f"""
import os, sys
import torch, torch.distributed as dist

sys.path.insert(0, {str(REPO)!r})  # the test helpers only; fsdp_patch comes from the installation
from tests import models

rank = int(os.environ["RANK"])
# Each rank's console exporter writes to its own file: spans of two ranks never interleave.
os.dup2(os.open(f"rank{{rank}}.out", os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 1)
dist.init_process_group("gloo")
model = models.shard_model(models.make_model(0).bfloat16())  # bf16 main grads: steps need the adapter
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # no fully_shard_optimizer call
for tokens in models.make_batches({STEPS}):
    models.lm_loss(model, models.rank_slice(tokens, rank, {WORLD})).backward()
    optimizer.step()
    optimizer.zero_grad()
dist.destroy_process_group()
"""


_FIND_INSTALLATION = """
import json
from importlib import metadata
try:
    dist = metadata.distribution("fsdp-patch")
except metadata.PackageNotFoundError:
    print("{}")
else:
    names = [ep.name for ep in dist.entry_points if ep.group == "opentelemetry_instrumentor"]
    print(json.dumps({"direct_url": json.loads(dist.read_text("direct_url.json") or "{}"), "entry_points": names}))
"""


def installation_seen_by_jobs(python: str, cwd: Path, env: dict[str, str]) -> dict:
    """What ``importlib.metadata`` finds for ``fsdp-patch`` in a job run by ``python`` from ``cwd``."""
    found = subprocess.run(
        [python, "-c", _FIND_INSTALLATION], cwd=cwd, env=env, capture_output=True, text=True, timeout=60, check=True
    )
    return json.loads(found.stdout)


def _job_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("FSDP_PATCH_", "OTEL_", "PYTHONPATH"))}


@pytest.fixture(scope="module")
def job_python_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """PYTHONPATH for the job: empty where this checkout is the installation it sees."""
    outside = tmp_path_factory.mktemp("outside")
    seen = installation_seen_by_jobs(sys.executable, outside, _job_env())
    direct_url = seen.get("direct_url", {})
    if direct_url.get("url") == REPO.as_uri() and seen.get("entry_points") == ["fsdp_patch"]:
        return ""
    target, source = tmp_path_factory.mktemp("installed"), tmp_path_factory.mktemp("source")
    copy_package_source(source)  # built from a copy: the build leaves nothing in the checkout
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert install.returncode == 0, (
        f"the job sees {seen or 'no fsdp-patch'}, and pip install {REPO} failed:\n{install.stderr}"
    )
    env = {**_job_env(), "PYTHONPATH": str(target)}
    seen = installation_seen_by_jobs(sys.executable, outside, env)
    assert seen.get("entry_points") == ["fsdp_patch"], f"installed into {target}, the job sees {seen}"
    return str(target)


@pytest.fixture(scope="module")
def instrumented_job(job_python_path: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The 2-rank job run once under ``opentelemetry-instrument`` and torchrun: its stderr, the spans
    and the metrics (console exporters) of each rank."""
    python = sys.executable
    tmp_path = tmp_path_factory.mktemp("instrumented")
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = _job_env()
    if job_python_path:
        env["PYTHONPATH"] = job_python_path
    env.update(
        OTEL_TRACES_EXPORTER="console",
        OTEL_METRICS_EXPORTER="console",  # exported once, at exit
        OTEL_METRIC_EXPORT_INTERVAL="600000",
        OTEL_LOGS_EXPORTER="none",
        OTEL_SERVICE_NAME="instrumented-job",
        # OpenTelemetry's distro (dev installs it beside ours) with the rank identity's resource detector.
        OTEL_PYTHON_DISTRO="distro",
        OTEL_EXPERIMENTAL_RESOURCE_DETECTORS="fsdp_patch",
        FSDP_PATCH_PRECISION_EVERY="0",
        FSDP_PATCH_TRACE_DIR=str(tmp_path / "traces"),
    )
    # `opentelemetry-instrument torchrun --standalone --nproc-per-node 2 train.py`, for this interpreter.
    launcher = "import sys; from opentelemetry.instrumentation.auto_instrumentation import run; run()"
    torchrun = [python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}"]
    result = subprocess.run(
        [python, "-c", launcher, *torchrun, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, f"want exit 0, got {result.returncode}:\n{result.stderr[-4000:]}"
    outputs = {rank: (tmp_path / f"rank{rank}.out").read_text() for rank in range(WORLD)}
    return {
        "stderr": result.stderr,
        "spans": {rank: _console_spans(text) for rank, text in outputs.items()},
        "metrics": {rank: _console_metrics(text) for rank, text in outputs.items()},
        "trace_dir": tmp_path / "traces",
    }


def test_opentelemetry_instrument_traces_a_two_rank_job(instrumented_job):
    spans = [s for rank in range(WORLD) for s in instrumented_job["spans"][rank]]
    steps = [s for s in spans if s["name"] == semconv.SPAN_STEP]
    got = sorted((s["attributes"][semconv.ATTR_RANK], s["attributes"][semconv.ATTR_STEP]) for s in steps)
    want = sorted((rank, step) for rank in range(WORLD) for step in range(1, STEPS + 1))
    assert got == want, f"want step spans (rank, step) {want}, got {got}; stderr:\n{instrumented_job['stderr'][-2000:]}"
    assert {s["resource"]["attributes"]["service.name"] for s in steps} == {"instrumented-job"}
    assert {s["attributes"][semconv.ATTR_GROUPS_COUNT] for s in steps} == {3}  # two blocks and the root
    # the SDK the distro configured is used: nothing of the embedded default was written
    assert not instrumented_job["trace_dir"].exists()


def test_every_span_and_series_carries_the_rank_identity_under_opentelemetry_instrument(instrumented_job):
    for rank in range(WORLD):
        want = {semconv.RESOURCE_RANK: rank, semconv.RESOURCE_WORLD_SIZE: WORLD}
        resources = [s["resource"]["attributes"] for s in instrumented_job["spans"][rank]]
        resources += [
            rm["resource"]["attributes"] for doc in instrumented_job["metrics"][rank] for rm in doc["resource_metrics"]
        ]
        assert instrumented_job["metrics"][rank], f"rank {rank} exported no metrics"
        wrong = [r for r in resources if {k: r.get(k) for k in want} != want]
        assert not wrong, f"rank {rank}: {len(wrong)} of {len(resources)} resources lack {want}, e.g. {wrong[0]}"
        assert {r["service.name"] for r in resources} == {"instrumented-job"}, (
            "the configured service name was replaced"
        )


def _json_documents(stdout: str, holds: tuple[str, ...]) -> list[dict]:
    """The JSON objects a console exporter printed that hold every key of ``holds``."""
    decoder = json.JSONDecoder()
    documents, index = [], 0
    while (start := stdout.find("{", index)) != -1:
        try:
            document, index = decoder.raw_decode(stdout, start)
        except json.JSONDecodeError:
            index = start + 1
            continue
        if isinstance(document, dict) and all(key in document for key in holds):
            documents.append(document)
    return documents


def _console_spans(stdout: str) -> list[dict]:
    """The JSON documents ConsoleSpanExporter prints, one per span."""
    return _json_documents(stdout, ("name", "context"))


def _console_metrics(stdout: str) -> list[dict]:
    """The JSON documents ConsoleMetricExporter prints, one per export."""
    return _json_documents(stdout, ("resource_metrics",))


def test_opentelemetry_instrument_with_nothing_set_says_where_spans_went(job_python_path: str, tmp_path: Path) -> None:
    """No OTEL_* but OpenTelemetry's distro chosen: it exports OTLP to localhost:4317. One line says so
    and how to get trace files; an unreachable collector is one line per process, not a retry
    warning per batch."""
    from tests.training_script import one_rank_training

    script = tmp_path / "train.py"
    script.write_text(one_rank_training(4, adapt=False))
    env = _job_env()
    if job_python_path:
        env["PYTHONPATH"] = job_python_path
    env["OTEL_PYTHON_DISTRO"] = "distro"  # opentelemetry-distro's (dev installs it beside ours)
    command = [str(Path(sys.executable).parent / "opentelemetry-instrument"), sys.executable, str(script)]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, f"want exit 0, got {result.returncode}:\n{result.stderr[-3000:]}"
    lines = result.stderr.splitlines()
    where = [line for line in lines if "spans go to the application's OpenTelemetry SDK" in line]
    assert len(where) == 1 and "localhost:4317" in where[0] and "trace_file" in where[0], (
        f"want one line naming the collector and how to get trace files, got {where}; stderr:\n{result.stderr[-2000:]}"
    )
    ours = [line for line in lines if "an OTLP exporter cannot deliver" in line]
    raw = [line for line in lines if ("Transient error" in line or "Failed to export" in line) and line not in ours]
    assert len(ours) <= 1 and not raw, f"want at most one folded failure line and no raw ones, got {ours} and {raw}"


@pytest.mark.parametrize(
    "configurator",
    [
        pytest.param(None, id="with-the-sdk-configurator"),
        # A configurator name nothing registers: opentelemetry-instrument loads none, as where
        # opentelemetry-distro is not installed; the instrumentor then builds the embedded default.
        pytest.param("no-such-configurator", id="without-a-configurator"),
    ],
)
def test_the_fsdp_patch_distro_writes_trace_files_and_the_summary_with_nothing_set(
    job_python_path: str, tmp_path: Path, configurator: str | None
) -> None:
    """``OTEL_PYTHON_DISTRO=fsdp_patch`` and no other OTEL_*: the step spans go to the trace files
    and the summary is printed, through the SDK's configurator or, with none, the embedded default."""
    from tests.training_script import one_rank_training

    steps = 3
    script = tmp_path / "train.py"
    script.write_text(one_rank_training(steps, adapt=False))
    env = {**_job_env(), "OTEL_PYTHON_DISTRO": "fsdp_patch", "FSDP_PATCH_TRACE_DIR": str(tmp_path / "traces")}
    if job_python_path:
        env["PYTHONPATH"] = job_python_path
    if configurator is not None:
        env["OTEL_PYTHON_CONFIGURATOR"] = configurator
    command = [str(Path(sys.executable).parent / "opentelemetry-instrument"), sys.executable, str(script)]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, f"want exit 0, got {result.returncode}:\n{result.stderr[-3000:]}"
    from fsdp_patch.telemetry.offline.trace_reading import iter_events, rank_segments

    segments = rank_segments(str(tmp_path / "traces")) if (tmp_path / "traces").is_dir() else []
    events = [event for segment in segments for event in iter_events(segment.path)]
    got = sorted((e.get("args") or {}).get(semconv.ATTR_STEP) for e in events if e.get("name") == semconv.SPAN_STEP)
    assert got == list(range(1, steps + 1)), (
        f"want step spans 1..{steps} in the trace files, got {got} from {segments}; stderr:\n{result.stderr[-2000:]}"
    )
    summaries = [line for line in result.stderr.splitlines() if "fsdp_patch telemetry summary" in line]
    assert summaries, f"want the exit summary on stderr, got:\n{result.stderr[-2000:]}"
    assert "no trace files are written" not in result.stderr, result.stderr[-2000:]


def test_the_fsdp_patch_distro_sets_only_what_is_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    """The distro fills unset or empty variables with the embedded default's values and keeps the user's."""
    from fsdp_patch.telemetry.instrumentation.distro import FSDPPatchDistro

    for variable in ("OTEL_TRACES_EXPORTER", "OTEL_LOGS_EXPORTER", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "prometheus")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", " ")
    monkeypatch.setenv("OTEL_EXPERIMENTAL_RESOURCE_DETECTORS", "host, process")
    variables = (
        "OTEL_TRACES_EXPORTER",
        "OTEL_METRICS_EXPORTER",
        "OTEL_LOGS_EXPORTER",
        "OTEL_EXPORTER_OTLP_PROTOCOL",
        "OTEL_EXPERIMENTAL_RESOURCE_DETECTORS",
    )
    want = {
        "OTEL_TRACES_EXPORTER": "trace_file",
        "OTEL_METRICS_EXPORTER": "prometheus",
        "OTEL_LOGS_EXPORTER": "none",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_EXPERIMENTAL_RESOURCE_DETECTORS": "host,process,fsdp_patch",
    }
    for attempt in ("first", "again"):  # configuring twice adds nothing twice
        FSDPPatchDistro().configure()
        got = {v: os.environ.get(v) for v in variables}
        assert got == want, f"{attempt}: want {want}, got {got}"


@pytest.mark.parametrize(
    ("environment", "want"),
    [
        (
            {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"},
            {"fsdp.rank": 3, "fsdp.world_size": 4, "fsdp.local_rank": 1},
        ),
        ({}, {}),  # before init_process_group and without torchrun: unknown, nothing detected
    ],
    ids=["torchrun-environment", "rank-unknown"],
)
def test_the_rank_resource_detector_detects_the_rank_where_it_is_known(
    monkeypatch: pytest.MonkeyPatch, environment: dict[str, str], want: dict[str, int]
) -> None:
    from fsdp_patch.telemetry.export.resource import RankResourceDetector
    from opentelemetry.sdk.resources import Resource

    for variable in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(variable, raising=False)
    for variable, value in environment.items():
        monkeypatch.setenv(variable, value)
    import torch.distributed as dist

    assert not dist.is_initialized(), "this test wants no default process group in the test process"
    got = dict(RankResourceDetector().detect().attributes)
    assert got == want, f"want {want}, got {got}"
    # through the SDK's own seam: the entry point named in OTEL_EXPERIMENTAL_RESOURCE_DETECTORS
    monkeypatch.setenv("OTEL_EXPERIMENTAL_RESOURCE_DETECTORS", "fsdp_patch")
    created = {k: v for k, v in Resource.create().attributes.items() if k.startswith("fsdp.")}
    assert created == want, f"Resource.create() with the detector named: want {want}, got {created}"
