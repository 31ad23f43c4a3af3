"""``FSDP_PATCH_TELEMETRY=1`` alone instruments the scripts users train with, on 2 ranks.

Each script of ``tests/integration/zero_code/`` (a plain torch FSDP2 script, a ``fully_shard``
script, HF Accelerate's FSDP2 preparation, the HF Trainer: under torchrun; Lightning's
``ModelParallelStrategy``: under plain ``python``, which starts the other rank itself) holds no
line of telemetry and plants a learning rate of 1e-9 on one parameter. Run once with the
variable set and once without: with it, both ranks write trace files and the report names the
planted parameter, by the name the script's own model gives it; the losses of every step equal
the run without it, bitwise; the launcher prints no summary of its own.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.report_json import report_json
from tests.integration.zero_code import common

pytestmark = pytest.mark.slow

SCRIPTS = Path(__file__).resolve().parent / "zero_code"
# The frameworks' runs (each imports its framework, about 30 s on 2 cores) are `long`: `make test-long`.
CLIENTS = (
    "fsdp2",
    "fully_shard",
    pytest.param("accelerate", marks=pytest.mark.long),
    pytest.param("trainer", marks=pytest.mark.long),
    pytest.param("lightning", marks=pytest.mark.long),
)
# How each is launched: torchrun, or plain python where the framework starts its ranks itself.
PLAIN_PYTHON = ("lightning",)
TIMEOUT_S = 600


def _planted(client: str) -> str:
    for line in (SCRIPTS / f"{client}_script.py").read_text().splitlines():
        if line.startswith("PLANTED = "):
            return line.split("=", 1)[1].strip().strip('"')
    raise AssertionError(f"{client}_script.py names no PLANTED parameter")


# torch's gloo backend can abort a process in interpreter finalization, after the script's last
# line: a gloo worker thread releasing a finished collective's tensors needs the GIL while the
# interpreter is shutting down ("terminate called without an active exception"; the worker's
# stack: ProcessGroupGloo::runLoop -> ~AsyncAllgatherWork -> gil_scoped_acquire -> pthread_exit,
# pytorch/pytorch#179291). The HF Trainer's script, with telemetry off, hit it in 7 of 22 runs on
# 2 loaded cores ending with destroy_process_group alone, in 1 of 16 with a barrier before it. A run that ends so, with every rank's losses
# written, is started again, at most TEARDOWN_RETRIES times; any other failure fails at once.
TEARDOWN_ABORT = "terminate called without an active exception"
TEARDOWN_RETRIES = 2


def _ended_in_teardown_abort(returncode: int, output: str, cwd: Path) -> bool:
    finished = sorted(p.name for p in cwd.glob("losses.rank*.json")) == [
        f"losses.rank{rank}.json" for rank in range(common.WORLD)
    ]
    return returncode != 0 and TEARDOWN_ABORT in output and finished


def _run(client: str, telemetry: bool, cwd: Path) -> dict:
    """One torchrun of the client's script: each rank's losses, and the output."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FSDP_PATCH_", "OTEL_"))}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    if telemetry:
        env["FSDP_PATCH_TELEMETRY"] = "1"
    script = str(SCRIPTS / f"{client}_script.py")
    if client in PLAIN_PYTHON:
        command = [sys.executable, script]
    else:
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={common.WORLD}",
            script,
        ]
    for attempt in range(TEARDOWN_RETRIES + 1):
        if cwd.exists():
            shutil.rmtree(cwd)
        cwd.mkdir(parents=True)
        result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
        output = result.stdout + result.stderr
        if not _ended_in_teardown_abort(result.returncode, output, cwd) or attempt == TEARDOWN_RETRIES:
            break
    assert result.returncode == 0, f"{client} (telemetry {telemetry}) exited {result.returncode}:\n{output[-5000:]}"
    losses = {int(p.name.split(".")[1][4:]): json.loads(p.read_text()) for p in cwd.glob("losses.rank*.json")}
    assert sorted(losses) == list(range(common.WORLD)), (
        f"{client}: want losses of ranks 0, 1, got {losses}:\n{output[-3000:]}"
    )
    return {"losses": losses, "output": output, "cwd": cwd}


def test_a_teardown_abort_is_recognized_only_after_every_rank_finished(tmp_path: Path) -> None:
    for rank in range(common.WORLD):
        (tmp_path / f"losses.rank{rank}.json").write_text("[]")
    got = _ended_in_teardown_abort(-6, f"LOSSES ...\n{TEARDOWN_ABORT}\n", tmp_path)
    assert got, "a rank aborting in teardown after every rank wrote its losses should be recognized"
    assert not _ended_in_teardown_abort(1, "Traceback ...\nValueError", tmp_path), "another failure was taken for it"
    (tmp_path / "losses.rank1.json").unlink()
    got = _ended_in_teardown_abort(-6, TEARDOWN_ABORT, tmp_path)
    assert not got, "an abort before every rank finished (rank 1 wrote no losses) was taken for a teardown abort"


@pytest.fixture(scope="module", params=CLIENTS)
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    client = request.param
    root = tmp_path_factory.mktemp(client)
    return {"client": client, "on": _run(client, True, root / "on"), "off": _run(client, False, root / "off")}


def test_losses_equal_the_run_without_telemetry_bitwise(runs: dict) -> None:
    on, off = runs["on"]["losses"], runs["off"]["losses"]
    assert on == off, f"{runs['client']}: losses with FSDP_PATCH_TELEMETRY=1 {on} differ from without {off}"
    steps = {rank: len(values) for rank, values in on.items()}
    assert steps == {rank: common.STEPS for rank in range(common.WORLD)}, (
        f"want {common.STEPS} steps per rank, got {steps}"
    )


def test_both_ranks_write_trace_files_and_nothing_without_the_variable(runs: dict) -> None:
    traces = runs["on"]["cwd"] / "fsdp_patch_traces"
    got = sorted(p.name for p in traces.glob("rank*.trace.json")) if traces.is_dir() else []
    assert got == ["rank0.trace.json", "rank1.trace.json"], f"{runs['client']}: want both ranks' trace files, got {got}"
    assert not (runs["off"]["cwd"] / "fsdp_patch_traces").exists(), "a run without the variable wrote trace files"
    assert "fsdp_patch" not in runs["off"]["output"], (
        f"without the variable fsdp_patch said:\n{runs['off']['output'][-2000:]}"
    )


def test_the_launcher_prints_no_summary_of_its_own(runs: dict) -> None:
    summaries = [line for line in runs["on"]["output"].splitlines() if "fsdp_patch telemetry summary" in line]
    want = [f"fsdp_patch telemetry summary: rank 0 of {common.WORLD} (service fsdp_patch)"]
    assert summaries == want, f"{runs['client']}: want rank 0's summary only, got {summaries}"


def test_the_report_names_the_planted_parameter_as_the_script_names_it(runs: dict) -> None:
    traces = runs["on"]["cwd"] / "fsdp_patch_traces"
    report = report_json(traces)
    stuck = [f for f in report["findings"] if f["check"] == "stuck_weights"]
    named = sorted({p["param"] for f in stuck for p in f["parameters"]})
    want = _planted(runs["client"])
    assert named == [want], f"{runs['client']}: want the stuck-weights finding to name [{want!r}], got {named}"
    assert stuck[0]["first_step"] == 3, f"want it found at step 3 (the dense start of the schedule), got {stuck[0]}"
