"""The precision report on mixed-precision bugs from public issue trackers, each planted in the tiny
model of ``benchmarks.bug_patterns`` and trained on 2 gloo ranks with telemetry on.

Each test trains one catalogue pattern on the ``dist_pool`` ranks, under ``fully_shard`` and/or
torch FSDP2, then reads ``report_json`` of the trace files here and checks what it names: the
verdict, the finding it leads with, and where the first NaN/Inf began (stage, place, step, ranks).
Only what the report names correctly is tested here, per sharding; ``python -m
benchmarks.bug_patterns`` runs every pattern under both shardings and tables what the report
says about the others; the last test runs that entry point on one pattern.
"""

from __future__ import annotations

import gc
import json
import math
from pathlib import Path
from typing import Any

import pytest
from fsdp_patch.telemetry import precision_thresholds
from fsdp_patch.telemetry.offline.precision_report import report_json

from benchmarks.bug_patterns.catalogue import CATALOGUE, CONTROLS, PATTERNS, judge
from benchmarks.bug_patterns.float8_catalogue import FLOAT8_CONTROLS
from benchmarks.bug_patterns.op_catalogue import OP_CONTROLS, OP_PATTERNS, STATE_PATTERNS
from benchmarks.bug_patterns.run import quiet_warnings
from benchmarks.bug_patterns.training import FULLY_SHARD, KINDS, train_on_rank
from tests.benchmark_runs import run_benchmark
from tests.integration.otel_training import reset_otel

WORLD = 2


# -- on the ranks --------------------------------------------------------------------------------


def train_pattern(name: str, kind: str, trace_dir: str, every: int | None) -> dict[str, Any]:
    """Trains catalogue pattern ``name`` under ``kind`` on this rank, its trace files written into
    ``trace_dir`` and closed; returns the rank's losses and scales."""
    quiet_warnings()
    reset_otel()
    try:
        pattern = CATALOGUE[name]
        return train_on_rank(kind, pattern.settings, pattern.plant, trace_dir, every)
    finally:
        gc.collect()  # the model's checks leave with its optimizer: none reach the next test's
        reset_otel()


# -- here ------------------------------------------------------------------------------------------


def _report(dist_pool: Any, tmp_path: Path, name: str, kind: str, every: int | None = 1) -> dict[str, Any]:
    traces = tmp_path / "traces"
    dist_pool(WORLD).run(train_pattern, name, kind, str(traces), every)
    return report_json(str(traces))


def _lead(report: dict[str, Any]) -> tuple[str, str, str]:
    """The verdict and the check and text of the finding the report leads with."""
    first = report["findings"][0] if report["findings"] else {"check": "", "finding": ""}
    return report["verdict"], first["check"], first["finding"]


def _origin(report: dict[str, Any]) -> tuple[Any, ...] | None:
    """The origin as (stage, where, step, ranks, dtype, kind)."""
    o = report["origin"]
    return None if o is None else (o["stage"], o["where"], o["step"], o["ranks"], o["dtype"], o["kind"])


def _assert_named(dist_pool: Any, tmp_path: Path, name: str, kind: str) -> None:
    """The report of pattern ``name`` under ``kind`` is what its catalogue entry expects."""
    pattern = CATALOGUE[name]
    report = _report(dist_pool, tmp_path, name, kind)
    got = judge(pattern, report)
    assert got.named, (
        f"{name} ({'; '.join(pattern.sources)}), {kind}: {list(got.mismatches)}; the report leads with "
        f"{report['findings'][:1]}, origin {report['origin']}"
    )


# -- catalogue -------------------------------------------------------------------------------------


