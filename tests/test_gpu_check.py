"""scripts/gpu_check.sh keeps working between GPU runs: the suite runs it, here usually without CUDA.

Without CUDA the script must pass, say that it skips the CUDA parts, have the CUDA tests skip with
their reason, run the demo under torchrun (gloo) with a checkpoint and a resume, skip the GPU
benchmarks, and leave in ``--out DIR`` its log, each part's log and a summary a person can read.
OpenTelemetry, and the setuptools and wheel that build the checkout offline, come from a wheel
folder made by scripts/gpu_wheels.sh, as on a machine without them.
With CUDA it must pass and leave each benchmark's JSON, named after the GPU, in DIR.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def _cuda_test_count() -> int:
    """How many tests ``pytest -m cuda`` collects (what the GPU check runs first)."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "cuda", "tests/cuda"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    found = re.search(r"(\d+)(?:/\d+)? tests? (?:collected|selected)", done.stdout)
    assert found is not None, f"pytest --collect-only said:\n{done.stdout[-2000:]}"
    return int(found.group(1))


def _parts(summary: str) -> dict[str, tuple[str, str]]:
    """summary.md's table: part -> (status, detail)."""
    rows = re.findall(r"^\| (\d [^|]*?) \| (PASS|FAIL|SKIP) \| (.*) \|$", summary, re.MULTILINE)
    return {part: (status, detail) for part, status, detail in rows}


