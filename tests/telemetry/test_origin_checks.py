"""Where an iteration's first NaN/Inf began, from the checks it ran, in the order it ran them.

Each case is an iteration's checks as a rank records them (``ProbeLog`` order: the model's input,
each unit's output in the forward, the loss, grads in the backward and around each reduce, then
at the step the main grads, each parameter's main weight before the update, each group's after),
with the value each held; :func:`find_origin` names the stage and the place.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from fsdp_patch.telemetry import semconv
from fsdp_patch.telemetry.diagnostics.origin import Origin, find_origin, zeroed_groups
from fsdp_patch.telemetry.diagnostics.probes import AFTER, BEFORE, CLIP, INPUT, Checked, PreparedChecks, Probe, ProbeLog

NAN, INF = math.nan, math.inf
FWD, LOSS, BWD, RED, GW, WW = (
    semconv.ORIGIN_FORWARD,
    semconv.ORIGIN_LOSS,
    semconv.ORIGIN_BACKWARD,
    semconv.ORIGIN_REDUCE,
    semconv.ORIGIN_GRAD_WRITE,
    semconv.ORIGIN_WEIGHT_WRITE,
)


def c(stage: str, where: str, value: float = 1.0, when: str = "", dtype: str = "bfloat16", group: str = "") -> Checked:
    low = value if value != value or value == 0.0 else min(value, -1.0)  # 0: every element 0
    return Checked(Probe(stage, where, dtype, when, 0, group), low, value)


def healthy_iteration(**bad: float) -> list[Checked]:
    """One iteration of a model whose root holds blocks.0 and blocks.1 (units), a value per check."""
    v = {
        "input": 1.0,
        "b0": 1.0,
        "b1": 1.0,
        "root": 1.0,
        "loss": 1.0,
        "g_root": 1.0,
        "g_b1": 1.0,
        "r_b1": 1.0,
        "g_b0": 1.0,
        "r_b0": 1.0,
        "r_b0_after": 1.0,
        "r_b1_after": 1.0,
        "at_step_b0": 1.0,
        "w_b0": 1.0,
        "w_after_b0": 1.0,
        **bad,
    }
    return [
        c(FWD, "", v["input"], INPUT),
        c(FWD, "blocks.0", v["b0"]),
        c(FWD, "blocks.1", v["b1"]),
        c(FWD, "", v["root"]),
        c(LOSS, "loss", v["loss"], dtype="float32"),
        c(BWD, "", v["g_root"]),
        c(BWD, "blocks.1", v["g_b1"]),
        c(RED, "blocks.1", v["r_b1"], BEFORE),
        c(BWD, "blocks.0", v["g_b0"]),
        c(RED, "blocks.0", v["r_b0"], BEFORE, dtype="float16"),
        c(RED, "blocks.1", v["r_b1_after"], AFTER, dtype="float32"),
        c(RED, "blocks.0", v["r_b0_after"], AFTER, dtype="float32"),
        c(GW, "blocks.0", v["at_step_b0"], dtype="float32"),
        c(WW, "blocks.0.fc.weight", v["w_b0"], BEFORE, dtype="float32", group="blocks.0"),
        c(WW, "blocks.0", v["w_after_b0"], AFTER, dtype="float32"),
    ]


def where(origin: Origin | None) -> tuple[str, str] | None:
    return None if origin is None else (origin.stage, origin.where)


# Every later check of the iteration holds the NaN too: the origin is the first in the order
# the iteration runs, except weights written before it began.
CASES = {
    "all finite": ({}, None),
    "the batch": ({"input": NAN, "b0": NAN, "b1": NAN, "root": NAN}, (FWD, "")),
    "a unit's output": ({"b1": INF, "root": NAN, "loss": NAN}, (FWD, "blocks.1")),
    "the loss": ({"loss": NAN, "g_root": NAN, "g_b1": NAN}, (LOSS, "loss")),
    # The grad of blocks.0's output is made by blocks.1's backward, which consumed that output.
    "the backward of the unit that consumed an output": ({"g_b0": NAN, "r_b0": NAN}, (BWD, "blocks.1")),
    # blocks.1's own parameters' grads, before they are reduced.
    "a unit's parameter grads": ({"r_b1": NAN, "g_b0": NAN}, (BWD, "blocks.1")),
    "the loss's backward": ({"g_root": NAN, "g_b1": NAN}, (BWD, "loss")),
    "the reduce": ({"r_b0_after": INF, "at_step_b0": INF}, (semconv.ORIGIN_REDUCE, "blocks.0")),
    "between backward and step": ({"at_step_b0": NAN}, (GW, "blocks.0")),
    "a weight written between steps": ({"w_b0": NAN, "b0": NAN, "root": NAN, "loss": NAN}, (WW, "blocks.0.fc.weight")),
    "the optimizer": ({"w_after_b0": NAN}, (semconv.ORIGIN_OPTIMIZER, "blocks.0")),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_origin_is_the_first_stage_that_held_it(case: str) -> None:
    bad, want = CASES[case]
    got = where(find_origin(healthy_iteration(**bad)))
    assert got == want, f"{case}: want {want}, got {got}"


def test_a_reduce_is_named_in_the_dtype_it_reduced_in() -> None:
    origin = find_origin(healthy_iteration(r_b0_after=INF, at_step_b0=INF))
    assert origin is not None and origin.dtype == "float16", f"want the reduce input's float16, got {origin}"


def test_weights_the_previous_update_left_non_finite_are_no_new_origin() -> None:
    checks = healthy_iteration(w_b0=NAN, b0=NAN, root=NAN, loss=NAN)
    got = find_origin(checks, previous_after_finite={"blocks.0": False})
    assert got is None, f"the previous step's NaN, already reported there, was reported again: {got}"


def test_a_clip_whose_norm_was_infinite_is_named() -> None:
    checks = healthy_iteration()
    checks.insert(12, c(GW, CLIP, INF, dtype="float32"))
    origin = find_origin(checks)
    assert where(origin) == (GW, CLIP) and origin is not None and "grads zeroed" in origin.detail, origin


def test_a_reduce_whose_output_is_not_checked_is_named_from_the_grads_at_the_step() -> None:
    """torch FSDP2 reduces out of sight when its root's final callback is not reached: the grads at
    the step are then the reduce's output."""
    checks = [x for x in healthy_iteration(at_step_b0=INF) if x.probe.when != AFTER or x.probe.stage != RED]
    got = find_origin(checks)
    assert where(got) == (semconv.ORIGIN_REDUCE, "blocks.0"), got