def test_the_catalogue_holds_its_patterns_and_controls_with_sources() -> None:
    """Every pattern cites at least one public thread as owner/repo#N with its title; every
    expectation's lead is a check of the report's."""
    assert len(PATTERNS) >= 12 and len(CONTROLS) >= 4, f"{len(PATTERNS)} patterns, {len(CONTROLS)} controls"
    known = set(precision_thresholds.BY_CHECK)
    for pattern in PATTERNS:
        malformed = [s for s in pattern.sources if "#" not in s.split(" ")[0] or " — " not in s]
        assert pattern.sources and not malformed, f"{pattern.name}: sources {pattern.sources}"
        unknown = [check for check in pattern.expect.lead if check not in known]
        assert not unknown, f"{pattern.name}: expected lead {unknown} is no check of the report's"
    for control in CONTROLS:
        fixes = control in OP_CONTROLS or (control in FLOAT8_CONTROLS and control.every == (1,))
        got = (control.expect.verdict, control.expect.lead, control.settings.steps >= 200 or fixes, control.every)
        assert got == ("healthy", (), True, (1,) if fixes else (None, 1)), f"{control.name}: {got}"
    assert len(OP_PATTERNS) >= 10 and len(OP_CONTROLS) == len(OP_PATTERNS), (len(OP_PATTERNS), len(OP_CONTROLS))
    unnamed = [p.name for p in OP_PATTERNS if p.expect.op is None and p not in STATE_PATTERNS]
    assert not unnamed, f"patterns whose expectation names no operation and line: {unnamed}"
    uncontracted = [p.name for p in STATE_PATTERNS if p.expect.contract != "optimizer_state"]
    assert not uncontracted, f"state patterns whose expectation names no optimizer-state role: {uncontracted}"


def test_judge_names_what_differs_from_the_expectation() -> None:
    """On the pattern of meta-pytorch/torchtune#2341 (CEWithChunkedOutputLoss does not check
    division by zero): a report that leads with the planted loss origin is judged named; one with
    the origin at another stage is not, and the judgement says which field differs."""
    report: dict[str, Any] = {
        "verdict": "problem",
        "findings": [{"check": "origin", "finding": "NaN/Inf began in the loss"}],
        "origin": {
            "stage": "loss",
            "where": "loss",
            "step": 3,
            "ranks": [1],
            "dtype": "float32",
            "kind": "nan",
            "refined": [],
        },
        "iterations": {"skipped": 0, "scale_first": "nan", "scale_last": "nan"},
    }
    pattern = CATALOGUE["loss_all_targets_ignored"]
    got = judge(pattern, report)
    assert (got.named, got.mismatches) == (True, ()), f"judgement of the expected report: {got}"
    report["origin"] = {**report["origin"], "stage": "backward"}
    got = judge(pattern, report)
    want = ("origin stage 'backward', want 'loss'",)
    assert (got.named, got.mismatches) == (False, want), f"judgement of a backward origin: {got}"


# -- NaN/Inf origins ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_fp16_forward_overflow_names_the_unit_then_the_module(dist_pool: Any, tmp_path: Path, kind: str) -> None:
    """huggingface/transformers#5651 (T5 fp16 overflow in forward (T5DenseReluDense)), #9295 (Good
    Second Issue: T5 FP16 in Pytorch), #10956 (PR): an fp16 activation passes 65504. Rank 0's batch
    x1e5 at steps 3-5 under a GradScaler: the origin is blocks.0's output at step 3, and the
    escalated iterations refine it to blocks.0.fc1."""
    report = _report(dist_pool, tmp_path, "fp16_forward_overflow", kind)
    got = (_lead(report)[:2], _origin(report))
    want = (("problem", "origin"), ("forward", "blocks.0", 3, [0], "float16", "nan"))
    assert got == want, f"{kind}: (verdict, lead), origin: got {got}, want {want}"
    refined = [(o["stage"], o["where"], o["dtype"]) for o in report["origin"]["refined"]]
    assert refined[:1] == [("forward", "blocks.0.fc1", "float16")], f"{kind}: refined origins {refined}"


def test_nan_written_into_a_main_weight_names_the_parameter(dist_pool: Any, tmp_path: Path) -> None:
    """ultralytics/ultralytics#24986 (PR) (Fix sticky-NaN EMA checkpoint loss …) and #24615 (EMEA
    has 0/NaN value checkpoint not being saved): a NaN written into a main weight outside the
    optimizer. Rank 1's shard of blocks.0.fc1.weight after step 2: a weight write at step 3, on
    rank 1, naming the parameter."""
    report = _report(dist_pool, tmp_path, "nan_weight_write", FULLY_SHARD)
    got = (_lead(report)[:2], _origin(report))
    want = (("problem", "origin"), ("weight_write", "blocks.0.fc1.weight", 3, [1], "float32", "nan"))
    assert got == want, f"(verdict, lead), origin: got {got}, want {want}"


