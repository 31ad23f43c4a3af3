"""Bad input to ``fsdp-patch``: one line on stderr naming what was wrong, exit code 2, no traceback.

Most cases call the command's ``main`` in this process (the checks all run before any rank
starts); one runs the real command in a subprocess to show the process's exit code and output.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fsdp_patch.app.cli import main
from fsdp_patch.app.demo import checkpoint
from fsdp_patch.app.demo.config import TrainingConfig

REPO = Path(__file__).resolve().parents[2]


def _fake_checkpoint(directory: Path, step: int = 6, **changes) -> Path:
    """A checkpoint directory as the demo leaves it (DCP payload left out: never read on these paths)."""
    training = TrainingConfig(
        scenario="healthy",
        compute_dtype="bfloat16",
        main_dtype="float32",
        grad_dtype="bfloat16",
        lr=3e-3,
        min_lr=3e-4,
        warmup_steps=5,
        decay_steps=100,
        weight_decay=0.0,
        batch=8,
        microbatches=1,
        seed=0,
        plant_step=0,
    )
    state = {
        "format": checkpoint.FORMAT,
        "step": step,
        "data_position": step,
        "scheduler": {},
        "training": dataclasses.asdict(training),
        "world_size": 2,
    }
    state.update(changes)
    path = directory / checkpoint.checkpoint_name(step)
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"")
    (path / checkpoint.STATE_FILE).write_text(json.dumps(state))
    (directory / checkpoint.LATEST).write_text(checkpoint.checkpoint_name(step) + "\n")
    return directory


CASES = {
    "unknown-dtype": (
        ["demo", "--compute-dtype", "bf17"],
        "--compute-dtype 'bf17' is not a dtype; expected one of bf16, fp16, fp32",
    ),
    "unknown-grad-dtype": (["demo", "--grad-dtype", "int8"], "--grad-dtype 'int8' is not a dtype"),
    "world-size-0": (["demo", "--world-size", "0"], "--world-size 0 is too small; expected an integer >= 1"),
    "steps-0": (["demo", "--steps", "0"], "--steps 0 is too small; expected an integer >= 1"),
    "negative-lr": (["demo", "--lr", "-1"], "--lr -1.0 must be a positive number"),
    "unknown-scenario": (
        ["demo", "--scenario", "bogus"],
        "--scenario 'bogus' is not known; expected one of healthy, tiny-lr, nan, fp16-overflow, layer-lr, left-out, bf16-state, state-underflow, ema-bf16, fp16-growth, forward-overflow, loss-nan, backward-nan, weight-write, reduce-overflow, clip-inf, optimizer-nan, fp8, fp8-outlier",
    ),
    "unknown-compute-copy": (
        ["demo", "--compute-copy", "lazy"],
        "--compute-copy 'lazy' is not known; expected one of persistent, per_gather",
    ),
    "unknown-exporter": (
        ["demo", "--exporter", "kafka"],
        "--exporter 'kafka' is not known; expected one of file, otlp, console, none",
    ),
    "batch-split": (
        ["demo", "--batch", "6", "--microbatches", "2"],
        "--batch 6 does not split into --microbatches 2 x 2 ranks; expected a multiple of 4",
    ),
    "not-a-number": (["demo", "--steps", "ten"], "argument --steps: invalid int value: 'ten'"),
    "unknown-option": (["demo", "--bogus"], "unrecognized arguments: --bogus"),
    "no-subcommand": ([], "the following arguments are required"),
    "resume-without-dir": (["demo", "--resume"], "--resume needs --checkpoint-dir"),
    "resume-missing-dir": (
        ["demo", "--resume", "--checkpoint-dir", "{tmp}/nowhere"],
        "cannot resume: checkpoint directory {tmp}/nowhere does not exist",
    ),
    "resume-empty-dir": (["demo", "--resume", "--checkpoint-dir", "{tmp}"], "cannot resume: no checkpoint in {tmp}"),
    "resume-incompatible": (
        ["demo", "--resume", "--checkpoint-dir", "{ckpt}", "--lr", "0.01", "--steps", "10"],
        "incompatible checkpoint: it was trained with --lr 0.003, this run asks for --lr 0.01",
    ),
    "resume-other-dtype": (
        ["demo", "--resume", "--checkpoint-dir", "{ckpt}", "--compute-dtype", "fp16", "--steps", "10"],
        "incompatible checkpoint: it was trained with --compute-dtype bfloat16, this run asks for --compute-dtype float16",
    ),
    "resume-nothing-to-do": (
        ["demo", "--resume", "--checkpoint-dir", "{ckpt}", "--steps", "6"],
        "nothing to resume: checkpoint {ckpt}/step-00000006 is at step 6; pass --steps greater than 6",
    ),
    "resume-other-format": (
        ["demo", "--resume", "--checkpoint-dir", "{old}", "--steps", "10"],
        "incompatible checkpoint: {old}/step-00000006/demo.json has format 0",
    ),
    "loss-log-unwritable": (
        ["demo", "--loss-log", "{tmp}/file/loss.jsonl"],
        "--loss-log {tmp}/file/loss.jsonl: cannot write it",
    ),
    "report-missing-dir": (["report", "{tmp}/nowhere"], "fsdp-patch report: {tmp}/nowhere is not a directory"),
    "report-no-traces": (["report", "{tmp}"], "fsdp-patch report: {tmp} holds no rank*.trace.json file"),
    "report-bad-lines": (["report", "{tmp}", "--lines", "0"], "--lines 0 is too small"),
    "report-corrupt-trace": (["report", "{corrupt}"], "is not a Chrome trace-event JSON file"),
    "trace-missing-input": (
        ["trace", "merge", "{tmp}/out.json", "{tmp}/none.trace.json"],
        "fsdp-patch trace merge: {tmp}/none.trace.json does not exist",
    ),
    "trace-empty-dir": (["trace", "jaeger", "{tmp}/out.json", "{tmp}"], "fsdp-patch trace jaeger: {tmp} holds no"),
    "trace-unwritable-output": (
        ["trace", "merge", "{tmp}/file/out.json", "{corrupt}"],
        "fsdp-patch trace merge: [Errno 20]",
    ),
    "trace-unknown-tool": (["trace", "zip", "a", "b"], "invalid choice: 'zip'"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_and_exit_2(case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    places = {
        "tmp": str(tmp_path),
        "ckpt": str(_fake_checkpoint(tmp_path / "ckpt")),
        "old": str(_fake_checkpoint(tmp_path / "old", format=0)),
        "corrupt": str(tmp_path / "corrupt"),
    }
    (tmp_path / "corrupt").mkdir()
    (tmp_path / "corrupt" / "rank0.trace.json").write_text('{"traceEvents": [{"ph": "X"} {"ph": "X"}]}')
    (tmp_path / "file").write_text("")
    argv, expected = CASES[case]
    argv = [arg.format(**places) for arg in argv]
    code = main(argv)
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert code == 2, f"exit code {code}, want 2; stderr: {err!r}"
    assert len(lines) == 1, f"want one line on stderr, got {len(lines)}: {err!r}"
    assert expected.format(**places) in lines[0], f"stderr {lines[0]!r} does not say {expected.format(**places)!r}"
    assert lines[0].startswith("fsdp-patch"), lines[0]
    assert out == "", f"nothing on stdout for bad input, got {out!r}"


def test_the_real_command_exits_2_with_one_line(tmp_path: Path) -> None:
    # Run from elsewhere than the checkout, which PYTHONPATH names (the package may not be installed).
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, "-m", "fsdp_patch", "demo", "--world-size", "0"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
        env=env,
    )
    assert result.returncode == 2, f"exit code {result.returncode}, want 2: {result.stderr}"
    want = "fsdp-patch demo: --world-size 0 is too small; expected an integer >= 1\n"
    assert result.stderr == want, f"stderr {result.stderr!r}, want {want!r}"
    assert not list(tmp_path.iterdir()), f"bad input left files: {list(tmp_path.iterdir())}"


@pytest.mark.parametrize("tool", ["merge", "jaeger"])
def test_bad_trace_input_leaves_no_output_and_the_old_one_as_it_was(
    tool: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The input is a trace file that breaks part way through, so the tool has begun writing.
    inputs = tmp_path / "corrupt"
    inputs.mkdir()
    (inputs / "rank0.trace.json").write_text('{"traceEvents": [{"ph": "X", "name": "a"}, {"ph": "X"} {"ph": "X"}]}')
    earlier = tmp_path / "earlier.json"
    earlier.write_text("the output of an earlier run")
    fresh = tmp_path / "fresh.json"
    for output in (earlier, fresh):
        code = main(["trace", tool, str(output), str(inputs)])
        err = capsys.readouterr().err
        assert code == 2, f"fsdp-patch trace {tool} into {output.name} exited {code}, want 2; stderr: {err!r}"
    kept = earlier.read_text()
    assert kept == "the output of an earlier run", f"the earlier output now reads {kept!r}"
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["corrupt", "earlier.json"], f"bad input left {left}, want only the input and the earlier output"
