"""The installed command end to end, in a fresh virtual environment.

A new venv (no system site-packages) gets the pinned CPU torch and then ``pip install`` of a copy of
the package's files, which must bring every other dependency itself. Its ``fsdp-patch``:

- ``demo --steps 6 --checkpoint-dir D`` then ``demo --resume --steps 10 --compute-copy per_gather``:
  the losses and the final model and optimizer state equal an uninterrupted 10-step run (with the
  persistent copy) bitwise;
- the trace files of both ranks load (Chrome and Jaeger JSON);
- the precision report calls the healthy run healthy, and names the planted NaN, where it began
  (``report --json`` too);
- bad input is one line and exit code 2 from the installed command too.

Every other planted scenario is run by the checkout's command in ``test_demo_scenarios.py`` (marked
``long``: ``make test-long``). Slow (about two minutes on 2 quiet cores): one venv per session,
four demo runs and four other runs of the command, all in the first test's setup.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.package_source import copy_package_source

# The session's runs happen in the first test's setup, which the default per-test timeout counts.
pytestmark = [pytest.mark.long, pytest.mark.timeout(2400)]  # a fresh virtual environment

TIMEOUT_S = 300


def _run(args: list[str], cwd: Path, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT_S)
    if check:
        assert result.returncode == 0, (
            f"{' '.join(args)} exited {result.returncode}\nstdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}"
        )
    return result


@pytest.fixture(scope="session")
def fresh_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A new virtual environment holding torch==2.13.0 and ``pip install`` of this checkout's package."""
    root = tmp_path_factory.mktemp("fresh_venv")
    source = copy_package_source(root / "source")
    venv = root / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], cwd=root)
    python = str(venv / "bin" / "python")
    # Pinned, as scripts/setup.sh does: an unpinned torch would pull a multi-GB CUDA build.
    _run([python, "-m", "pip", "install", "--quiet", "torch==2.13.0"], cwd=root)
    _run([python, "-m", "pip", "install", "--quiet", str(source)], cwd=root)
    return venv