@pytest.mark.long
def test_gpu_check_script_runs(tmp_path: Path) -> None:
    wheels, out = tmp_path / "wheels", tmp_path / "out"
    made = subprocess.run(
        [
            "bash",
            "scripts/gpu_wheels.sh",
            "--dest",
            str(wheels),
            "--python-version",
            "3.12",
            "--platform",
            "manylinux_2_28_x86_64",
            "--python",
            sys.executable,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert made.returncode == 0, f"gpu_wheels.sh exited {made.returncode}:\n{made.stderr[-3000:]}"
    names = sorted(p.name.split("-")[0] for p in wheels.glob("*.whl"))
    want_names = [
        "opentelemetry_api",
        "opentelemetry_instrumentation",
        "opentelemetry_sdk",
        "opentelemetry_semantic_conventions",
        "setuptools",
        "wheel",
    ]
    assert names == want_names, f"want the wheels {want_names}, got {names}"

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "PYTHONPATH")}
    run = subprocess.run(
        # The parts' limits are a GPU machine's; here the script is checked, not timed (beside other
        # work a CPU demo part took over 45 s): ten times the limits, and a budget to match.
        [
            "bash",
            "scripts/gpu_check.sh",
            "--out",
            str(out),
            "--python",
            sys.executable,
            "--wheels",
            str(wheels),
            "--limit-scale",
            "10",
            "--budget",
            "2850",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=3000,
        check=False,
    )
    log = run.stdout + run.stderr
    assert run.returncode == 0, f"gpu_check.sh exited {run.returncode}:\n{log[-4000:]}"
    assert (out / "gpu_check.log").read_text() == run.stdout, "the log in --out is not the script's output"
    assert "gpu_check: no part failed" in log, log[-2000:]
    summary = (out / "summary.md").read_text()
    parts = _parts(summary)
    assert "Result: no part failed." in summary, summary
    assert parts["0 wheels"] == ("PASS", f"4 from {wheels}"), parts
    assert parts["0 checkout"][0] == "PASS", parts
    assert parts["0 environment"][0] == "PASS", parts
    assert f"torch: {torch.__version__}" in summary, summary
    if torch.cuda.is_available():
        jsons = sorted(out.glob("suite-*.json"))
        assert len(jsons) == 6, f"want one benchmark JSON per suite case in {out}, got {jsons}: {log[-2000:]}"
        jsons += sorted(out.glob("origin-checks-*.json")) + sorted(out.glob("op-audit-cost-*.json"))
        jsons += sorted(out.glob("host-cost-*.json"))
        assert len(jsons) == 10, (
            f"want the host cost's (1b, host-bound), the origin checks' and the operation audit's JSON too in {out}, "
            f"got {jsons}"
        )
        for path in jsons:
            assert json.loads(path.read_text())["timer"] == "cuda_events", f"{path.name}: not timed with CUDA events"
        return
    assert "no CUDA device: running what runs without one, skipping the CUDA parts" in log, log[:2000]
    tests_log = (out / "logs" / "1-cuda-tests.log").read_text()
    cuda_tests = _cuda_test_count()
    assert f"{cuda_tests} skipped" in tests_log, f"want all {cuda_tests} CUDA tests skipped:\n{tests_log}"
    assert "scripts/gpu_check.sh runs the CUDA tests on a GPU machine" in tests_log, tests_log
    assert parts["1 CUDA tests"] == ("SKIP", f"no CUDA device: {cuda_tests} skipped, each saying why"), parts
    for part in ("2 demo, torchrun", "2 demo, torchrun --resume"):
        status, detail = parts[part]
        assert status == "PASS" and "telemetry on, overall: healthy, last step" in detail, f"{part}: {status} {detail}"
    assert parts["3 GPU benchmarks"] == ("SKIP", "no CUDA device"), parts
    assert "resuming from" in (out / "logs" / "2-demo-torchrun-resume.log").read_text()
    assert not list(out.glob("*.json")), f"a CPU run wrote GPU results: {list(out.iterdir())}"
    # Every part is in the summary, each line saying how it went.
    want = [
        "0 wheels",
        "0 checkout",
        "0 environment",
        "1 CUDA tests",
        "2 demo, torchrun",
        "2 demo, torchrun --resume",
        "3 GPU benchmarks",
    ]
    assert list(parts) == want, f"want the parts {want}, got {list(parts)}"


def test_a_spent_budget_skips_the_parts_saying_so(tmp_path: Path) -> None:
    run = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--out", str(tmp_path), "--python", sys.executable, "--budget", "0"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, f"exit {run.returncode}:\n{run.stdout[-3000:]}{run.stderr[-2000:]}"
    parts = _parts((tmp_path / "summary.md").read_text())
    spent = {
        part
        for part, (status, detail) in parts.items()
        if (status, detail) == ("SKIP", "the 0s budget was spent before it")
    }
    want = {"2 demo, torchrun", "2 demo, torchrun --resume", "1 CUDA tests"}
    if not torch.cuda.is_available():
        assert parts["3 GPU benchmarks"] == ("SKIP", "no CUDA device"), parts
    assert want <= spent, f"want {sorted(want)} skipped for the budget, got {parts}"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "gpu_check: --out DIR is required (where the summary and logs go)"),
        (["--out", "x", "--budget", "soon"], "gpu_check: --budget wants whole seconds, got 'soon'"),
        (["--out", "x", "--limit-scale", "0"], "gpu_check: --limit-scale wants a whole number >= 1, got '0'"),
        (["--out", "x", "--wheels", "WHEELS"], "holds no .whl files (scripts/gpu_wheels.sh --dest"),
        (
            ["--out", "x", "--python", "no-such-python"],
            "gpu_check: interpreter 'no-such-python' not found (--python PY)",
        ),
        (["--out"], "usage: scripts/gpu_check.sh --out DIR"),
    ],
)
def test_bad_arguments_exit_2_saying_what_is_expected(tmp_path: Path, args: list[str], message: str) -> None:
    args = [str(tmp_path / "empty") if a == "WHEELS" else a for a in args]
    (tmp_path / "empty").mkdir()
    run = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu_check.sh"), *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert run.returncode == 2 and message in run.stderr, (
        f"exit {run.returncode}, stderr {run.stderr!r}, want 2 and {message!r}"
    )
    assert not (tmp_path / "x").exists(), "a refused run made its output folder"


def test_gpu_wheels_refuses_bad_arguments(tmp_path: Path) -> None:
    cases = {
        (): "gpu_wheels: --dest DIR is required",
        ("--dest", str(tmp_path), "--python-version", "3"): "--python-version wants X.Y (such as 3.12), got '3'",
    }
    for args, message in cases.items():
        run = subprocess.run(
            ["bash", "scripts/gpu_wheels.sh", *args], cwd=REPO, capture_output=True, text=True, timeout=60, check=False
        )
        assert run.returncode == 2 and message in run.stderr, f"{args}: exit {run.returncode}, stderr {run.stderr!r}"