def test_fp16_cast_of_live_weights_names_the_parameter_written_inf(dist_pool: Any, tmp_path: Path) -> None:
    """ultralytics/ultralytics#24731 (PR) (Prevent NaN/Inf EMA from discarding training
    checkpoints): live weights cast to fp16 in place, a weight above 65504 becomes Inf. Rank 1's
    shard of blocks.1.fc2.weight after step 2: a weight write of an Inf at step 3, on rank 1."""
    report = _report(dist_pool, tmp_path, "fp16_cast_of_live_weights", FULLY_SHARD)
    got = (_lead(report)[:2], _origin(report))
    want = (("problem", "origin"), ("weight_write", "blocks.1.fc2.weight", 3, [1], "float32", "inf"))
    assert got == want, f"(verdict, lead), origin: got {got}, want {want}"


def test_nan_state_dict_load_names_the_parameter_on_every_rank(dist_pool: Any, tmp_path: Path) -> None:
    """huggingface/transformers#30953 (Why using empty tensor to initialize?): a load brings a
    weight made by torch.empty. final_norm.weight loaded as NaN after step 2: a weight write at
    step 3 on both ranks."""
    report = _report(dist_pool, tmp_path, "nan_state_dict_load", FULLY_SHARD)
    got = (_lead(report)[:2], _origin(report))
    want = (("problem", "origin"), ("weight_write", "final_norm.weight", 3, [0, 1], "float32", "nan"))
    assert got == want, f"(verdict, lead), origin: got {got}, want {want}"


@pytest.mark.parametrize("kind", KINDS)
def test_scaler_skipping_every_step_names_the_skips_and_the_backward(dist_pool: Any, tmp_path: Path, kind: str) -> None:
    """deepspeedai/DeepSpeed#697 (Model doesn't learn with fp16.enabled = true: … Attempted loss
    scale: 1, reducing to 1), facebookresearch/fairseq#512 and #2488 (loss scale going to 1e-4 and
    training stops), fastino-ai/GLiNER2#155 (PR): a GradScaler skips every step. A backward NaN
    on rank 1 from step 2 under a scaler starting at 64: 7 of 8 iterations skipped (scale 64 down to
    1), led by where the overflow began (the backward of the root unit on rank 1 at step 2), then
    the skips."""
    report = _report(dist_pool, tmp_path, "scaler_skips_every_step", kind)
    iterations = report["iterations"]
    checks = [f["check"] for f in report["findings"]]
    got = (report["verdict"], checks[:2], iterations["skipped"], iterations["scale_first"], iterations["scale_last"])
    want = ("problem", ["origin", "scaler_skipped"], 7, 64.0, 1.0)
    assert got == want, f"{kind}: verdict, findings, skipped, scales: got {got}, want {want}"
    assert _origin(report)[:4] == ("backward", "", 2, [1]), f"{kind}: origin {report['origin']}"


@pytest.mark.parametrize("kind", KINDS)
def test_log_of_softmax_in_fp16_is_a_loss_origin(dist_pool: Any, tmp_path: Path, kind: str) -> None:
    """NVIDIA/apex#379 (Log function causes floating point underflow/ gradient overflow),
    pytorch/pytorch#85791 (nn.CrossEntropyLoss overflow with FP16 and minibatch),
    speechbrain/speechbrain#1803: -log(softmax) of fp16 logits whose target probability rounds
    to 0. Rank 0's logits x50 at step 3: an Inf loss from finite logits, rank 0, step 3."""
    report = _report(dist_pool, tmp_path, "log_of_softmax_fp16", kind)
    got = (_lead(report)[:2], _origin(report))
    want = (("problem", "origin"), ("loss", "loss", 3, [0], "float16", "inf"))
    assert got == want, f"{kind}: (verdict, lead), origin: got {got}, want {want}"