def test_grads_reduced_in_float32_unchecked_before_are_named_as_their_units_backward() -> None:
    """torch FSDP2's grads reduced in float32 are not checked before the reduce (a float32 sum of
    finite grads does not overflow): a non-finite reduce output is then its unit's backward, not the
    reduce, whatever the reduce dtype of the other units."""
    checks = [
        x
        for x in healthy_iteration(r_b0_after=NAN, at_step_b0=NAN)
        if (x.probe.when, x.probe.where) != (BEFORE, "blocks.0") or x.probe.stage != RED
    ]
    origin = find_origin(checks)
    got = None if origin is None else (origin.stage, origin.where, origin.dtype, "reduced in float32" in origin.detail)
    want = (BWD, "blocks.0", "float32", True)
    assert got == want, f"want {want}, got {got} ({origin})"
    still_checked = find_origin(healthy_iteration(r_b0_after=INF, at_step_b0=INF))
    assert where(still_checked) == (semconv.ORIGIN_REDUCE, "blocks.0"), f"a checked fp16 reduce: {still_checked}"


def _at_step(checks: list[Checked], **values: float) -> list[Checked]:
    """``checks`` with the main grads at the step of the groups named (``blocks_0=0.0``) added."""
    added = [c(GW, where.replace("_", "."), value, dtype="float32") for where, value in values.items()]
    index = next(i for i, x in enumerate(checks) if x.probe.stage == GW)
    return [*checks[:index], *added, *[x for x in checks[index:] if x.probe.stage != GW]]


def test_grads_zeroed_between_the_reduce_and_the_step_are_named() -> None:
    """Every group's reduced grads non-zero and its main grads all 0 at the step (a clip of an Inf
    norm): both groups named. One group zeroed while the other kept its grads (a frozen part), a
    group not written since its reduce, or an iteration holding a NaN: nothing named."""
    both = _at_step(healthy_iteration(), blocks_0=0.0, blocks_1=0.0)
    assert zeroed_groups(both) == ["blocks.1", "blocks.0"], zeroed_groups(both)
    one = _at_step(healthy_iteration(), blocks_0=0.0, blocks_1=1.0)
    assert zeroed_groups(one) == [], zeroed_groups(one)
    unwritten = [
        x
        for x in _at_step(healthy_iteration(), blocks_0=0.0)
        if not (x.probe.stage == GW and x.probe.where == "blocks.1")
    ]
    assert zeroed_groups(unwritten) == [], zeroed_groups(unwritten)
    nan = _at_step(healthy_iteration(loss=NAN), blocks_0=0.0, blocks_1=0.0)
    assert zeroed_groups(nan) == [], zeroed_groups(nan)
    already_zero = _at_step(healthy_iteration(r_b0_after=0.0, r_b1_after=0.0), blocks_0=0.0, blocks_1=0.0)
    assert zeroed_groups(already_zero) == [], (
        f"grads zero after the reduce were not zeroed later: {zeroed_groups(already_zero)}"
    )


def test_the_log_reads_back_each_check_in_order() -> None:
    log = ProbeLog()
    log.check(FWD, "a", torch.tensor([1.0, -2.0]))
    log.check(FWD, "skipped: not floating", torch.tensor([1, 2]))
    log.check(FWD, "skipped: empty", torch.empty(0))
    log.check(FWD, "b", torch.tensor([NAN, 1.0], dtype=torch.bfloat16))
    log.microbatch = 1
    log.check(LOSS, "loss", torch.tensor(INF))
    stacked = log.stacked()
    got = [(x.probe.where, x.probe.dtype, x.probe.microbatch, x.finite, x.nan) for x in log.read(stacked)]
    want = [("a", "float32", 0, True, False), ("b", "bfloat16", 0, False, True), ("loss", "float32", 1, False, False)]
    assert got == want, f"want {want}, got {got}"
    assert stacked is not None
    only = [(x.probe.where, x.low, x.high) for x in log.read(stacked.tolist(), {LOSS, "no such stage"})]
    assert only == [("loss", INF, INF)], f"the loss's check alone: {only}"


