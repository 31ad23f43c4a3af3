"""Each planted scenario of ``fsdp-patch demo``, run by the command on 2 ranks, named by its report.

- the problem scenarios at ``--precision-every 1``: the report's verdict names the problem, and
  the report names the layer the demo says it planted in;
- the origin scenarios at the default interval, planted at step 3: ``report --json`` says where
  the NaN/Inf began (stage, place, ranks) and leads with it.

Marked ``long`` (eighteen demo runs, about three minutes on 2 quiet cores): ``make test-long`` runs
it, ``make test`` does not. The installed command's own test runs the ``nan`` scenario.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from fsdp_patch.app.demo.scenarios import SCENARIOS
from fsdp_patch.telemetry.offline.precision_report import report_json

pytestmark = [pytest.mark.long, pytest.mark.timeout(1200)]

TIMEOUT_S = 300

# scenario -> what the report's verdict says at --precision-every 1.
VERDICTS = {
    "tiny-lr": "overall: warning: lost updates: learning rate too small for the compute dtype",
    "nan": "overall: problem: NaN/Inf began in the grads between backward and step, from step 3",
    "fp16-overflow": "overall: problem: refresh overflow: main weights beyond the compute dtype's range (65504 for fp16), from step 3",
    "layer-lr": "overall: warning: stuck weights: compute weights that do not move while their main weights do, from step 3",
    "left-out": "overall: problem: unstepped weights: parameters that get grads but whose main weights never change, from step 3",
    "bf16-state": "overall: warning: dtypes the mixed-precision contract does not expect, from step 3",
    "state-underflow": "exp_avg_sq flushed to zero: squared grads underflow (first at step 1)",
    "fp16-growth": "reaches float16's largest value 65504 in about",
    "ema-bf16": (
        "overall: problem: an in-place update too small for its low-precision destination, which does not move: "
        "aten.mul_ in bfloat16 at "
    ),
    "fp8-outlier": (
        "overall: problem: a float8 cast flushes most of a layer's input or weight to zero: one outlier sets the "
        "scale: blocks.0.fc2's input, from step 3"
    ),
    "fp8": "overall: healthy",
}

# scenario -> (the layer the demo plants in, what the report names there).
NAMED = {
    "nan": (
        "blocks.1.fc1.weight",
        "first NaN/Inf: step 3, rank 0, blocks.1.fc1.weight (unit 'blocks.1'), main_grad: 1 NaN element",
    ),
    "fp16-overflow": ("pos", "overflowing: pos (root unit)"),
    "layer-lr": (
        "blocks.1.norm2.weight",
        "stuck: blocks.1.norm2.weight (unit 'blocks.1'): 6 diagnosed steps at step 6",
    ),
    "left-out": (
        "blocks.1.proj.weight",
        "unstepped: blocks.1.proj.weight (unit 'blocks.1'): 6 diagnosed steps at step 6, not in optimizer",
    ),
    "bf16-state": (
        "blocks.0.fc2.weight",
        "blocks.0.fc2.weight (unit 'blocks.0'): optimizer_state 'exp_avg_sq' is bfloat16, expected float32 (step 3, ranks 0, 1)",
    ),
    "fp16-growth": ("blocks.1.fc1", "- a unit's output grows steadily toward its dtype's largest value (first at step"),
    "state-underflow": (
        "blocks.0.fc1.weight",
        "exp_avg_sq flushed to zero: blocks.0.fc1.weight [exp_avg_sq] (unit 'blocks.0')",
    ),
    "fp8-outlier": (
        "blocks.0.fc1",
        "Keep blocks.0.fc2 in bf16 (module_filter_fn=lambda module, fqn: fqn != 'blocks.0.fc2'",
    ),
}

# scenario -> (stage, where, ranks) the report's origin must name, at the plant step.
ORIGINS = {
    "forward-overflow": ("forward", "blocks.1", [0, 1]),
    "loss-nan": ("loss", "loss", [0, 1]),
    "backward-nan": ("backward", "blocks.1", [0, 1]),
    "weight-write": ("weight_write", "blocks.1.fc2.weight", [0]),
    "reduce-overflow": ("reduce", "blocks.0", [0, 1]),
    "clip-inf": ("grad_write", "clip_grad_norm_", [0, 1]),
    "optimizer-nan": ("optimizer", "blocks.1.fc2.weight", [0, 1]),
}


def _demo(work: Path, scenario: str, *args: str) -> str:
    command = [
        sys.executable,
        "-m",
        "fsdp_patch",
        "demo",
        "--scenario",
        scenario,
        "--trace-dir",
        f"t_{scenario}",
        "--progress",
        "lines",
        *args,
    ]
    result = subprocess.run(command, cwd=work, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert result.returncode == 0, (
        f"{' '.join(command)} exited {result.returncode}\nstdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}"
    )
    return result.stdout


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every scenario's demo output (and, for the origin scenarios, its ``report --json``), run once."""
    work = tmp_path_factory.mktemp("scenarios")
    out: dict[str, Any] = {}
    for scenario in VERDICTS:
        out[scenario] = _demo(work, scenario, "--steps", "6", "--precision-every", "1")
    # At the default interval, which diagnoses step 1 only of these runs.
    for scenario in ORIGINS:
        out[scenario] = _demo(work, scenario, "--steps", "4", "--plant-step", "3")
        out[f"{scenario}:json"] = report_json(str(work / f"t_{scenario}"))
    return out


@pytest.mark.parametrize("scenario", sorted(VERDICTS))
def test_report_names_each_planted_problem(runs: dict[str, Any], scenario: str) -> None:
    stdout = runs[scenario]
    assert VERDICTS[scenario] in stdout, f"{scenario}: the report does not say {VERDICTS[scenario]!r}:\n{stdout}"
    healthy = VERDICTS[scenario] == "overall: healthy"
    assert ("where to look next:" in stdout) != healthy, f"{scenario} (healthy: {healthy}):\n{stdout}"


@pytest.mark.parametrize("scenario", sorted(NAMED))
def test_demo_and_report_name_the_planted_layer(runs: dict[str, Any], scenario: str) -> None:
    layer, named = NAMED[scenario]
    started = runs[scenario].splitlines()[0]
    assert f"planted in {layer}" in started, f"{scenario}: the demo does not name the planted layer: {started}"
    assert named in runs[scenario], f"{scenario}: the report does not name {named!r}:\n{runs[scenario]}"


@pytest.mark.parametrize("scenario", sorted(ORIGINS))
def test_each_origin_scenario_is_reported_where_it_was_planted(runs: dict[str, Any], scenario: str) -> None:
    report = runs[f"{scenario}:json"]
    origin = report["origin"]
    got = None if origin is None else (origin["step"], origin["stage"], origin["where"], origin["ranks"])
    want = (3, *ORIGINS[scenario])
    assert got == want, f"{scenario}: want the origin {want}, got {got}"
    lead = report["findings"][0]
    assert (lead["check"], lead["first_step"]) == ("origin", 3), f"{scenario}: the report leads with {lead}"
    started = runs[scenario].splitlines()[0]
    assert f"planted in {SCENARIOS[scenario].layer}, at step 3" in started, f"{scenario}: {started}"