@pytest.mark.parametrize("kind", KINDS)
def test_a_batch_of_ignored_labels_is_a_loss_origin(dist_pool: Any, tmp_path: Path, kind: str) -> None:
    """meta-pytorch/torchtune#2341 (CEWithChunkedOutputLoss does not check division by zero),
    NVIDIA-NeMo/Automodel#3796: every label ignore_index makes the mean 0/0. Rank 1's targets all
    -100 at step 3: a NaN loss, rank 1, step 3."""
    report = _report(dist_pool, tmp_path, "loss_all_targets_ignored", kind)
    got = (_lead(report)[:2], _origin(report))
    want = (("problem", "origin"), ("loss", "loss", 3, [1], "float32", "nan"))
    assert got == want, f"{kind}: (verdict, lead), origin: got {got}, want {want}"


@pytest.mark.parametrize("kind", KINDS)
def test_sqrt_at_zero_is_a_backward_origin(dist_pool: Any, tmp_path: Path, kind: str) -> None:
    """pytorch/pytorch#2421 (Gradient of zero norm is nan), fastino-ai/GLiNER2#155 (PR),
    pytorch/pytorch#4320: forward and loss finite, the backward NaN. A zero token reaching the
    sqrt aux loss on rank 0 at step 3: the backward of the root unit (the embedding's grads), rank 0."""
    report = _report(dist_pool, tmp_path, "backward_sqrt_at_zero", kind)
    got = (_lead(report)[:2], _origin(report))
    want = (("problem", "origin"), ("backward", "", 3, [0], "float32", "nan"))
    assert got == want, f"{kind}: (verdict, lead), origin: got {got}, want {want}"


def test_fp16_reduce_overflow_is_a_reduce_origin(dist_pool: Any, tmp_path: Path) -> None:
    """pytorch/pytorch#123362 (PR) ([FSDP2] Used `ReduceOp.AVG` if bf16 reduce-scatter),
    pytorch/pytorch#78774 ([FSDP] Customizable gradient pre-divide for mixed precision training),
    horovod/horovod#1699 (Average gradients before allreduce): finite local grads whose fp16 sum
    overflows. head.weight[0, 0]'s local grad 4e4 on both ranks at step 3, fp16 main grads: the
    root unit's reduce-scatter in float16, Inf."""
    report = _report(dist_pool, tmp_path, "fp16_reduce_overflow", FULLY_SHARD)
    got = (_lead(report)[:2], _origin(report)[:3], _origin(report)[4:])
    want = (("problem", "origin"), ("reduce", "", 3), ("float16", "inf"))
    assert got == want, f"(verdict, lead), origin: got {got}, want {want}"


@pytest.mark.parametrize("kind", KINDS)
def test_adam_eps_lost_in_fp16_state_is_an_optimizer_origin(dist_pool: Any, tmp_path: Path, kind: str) -> None:
    """pytorch/pytorch#147437 (To avoid default eps ineffective in some precision(float16), …),
    google-deepmind/optax#1754 (Adam-family optimizers … produce NaN on float16 zero-gradient
    steps), afiaka87/glide-finetune#5, chainer/chainer#6299: eps 1e-8 is 0 in fp16. embed.weight's
    exp_avg_sq kept in fp16 from step 2: the optimizer's update makes it Inf at step 2."""
    report = _report(dist_pool, tmp_path, "adam_fp16_state_eps", kind)
    got = (_lead(report)[:2], _origin(report)[:3], _origin(report)[4:])
    want = (("problem", "origin"), ("optimizer", "embed.weight", 2), ("float32", "inf"))
    assert got == want, f"{kind}: (verdict, lead), origin: got {got}, want {want}"


# -- causes without a NaN/Inf --------------------------------------------------------------------------