def check_all_against_check(device: str) -> dict[str, Any]:
    """What :meth:`ProbeLog.check_all` and one :meth:`ProbeLog.check` per tensor read of the same
    tensors on ``device`` (a CUDA device takes the fused path): finite, NaN, magnitude, all zero."""
    tensors = {
        "finite": torch.tensor([-3.0, 2.0, 0.5]),
        "half": torch.tensor([-60000.0, 2.0]).to(torch.float16),
        "nan": torch.tensor([1.0, math.nan, -2.0]),
        "inf": torch.tensor([1.0, -math.inf]),
        "zeros": torch.zeros(4),
        "bf16": torch.tensor([-70000.0, 1.0]).to(torch.bfloat16),
        "empty": torch.zeros(0),
        "ints": torch.arange(3),
    }
    items = [(name, t.to(device), "", "") for name, t in tensors.items()]
    one, many, mixed = ProbeLog(), ProbeLog(), ProbeLog()
    for where, t, when, group in items:
        one.check(RED, where, t, when, group)
    many.check_all(RED, items)
    # Single checks around a list: their values interleave with the list's in the log.
    mixed.check(RED, *items[0][:2])
    mixed.check_all(RED, items[1:-1])
    mixed.check(RED, *items[-1][:2])
    mixed.check(RED, *items[-3][:2])

    def summary(log: ProbeLog) -> list[tuple[Any, ...]]:
        stacked = log.stacked()
        return [
            (
                x.probe.where,
                x.probe.dtype,
                x.finite,
                x.nan,
                "nan" if x.nan else x.magnitude,
                x.low == 0.0 and x.high == 0.0,
            )
            for x in log.read(None if stacked is None else stacked.cpu())
        ]

    return {"one": summary(one), "many": summary(many), "mixed": summary(mixed)}


def test_check_all_reads_as_one_check_per_tensor() -> None:
    got = check_all_against_check("cpu")
    assert got["many"] == got["one"], f"check_all {got['many']} != check per tensor {got['one']}"
    assert got["mixed"] == got["one"] + got["one"][-1:], f"mixed {got['mixed']} != {got['one']} then bf16 again"
    wheres = [row[0] for row in got["one"]]
    want = ["finite", "half", "nan", "inf", "zeros", "bf16"]
    assert wheres == want, f"checked (empty and integer skipped): got {wheres}, want {want}"


def test_fused_lists_read_as_one_check_per_tensor() -> None:
    """Lists fused as on a GPU, here on the CPU ([Note: one fused reduction per list on a GPU]): one
    reduction per dtype of the list (float32, float16, bfloat16), read back in the list's order
    among the single checks around it ([Note: the values kept per dtype])."""
    from unittest import mock

    from fsdp_patch.telemetry.diagnostics import prepared_checks

    unfused = check_all_against_check("cpu")
    with (
        mock.patch.object(prepared_checks, "FUSED_DEVICE_TYPES", prepared_checks.FUSED_DEVICE_TYPES | {"cpu"}),
        mock.patch.object(torch, "_foreach_norm", wraps=torch._foreach_norm) as fused,
    ):
        got = check_all_against_check("cpu")
    assert got == unfused, f"fused {got} != unfused {unfused}"
    sizes = sorted(len(call.args[0]) for call in fused.call_args_list)
    # many: 4 float32, 1 float16, 1 bfloat16; mixed: 3 float32, 1 float16, 1 bfloat16 (its middle five)
    assert sizes == [1, 1, 1, 1, 3, 4], f"tensors per fused reduction: got {sizes}"


def test_prepared_checks_retargeted_read_the_new_tensors() -> None:
    """A prepared list given new tensors for the same items (torch FSDP2's grads of the next
    iteration) checks those, with the probes it made first; the items it left out (empty) stay out."""
    first = [torch.ones(2), torch.zeros(0), torch.full((3,), 2.0, dtype=torch.bfloat16)]
    prepared = PreparedChecks(RED, [(f"blocks.{i}", t, AFTER, "") for i, t in enumerate(first)])
    probes = prepared.probes(1)
    prepared.retarget([torch.tensor([1.0, NAN]), torch.zeros(0), torch.full((3,), -4.0, dtype=torch.bfloat16)])
    log = ProbeLog()
    log.microbatch = 1
    log.check_prepared(prepared)
    got = [(x.probe.where, x.probe.dtype, x.nan, x.magnitude if x.finite else None) for x in log.read(log.stacked())]
    want = [("blocks.0", "float32", True, None), ("blocks.2", "bfloat16", False, 4.0)]
    assert got == want, f"want {want}, got {got}"
    assert prepared.probes(1) is probes, "the probes were made again"