@pytest.fixture(scope="session")
def runs(fresh_venv: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every run of the installed command the tests below read, done once."""
    work = tmp_path_factory.mktemp("runs")
    command = str(fresh_venv / "bin" / "fsdp-patch")
    common = ["--progress", "lines"]
    out: dict[str, Any] = {"work": work}
    out["first"] = _run(
        [
            command,
            "demo",
            "--steps",
            "6",
            "--checkpoint-dir",
            "ckpt",
            "--loss-log",
            "resumed.jsonl",
            "--trace-dir",
            "t_first",
            *common,
        ],
        work,
    )
    # Resumed with the other compute-copy lifetime: it trains bit for bit alike.
    out["resumed"] = _run(
        [
            command,
            "demo",
            "--steps",
            "10",
            "--resume",
            "--checkpoint-dir",
            "ckpt",
            "--loss-log",
            "resumed.jsonl",
            "--trace-dir",
            "t_resumed",
            "--compute-copy",
            "per_gather",
            *common,
        ],
        work,
    )
    out["whole"] = _run(
        [
            command,
            "demo",
            "--steps",
            "10",
            "--checkpoint-dir",
            "ckpt_whole",
            "--loss-log",
            "whole.jsonl",
            "--trace-dir",
            "t_whole",
            *common,
        ],
        work,
    )
    out["nan:demo"] = _run(
        [
            command,
            "demo",
            "--scenario",
            "nan",
            "--steps",
            "6",
            "--precision-every",
            "1",
            "--trace-dir",
            "t_nan",
            *common,
        ],
        work,
    )
    out["nan:json"] = _run([command, "report", "--json", "t_nan"], work)
    out["nan:html"] = work / "t_nan" / "report.html"
    out["bad"] = _run([command, "demo", "--main-dtype", "fp8"], work, check=False)
    out["module_help"] = _run([str(fresh_venv / "bin" / "python"), "-m", "fsdp_patch", "--help"], work)
    out["telemetry_file"] = _run(
        [str(fresh_venv / "bin" / "python"), "-c", "import fsdp_patch.telemetry as t; print(t.__file__)"], work
    ).stdout.strip()
    return out


def _losses(path: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, path.read_text().splitlines())]


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in _flatten(item, f"{prefix}{key}.").items()}
    if isinstance(value, list):
        return {k: v for i, item in enumerate(value) for k, v in _flatten(item, f"{prefix}{i}.").items()}
    return {prefix.rstrip("."): value}


def _checkpoint_tensors(path: Path, scratch: Path) -> dict[str, Any]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = scratch / f"{path.parent.name}.pt"
    dcp_to_torch_save(str(path), str(target))
    return _flatten(torch.load(target, weights_only=False))


def test_installed_package_is_self_contained(fresh_venv: Path, runs: dict[str, Any]) -> None:
    # Run outside the checkout: the wheel's own fsdp_patch.telemetry (package-dir mapping) is used.
    assert Path(runs["telemetry_file"]).is_relative_to(fresh_venv), (
        f"fsdp_patch.telemetry came from {runs['telemetry_file']}, not the venv {fresh_venv}"
    )
    assert "{demo,report,trace}" in runs["module_help"].stdout, runs["module_help"].stdout


# After the script's import torch: whether the hook instrumented, and where the hook's .pth lies.
_HOOK_PROBE = (
    "import json, site, torch\n"
    "from pathlib import Path\n"
    "from fsdp_patch.telemetry.instrumentation import activation\n"
    "pth = [str(Path(d) / 'fsdp_patch_startup.pth') for d in site.getsitepackages() if (Path(d) / 'fsdp_patch_startup.pth').is_file()]\n"
    "print(json.dumps({'instrumented': activation.instrumented is not None, 'pth': pth}))\n"
)


@pytest.mark.parametrize("value", ["1", None])
def test_a_regular_install_puts_the_start_up_hook_beside_the_packages(
    fresh_venv: Path, tmp_path: Path, value: str | None
) -> None:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith(("FSDP_PATCH_", "OTEL_", "PYTHONPATH"))}
    if value is not None:
        env["FSDP_PATCH_TELEMETRY"] = value
    result = subprocess.run(
        [str(fresh_venv / "bin" / "python"), "-c", _HOOK_PROBE],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert result.returncode == 0, f"exit {result.returncode}:\n{result.stderr[-2000:]}"
    got = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(got["pth"]) == 1 and Path(got["pth"][0]).is_relative_to(fresh_venv), (
        f"want the hook in the venv, got {got}"
    )
    assert got["instrumented"] is (value == "1"), (
        f"FSDP_PATCH_TELEMETRY={value!r}: want instrumented {value == '1'}, got {got}"
    )


def test_resumed_run_equals_an_uninterrupted_run_bitwise(runs: dict[str, Any], tmp_path: Path) -> None:
    work = runs["work"]
    resumed, whole = _losses(work / "resumed.jsonl"), _losses(work / "whole.jsonl")
    assert [s for s, _ in whole] == list(range(1, 11)), f"uninterrupted run logged steps {[s for s, _ in whole]}"
    assert resumed == whole, f"losses differ: resumed {resumed}, uninterrupted {whole}"
    assert "resuming from ckpt/step-00000006 at step 6" in runs["resumed"].stdout, runs["resumed"].stdout
    got = _checkpoint_tensors(work / "ckpt" / "step-00000010", tmp_path)
    want = _checkpoint_tensors(work / "ckpt_whole" / "step-00000010", tmp_path)
    assert got.keys() == want.keys(), f"state keys differ: {sorted(got.keys() ^ want.keys())[:5]}"
    differ = [
        k
        for k in want
        if not (torch.equal(got[k], want[k]) if isinstance(want[k], torch.Tensor) else got[k] == want[k])
    ]
    assert not differ, f"final state differs from the uninterrupted run's in {differ[:5]}"
    assert any(k.startswith("optim.state.") and k.endswith("exp_avg_sq") for k in want), "no AdamW state was compared"


def test_trace_files_of_both_ranks_load(runs: dict[str, Any]) -> None:
    traces = runs["work"] / "t_whole"
    for rank in (0, 1):
        chrome = json.loads((traces / f"rank{rank}.trace.json").read_text())["traceEvents"]
        steps = [e["args"]["fsdp.step"] for e in chrome if e.get("name") == "fsdp.optimizer.step"]
        assert steps == list(range(1, 11)), f"rank {rank}: step spans {steps}"
        jaeger = json.loads((traces / f"rank{rank}.jaeger.json").read_text())["data"]
        operations = {span["operationName"] for trace in jaeger for span in trace["spans"]}
        assert {"fsdp.optimizer.step", "fsdp.optimizer.precision", "fsdp.optimizer.refresh"} <= operations, operations


def test_healthy_run_ends_with_a_healthy_report(runs: dict[str, Any]) -> None:
    stdout = runs["whole"].stdout
    assert "precision report: t_whole (ranks 0, 1 of 2, 10 optimizer steps" in stdout, stdout
    assert "overall: healthy" in stdout and "warning" not in stdout and "problem" not in stdout, stdout
    assert "loss" in stdout and "tok/s" in stdout and "ETA" in stdout, stdout


def test_report_names_the_planted_nan_and_where_it_began(runs: dict[str, Any]) -> None:
    stdout = runs["nan:demo"].stdout
    assert "planted in blocks.1.fc1.weight" in stdout.splitlines()[0], stdout.splitlines()[0]
    want = "overall: problem: NaN/Inf began in the grads between backward and step, from step 3"
    assert want in stdout and "where to look next:" in stdout, f"the report does not say {want!r}:\n{stdout}"
    named = "first NaN/Inf: step 3, rank 0, blocks.1.fc1.weight (unit 'blocks.1'), main_grad: 1 NaN element"
    assert named in stdout, f"the report does not name {named!r}:\n{stdout}"


def test_the_installed_demo_writes_the_html_report_with_its_page(runs: dict[str, Any]) -> None:
    # The page's template, style and script are package data: a wheel without them fails here.
    page = runs["nan:html"].read_text(encoding="utf-8")
    for part in ('id="report-data"', "function plot(", "figure.plot"):
        assert part in page, f"the installed demo's report.html lacks {part!r} (package data missing from the wheel?)"
    assert f"plots: t_nan{os.sep}report.html" in runs["nan:demo"].stdout, runs["nan:demo"].stdout[-2000:]


def test_report_json_names_the_first_bad_tensor(runs: dict[str, Any]) -> None:
    report = json.loads(runs["nan:json"].stdout)
    (first,) = [f["first_nonfinite"] for f in report["findings"] if "first_nonfinite" in f]
    got = {k: first[k] for k in ("step", "param", "unit", "tensor", "ranks", "kind", "elements")}
    want = {
        "step": 3,
        "param": "blocks.1.fc1.weight",
        "unit": "blocks.1",
        "tensor": "main_grad",
        "ranks": [0],
        "kind": "nan",
        "elements": 1,
    }
    assert got == want, f"want {want}, got {got}"
    assert report["verdict"] == "problem" and report["steps"] == 6, report


def test_installed_command_rejects_bad_input_in_one_line(runs: dict[str, Any]) -> None:
    result = runs["bad"]
    want = "fsdp-patch demo: --main-dtype 'fp8' is not a dtype; expected one of bf16, fp16, fp32\n"
    assert (result.returncode, result.stderr) == (2, want), f"exit {result.returncode}, stderr {result.stderr!r}"