# Patterns whose cause nothing non-finite shows: the report names it from the diagnostics and the
# model audit. Their sources are their catalogue entries' (engichang1467/Open-Rig3R#35,
# TensorAuto/OpenTau#185, vllm-project/speculators#765, pytorch/pytorch#46849,
# deepspeedai/DeepSpeed#1800, Modalities/modalities#464, meta-llama/llama#1048,
# NVIDIA/Model-Optimizer#2322, facebookresearch/fairscale#263, facebookresearch/fairseq#282,
# huggingface/transformers#29285 and the
# others listed there), printed with a failure. The lr spike's NaN is the forward's, but its cause
# (the lr jump before it) shows in nothing non-finite.
NAMED_CAUSES = (
    "fp16_grad_underflow",
    "main_weights_from_bf16",
    "pure_bf16_no_master_weights",
    "inf_grad_spread_by_clip",
    "bf16_grad_accumulation",
    "loss_on_bf16_logits",
    "norm_statistics_fp16",
    "lr_too_small_for_bf16_weights",
    "clip_norm_in_fp16",
    "lr_spike_fp16",
    "rope_buffer_in_bf16",
)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", NAMED_CAUSES)
def test_the_report_names_a_cause_nothing_non_finite_shows(
    dist_pool: Any, tmp_path: Path, name: str, kind: str
) -> None:
    """fp16 grads underflowing without a GradScaler, main weights rebuilt from their bf16 copy, no
    fp32 main weights (and an lr below their resolution), an Inf grad spread by clip_grad_norm_,
    microbatches summed in bf16, the loss on bf16 logits, RMSNorm statistics in fp16, a clip of
    one's own whose fp16 norm overflowed and zeroed every grad, an lr jump that an fp16 forward
    overflow followed, a RoPE buffer rounded to bf16: the report
    leads with the catalogue's diagnosis of each (its verdict, lead check, and where it names one,
    the dtype-contract role or the origin), under fully_shard and torch FSDP2."""
    _assert_named(dist_pool, tmp_path, name, kind)


# -- healthy controls ----------------------------------------------------------------------------------


# Diagnosed every step too under `make test-long` (another 200 steps per control and sharding).
@pytest.mark.parametrize("every", [None, pytest.param(1, marks=pytest.mark.long)])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", [p.name for p in CONTROLS if p not in OP_CONTROLS and p not in FLOAT8_CONTROLS])
def test_healthy_control_is_healthy(dist_pool: Any, tmp_path: Path, name: str, kind: str, every: int | None) -> None:
    """The controls of every pattern above (no public source: nothing is planted): 200 steps of
    AdamW at lr 1e-4 and 3e-3 with fp32 main weights and norm scales at 1.0, bf16 compute, or fp16
    compute with a GradScaler, at the default diagnostic schedule and diagnosed every step: verdict
    healthy, no finding, no origin, no skipped iteration (a compute copy that lags its fp32 master
    is no stuck weight)."""
    report = _report(dist_pool, tmp_path, name, kind, every=every)
    iterations = report["iterations"]
    got = (report["verdict"], [f["check"] for f in report["findings"]], report["origin"], iterations["skipped"])
    assert got == ("healthy", [], None, 0), f"{name}, {kind}: verdict, findings, origin, skipped: {got}"
    assert iterations["optimizer_steps"] == 200 and report["steps"] == 200, f"{name}, {kind}: {iterations}"
    assert math.isnan(float(iterations["scale_first"])), f"{name}, {kind}: scale at a skip {iterations}"


# -- the operation and the line: bugs no rule names --------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", [p.name for p in OP_PATTERNS])
def test_the_report_names_the_operation_and_line_of_a_bug_no_rule_names(
    dist_pool: Any, tmp_path: Path, name: str, kind: str
) -> None:
    """Custom activations (a MoE router's top-k, added finfo.min masks, softplus with a small beta,
    random-feature attention, a softmax without its maximum), a loss's own terms (a focal loss, a
    distillation KL), and what a script keeps between steps (a loss total, an EMA of the weights),
    and positions from a bf16 arange: the report leads with the catalogue's diagnosis and names the
    operation, the line of benchmarks/bug_patterns/op_plants.py and the module where it is, under
    fully_shard and torch FSDP2. Sources: each pattern's catalogue entry (vllm-project/vllm#14027,
    huggingface/transformers#17306, pytorch/pytorch#187180, facebookresearch/xformers#96,
    NVIDIA/FasterTransformer#43, open-mmlab/mmcv#1488, vllm-project/speculators#788,
    huggingface/transformers#8561, d8ahazard/sd_dreambooth_extension#1417, pytorch/pytorch#137774),
    printed with a failure."""
    _assert_named(dist_pool, tmp_path, name, kind)


