"""The precision report states only what the numbers support, and what its files could not show.

Trace files here are written by the real embedded default (trace-file exporter behind the SDK's
batch processor) from real diagnostics of the observer, and read back through ``fsdp-patch report``.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import fsdp_patch.telemetry as telemetry
import pytest
import torch
from fsdp_patch.app.cli import main as cli_main
from fsdp_patch.telemetry import OptimizerObserver, env, precision_thresholds
from fsdp_patch.telemetry.diagnostics import rows
from fsdp_patch.telemetry.export import providers
from fsdp_patch.telemetry.offline import precision_report
from telemetry_testing import Group, fake_optimizer, run_fake_step

FP16_RANGE_FINDING = precision_thresholds.BY_CHECK["grad_amax_fp16"].finding
NONFINITE_FINDING = precision_thresholds.BY_CHECK["nonfinite"].finding


def _bf16_group(grad_scale: float, nan_at: int | None = None) -> Group:
    main = torch.linspace(0.5, 1.5, 64)
    grad = torch.full((64,), grad_scale, dtype=torch.bfloat16)
    if nan_at is not None:
        grad[nan_at] = math.nan
    return Group(main, main.to(torch.bfloat16), grad)


def _report_of_steps(trace_dir: Path, groups_per_step: list[Group]) -> str:
    """The report of one run of the given steps, its trace files written to ``trace_dir``."""
    providers.reset()  # a fresh embedded default for this run
    os.environ[env.TRACE_DIR] = str(trace_dir)  # the autouse fixture restores the environment
    observer = OptimizerObserver(fake_optimizer(), precision_aware=False)
    for group in groups_per_step:
        run_fake_step(observer, [group], [group.main_weight + 0.25])
    telemetry.shutdown()
    return precision_report.report(str(trace_dir))


@pytest.fixture
def every_step(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FSDP_PATCH_PRECISION_EVERY", "1")
    monkeypatch.setenv("FSDP_PATCH_SUMMARY", "none")


def test_a_nan_grad_in_a_bf16_run_is_not_reported_as_grads_beyond_fp16(tmp_path: Path, every_step: None) -> None:
    text = _report_of_steps(tmp_path / "traces", [_bf16_group(0.01), _bf16_group(0.01, nan_at=3), _bf16_group(0.01)])
    assert NONFINITE_FINDING in text, f"the NaN grad is not reported:\n{text}"
    assert FP16_RANGE_FINDING not in text, (
        f"the report claims {FP16_RANGE_FINDING!r} for grads of max |g| 0.01 and one NaN:\n{text}"
    )
    nan_line = next(line for line in text.splitlines() if line.strip().startswith("2-2"))
    assert "nan/inf" in nan_line and "3.4e+38" not in nan_line, (
        f"the grad amax of a NaN step shows the marker as a number: {nan_line!r}"
    )


def test_a_finite_grad_beyond_fp16_is_still_reported(tmp_path: Path, every_step: None) -> None:
    text = _report_of_steps(tmp_path / "traces", [_bf16_group(0.01), _bf16_group(1.0e5)])
    assert FP16_RANGE_FINDING in text, f"a finite grad amax of 1e5 is not reported as beyond fp16:\n{text}"


def _report_of_tiny_updates(trace_dir: Path, nan_in_weights: bool) -> str:
    """Two steps whose main-weight updates (1e-6) are lost in bf16; with one NaN weight, or without."""
    providers.reset()
    os.environ[env.TRACE_DIR] = str(trace_dir)
    observer = OptimizerObserver(fake_optimizer(), precision_aware=False)
    for _ in range(2):
        group = _bf16_group(0.01)
        new = group.main_weight + 1e-6
        if nan_in_weights:
            new[0] = math.nan
        run_fake_step(observer, [group], [new])
    telemetry.shutdown()
    return precision_report.report(str(trace_dir))


def test_lost_updates_are_not_reported_on_steps_whose_weights_hold_nan(tmp_path: Path, every_step: None) -> None:
    lost = precision_thresholds.BY_CHECK["lost_updates"].finding
    clean = _report_of_tiny_updates(tmp_path / "clean", nan_in_weights=False)
    assert lost in clean, f"tiny updates without NaN are not reported as lost:\n{clean}"
    text = _report_of_tiny_updates(tmp_path / "nan", nan_in_weights=True)
    assert NONFINITE_FINDING in text and lost not in text, f"a NaN step is reported as lost updates:\n{text}"


def test_the_reports_marker_is_the_value_the_diagnostics_record() -> None:
    got, want = precision_thresholds.GRAD_AMAX_NONFINITE_MARK, rows.GRAD_AMAX_NONFINITE
    assert got == want, f"the report reads {got!r} as 'no finite grad amax', the diagnostics record {want!r}"


def test_a_report_of_rotated_traces_says_the_first_steps_are_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FSDP_PATCH_TRACE_MAX_BYTES", "64K")
    monkeypatch.setenv("FSDP_PATCH_PRECISION_EVERY", "10")
    monkeypatch.setenv("FSDP_PATCH_SUMMARY", "none")
    steps = 150
    text = _report_of_steps(tmp_path / "traces", [_bf16_group(0.01) for _ in range(steps)])
    run = precision_report.read_run(str(tmp_path / "traces"))
    assert run.first_step > 1 and run.last_step == steps, (
        f"the cap did not rotate steps away: {run.first_step}-{run.last_step}"
    )
    want_note = f"note: steps 1-{run.first_step - 1} are not in these files: they were rotated away"
    assert want_note in text, f"want {want_note!r} in the report:\n{text}"
    assert "FSDP_PATCH_TRACE_MAX_BYTES" in text, text
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:1] == ["steps"])
    first_range = lines[header + 1].split()[0]
    assert first_range.split("-")[0] == str(run.first_step), (
        f"the first range {first_range} starts before the first step the files hold ({run.first_step}):\n{text}"
    )


@pytest.mark.parametrize("make", ["missing", "empty"])
def test_report_without_trace_files_says_where_they_come_from(
    tmp_path: Path, make: str, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = tmp_path / "traces"
    if make == "empty":
        directory.mkdir()
    code = cli_main(["report", str(directory)])
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1, f"exit {code}, stderr {err!r}"
    assert "OTEL_TRACES_EXPORTER is unset or lists trace_file" in err, (
        f"stderr does not say where trace files come from: {err!r}"
    )