@pytest.mark.parametrize("kind", [FULLY_SHARD, pytest.param("fsdp2", marks=pytest.mark.long)])
@pytest.mark.parametrize("name", [p.name for p in OP_CONTROLS])
def test_each_fix_of_those_bugs_is_healthy(dist_pool: Any, tmp_path: Path, name: str, kind: str) -> None:
    """The same code with each public thread's fix (the router, the masked softmax, softplus, the
    features, the focal loss, the KL in float32; the maximum subtracted; a float32 total and EMA;
    integer positions): no finding, the operation audit included."""
    report = _report(dist_pool, tmp_path, name, kind)
    got = (report["verdict"], [f["check"] for f in report["findings"]], report["ops"])
    assert got == ("healthy", [], []), f"{name}, {kind}: verdict, findings, operations: {got}"


# -- the benchmark's entry point -------------------------------------------------------------------------


def test_benchmark_runs_a_pattern_and_writes_its_row_and_json(tmp_path: Path) -> None:
    """``python -m benchmarks.bug_patterns`` on one pattern and one sharding, in processes of its
    own (2 spawned ranks): the table row names the report's lead finding and origin, and the JSON
    holds the judgement and the report of that run. Source: meta-pytorch/torchtune#2341
    (CEWithChunkedOutputLoss does not check division by zero)."""
    out = tmp_path / "patterns.json"
    args = ["--pattern", "4b", "--kind", FULLY_SHARD, "--json", str(out)]
    run = run_benchmark("benchmarks.bug_patterns", *args, timeout=300)
    assert run.returncode == 0, f"python -m benchmarks.bug_patterns exited {run.returncode}:\n{run.stderr[-3000:]}"
    row = (
        "| 4b | loss_all_targets_ignored | fully_shard | 1 | problem | origin: NaN/Inf began in the loss | loss at loss"
    )
    assert row in run.stdout, f"want a row starting {row!r} in:\n{run.stdout}"
    document = json.loads(out.read_text(encoding="utf-8"))
    (result,) = document["runs"]
    got = (result["pattern"], result["kind"], result["judgement"]["named"], result["report"]["origin"]["stage"])
    assert got == ("loss_all_targets_ignored", FULLY_SHARD, True, "loss"), f"the JSON's run: {got}"
    assert set(document["patterns"]) == set(CATALOGUE), f"patterns in the JSON: {sorted(document['patterns'])}"


def test_judge_wants_the_update_jumps_cause_and_the_line_that_loaded_the_state() -> None:
    """Pattern 28 (ultralytics/ultralytics#24085): the update jump led by the load, and the load's line."""
    pattern = CATALOGUE["optimizer_state_checkpoint_fp16"]
    site = "benchmarks/bug_patterns/op_plants.py:314 in between_steps"

    def report(cause: str, load_site: str) -> dict[str, Any]:
        jump = {"check": "update_jump", "finding": "update jump", "parameters": [{"cause": cause, "site": load_site}]}
        contract = {"check": "dtype_contract", "finding": "dtypes", "violations": [{"tensor": "optimizer_state"}]}
        iterations = {"skipped": 0, "scale_first": "nan", "scale_last": "nan"}
        return {"verdict": "problem", "findings": [jump, contract], "origin": None, "iterations": iterations}

    got = judge(pattern, report("optimizer_state_loaded", site))
    assert (got.named, got.mismatches) == (True, ()), f"judgement of the expected report: {got}"
    got = judge(pattern, report("grads_jumped", site))
    want = ("update-jump causes ['grads_jumped'], want optimizer_state_loaded",)
    assert (got.named, got.mismatches) == (False, want), f"judgement of another cause: {got}"
    got = judge(pattern, report("optimizer_state_loaded", "train.py:9 in main"))
    want = ("no finding names the load at op_plants.py: in between_steps",)
    assert (got.named, got.mismatches) == (False, want), f"judgement without the load's line: {got}"
