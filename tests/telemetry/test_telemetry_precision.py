"""Precision diagnostics on hand-made flat buffers, against hand counts and a numpy reference."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from fsdp_patch.telemetry import semconv
from fsdp_patch.telemetry.diagnostics import kernels, precision, rows
from fsdp_patch.telemetry.diagnostics.groups import PrecisionView, take_snapshot
from telemetry_testing import Group, point_value, reference_stats, run_fake_step, to_numpy

NAN, INF = math.nan, math.inf


def messy_fp16_group() -> tuple[Group, torch.Tensor]:
    """A group whose next step produces every diagnostic at least once; returns it and the new main weight."""
    before = torch.tensor([1.0, 2.0, 0.0, 0.0, 1e-8, 7e4, 3.0, -5.0, 1.0, 1.0])
    after = torch.tensor([1.0 + 1e-5, 2.5, 0.0, 0.0, 2e-8, 7.1e4, NAN, -INF, 1.0, 1.0 - 1e-6])
    grad = torch.tensor([0.5, -3.0, 0.0, 0.0, NAN, INF, 1.0, 2.0, -7.5, 0.0], dtype=torch.bfloat16)
    return Group(before.clone(), before.to(torch.float16), grad), after


def step_and_measure(groups, new_mains):
    """Snapshot, write the new main weights, refresh, and compute the diagnostics."""
    snapshot = take_snapshot(groups)
    before = [
        (to_numpy(g.main_weight), None if g.compute_weight is g.main_weight else to_numpy(g.compute_weight))
        for g in groups
    ]
    for group, new in zip(groups, new_mains, strict=True):
        group.main_weight.copy_(new)
        if group.compute_weight is not group.main_weight:
            group.compute_weight.copy_(group.main_weight)
    stats = precision.compute_stats(snapshot, groups)
    reference = reference_stats(
        [b[0] for b in before],
        [b[1] for b in before],
        [to_numpy(g.main_weight) for g in groups],
        [None if g.compute_weight is g.main_weight else to_numpy(g.compute_weight) for g in groups],
        [None if g.main_grad is None else to_numpy(g.main_grad) for g in groups],
    )
    return stats, reference


def test_hand_counted_diagnostics_fp32_main_fp16_compute():
    group, after = messy_fp16_group()
    stats, reference = step_and_measure([group], [after])

    # Counted by hand from the tensors above.
    assert stats.nonfinite == {
        (semconv.TENSOR_MAIN_GRAD, semconv.NONFINITE_NAN): 1,
        (semconv.TENSOR_MAIN_GRAD, semconv.NONFINITE_INF): 1,
        (semconv.TENSOR_MAIN_WEIGHT, semconv.NONFINITE_NAN): 1,
        (semconv.TENSOR_MAIN_WEIGHT, semconv.NONFINITE_INF): 1,  # 3.0 -> NaN, -5 -> -inf
        (semconv.TENSOR_COMPUTE_WEIGHT, semconv.NONFINITE_NAN): 1,
        (semconv.TENSOR_COMPUTE_WEIGHT, semconv.NONFINITE_INF): 2,  # plus 7.1e4 beyond fp16's 65504
    }
    assert stats.overflow == 1  # 7.1e4: finite in fp32, inf in fp16 (the -inf main is not "finite")
    assert stats.underflow == 1  # 2e-8: below fp16's smallest subnormal (6e-8)
    assert stats.changed == 7  # all but the two padding zeros and the unchanged 1.0
    assert stats.lost == 4  # 1+1e-5, 2e-8 (0 -> 0), 7.1e4 (inf -> inf), 1-1e-6
    assert stats.lost_ratio == pytest.approx(4 / 7)
    # a NaN/Inf grad has no finite largest |grad|: off the scale, never 0 (vanishing)
    assert stats.grad_amax == rows.GRAD_AMAX_NONFINITE
    assert stats.complete

    # ... and the independent numpy reference agrees on every count.
    assert stats.nonfinite == reference["nonfinite"]
    for key in ("overflow", "underflow", "changed", "lost"):
        assert getattr(stats, key) == reference[key], key
    assert stats.lost_ratio == pytest.approx(reference["lost_ratio"])
    # over the 7 elements finite in both weights: the rounding of 1+1e-5, 2.5, 2e-8, 1-1e-6
    assert stats.refresh_error == pytest.approx(reference["refresh_error"], rel=1e-5)
    assert 0 < stats.refresh_error < 2**-11


def clean_groups(seed: int = 0, n: int = 1000):
    """Three groups: bf16 compute with grads, fp32 (compute is main) with grads, frozen fp16."""
    g = torch.Generator().manual_seed(seed)
    mains = [torch.randn(n, generator=g) for _ in range(3)]
    mains[0][-7:] = 0.0  # padding
    groups = [
        Group(mains[0].clone(), mains[0].to(torch.bfloat16), (torch.randn(n, generator=g) * 3).to(torch.bfloat16)),
        Group(mains[1].clone(), None, torch.randn(n, generator=g)),  # type: ignore[arg-type]
        Group(mains[2].clone(), mains[2].to(torch.float16), None),
    ]
    groups[1].compute_weight = groups[1].main_weight
    # Updates of mixed size: half tiny (lost in bf16/fp16), half large; padding stays zero.
    scale = torch.where(torch.rand(n, generator=g) < 0.5, 1e-6, 1e-1)
    new_mains = [m + scale * torch.randn(n, generator=g) for m in mains]
    new_mains[0][-7:] = 0.0
    return groups, new_mains


def test_clean_diagnostics_against_numpy_reference():
    groups, new_mains = clean_groups()
    stats, reference = step_and_measure(groups, new_mains)
    assert all(v == 0 for v in stats.nonfinite.values())
    assert stats.overflow == stats.underflow == 0
    assert stats.changed == reference["changed"] > 0
    assert stats.lost == reference["lost"] > 0
    assert stats.lost_ratio == pytest.approx(reference["lost_ratio"], rel=1e-12)
    assert 0.2 < stats.lost_ratio < 0.6  # tiny updates of the fp32 group are not lost: it has no compute copy
    assert stats.grad_amax == reference["grad_amax"]
    assert stats.refresh_error == pytest.approx(reference["refresh_error"], rel=1e-5)
    assert 1e-4 < stats.refresh_error < 2**-8  # bf16/fp16 rounding, never above bf16 unit roundoff


def test_chunking_does_not_change_results(monkeypatch):
    groups, new_mains = clean_groups(seed=3, n=257)
    whole, _ = step_and_measure(groups, new_mains)
    groups, new_mains = clean_groups(seed=3, n=257)
    monkeypatch.setattr(kernels, "CHUNK_ELEMENTS", 10)
    chunked, _ = step_and_measure(groups, new_mains)
    assert chunked.nonfinite == whole.nonfinite
    assert (chunked.changed, chunked.lost, chunked.grad_amax) == (whole.changed, whole.lost, whole.grad_amax)
    assert chunked.refresh_error == pytest.approx(whole.refresh_error, rel=1e-6)


def test_nothing_changed_and_all_zero_weights_give_zero():
    zeros = torch.zeros(16)
    group = Group(zeros.clone(), zeros.to(torch.bfloat16), torch.zeros(16, dtype=torch.bfloat16))
    stats, _ = step_and_measure([group], [zeros])
    assert (stats.changed, stats.lost, stats.lost_ratio, stats.refresh_error, stats.grad_amax) == (0, 0, 0.0, 0.0, 0.0)


def test_all_nan_grads_read_off_scale_not_zero():
    """Once every grad is NaN, grad.amax must not read 0 (which reads as vanishing gradients)."""
    main = torch.linspace(-1, 1, 64)
    group = Group(main.clone(), main.to(torch.bfloat16), torch.full((64,), NAN, dtype=torch.bfloat16))
    stats, reference = step_and_measure([group], [main + 0.5])
    want = float(np.finfo(np.float32).max)
    assert stats.grad_amax == want == reference["grad_amax"], f"want {want}, got {stats.grad_amax}"
    assert stats.nonfinite[(semconv.TENSOR_MAIN_GRAD, semconv.NONFINITE_NAN)] == 64


def bit_copies(groups):
    return [
        tuple(
            None if t is None else t.view(torch.uint8).clone() for t in (g.main_weight, g.compute_weight, g.main_grad)
        )
        for g in groups
    ]


def test_precision_end_leaves_every_buffer_bitwise_unchanged(make_observer):
    messy, after = messy_fp16_group()
    groups, new_mains = clean_groups(seed=1)
    groups, new_mains = [messy, *groups], [after, *new_mains]
    observer = make_observer()
    snapshot = observer.precision_begin(groups)
    for group, new in zip(groups, new_mains, strict=True):
        group.main_weight.copy_(new)
        if group.compute_weight is not group.main_weight:
            group.compute_weight.copy_(group.main_weight)
    buffers = bit_copies(groups)
    snap_bits = [t.view(torch.uint8).clone() for group in snapshot.main_weights for t in group]
    versions = [g.main_weight._version for g in groups]

    observer.precision_end(snapshot, groups)

    for now, then in zip(bit_copies(groups), buffers, strict=True):
        for a, b in zip(now, then, strict=True):
            assert (a is None and b is None) or torch.equal(a, b)
    snapped = [t for group in snapshot.main_weights for t in group]
    assert all(torch.equal(s.view(torch.uint8), b) for s, b in zip(snapped, snap_bits, strict=True))
    assert [g.main_weight._version for g in groups] == versions


def test_observer_records_the_diagnostics(otel, make_observer, monkeypatch):
    monkeypatch.setenv("FSDP_PATCH_PRECISION_EVERY", "1")
    observer = make_observer()
    group, after = messy_fp16_group()
    run_fake_step(observer, [group], [after])
    points = otel.points()
    expected_nonfinite = {
        (semconv.TENSOR_MAIN_GRAD, semconv.NONFINITE_NAN): 1,
        (semconv.TENSOR_MAIN_GRAD, semconv.NONFINITE_INF): 1,
        (semconv.TENSOR_MAIN_WEIGHT, semconv.NONFINITE_NAN): 1,
        (semconv.TENSOR_MAIN_WEIGHT, semconv.NONFINITE_INF): 1,
        (semconv.TENSOR_COMPUTE_WEIGHT, semconv.NONFINITE_NAN): 1,
        (semconv.TENSOR_COMPUTE_WEIGHT, semconv.NONFINITE_INF): 2,
    }
    for (tensor, kind), count in expected_nonfinite.items():
        assert (
            point_value(
                points, semconv.METRIC_NONFINITE, **{semconv.ATTR_TENSOR: tensor, semconv.ATTR_NONFINITE_KIND: kind}
            )
            == count
        )
    assert point_value(points, semconv.METRIC_REFRESH_OVERFLOW) == 1
    assert point_value(points, semconv.METRIC_REFRESH_UNDERFLOW) == 1
    assert point_value(points, semconv.METRIC_LOST_RATIO) == pytest.approx(4 / 7)
    assert point_value(points, semconv.METRIC_GRAD_AMAX) == rows.GRAD_AMAX_NONFINITE
    assert all(p.attributes[semconv.ATTR_RANK] == 0 for name in points for p in points[name])

    # A second, clean diagnostic step: counters accumulate, gauges show the latest value.
    groups, new_mains = clean_groups(seed=2)
    _, reference = step_and_measure(*clean_groups(seed=2))
    run_fake_step(observer, groups, new_mains)
    points = otel.points()
    assert point_value(points, semconv.METRIC_REFRESH_OVERFLOW) == 1
    assert (
        point_value(
            points,
            semconv.METRIC_NONFINITE,
            **{semconv.ATTR_TENSOR: semconv.TENSOR_COMPUTE_WEIGHT},
            **{semconv.ATTR_NONFINITE_KIND: semconv.NONFINITE_INF},
        )
        == 2
    )
    assert point_value(points, semconv.METRIC_GRAD_AMAX) == reference["grad_amax"]
    assert point_value(points, semconv.METRIC_REFRESH_ERROR) == pytest.approx(reference["refresh_error"], rel=1e-5)
    assert point_value(points, semconv.METRIC_LOST_RATIO) == pytest.approx(reference["lost_ratio"])


@pytest.mark.parametrize(
    ("every", "window", "due_steps"),
    [
        ("1", None, list(range(1, 121))),
        ("3", None, [s for s in range(1, 121) if s % 3 == 0 or s < 3]),
        ("0", None, []),
        # the default: steps 1 to 3, then 5, 10, 20, 50 (the 1-2-5 series below 100), then every 100th
        (None, None, [1, 2, 3, 5, 10, 20, 50, 100]),
        ("7", None, [1, 2, 3, 5, 7, 14, 21, 28, 35, 42, 49, 56, 63, 70, 77, 84, 91, 98, 105, 112, 119]),
        # a longer window: a parameter stuck from the start is still named at its end
        ("100", "5", [1, 2, 3, 4, 5, 10, 20, 50, 100]),
    ],
)
def test_precision_schedule(make_observer, monkeypatch, every, window, due_steps):
    if every is not None:
        monkeypatch.setenv("FSDP_PATCH_PRECISION_EVERY", every)
    if window is not None:
        monkeypatch.setenv("FSDP_PATCH_PRECISION_WINDOW", window)
    observer = make_observer()
    got = [s for s in range(1, 121) if observer.precision_due(s)]
    assert got == due_steps, f"every={every} window={window}: want diagnosed steps {due_steps}, got {got}"
    if every is None:
        steady = [s for s in range(101, 1001) if observer.precision_due(s)]
        assert steady == list(range(200, 1001, 100)), f"past step 100 want every 100th step, got {steady}"


def test_sdk_disabled_turns_diagnostics_off(make_observer, monkeypatch):
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert not make_observer().precision_due(1)


def test_local_failure_is_reported_once_and_records_nothing(otel, make_observer, caplog):
    observer = make_observer()
    group, _ = messy_fp16_group()
    snapshot = observer.precision_begin([group])
    with caplog.at_level(logging.WARNING):
        observer.precision_end(snapshot, [group, group])  # wrong number of groups
        observer.precision_end(snapshot, [])
    warnings = [r for r in caplog.records if "precision diagnostics failed" in r.getMessage()]
    assert len(warnings) == 1
    assert "snapshot holds 1 groups, got 2" in warnings[0].getMessage()
    assert not any(name.startswith("fsdp.precision") for name in otel.points())


def test_protocol_is_satisfied_by_the_test_group():
    group, _ = messy_fp16_group()
    assert isinstance(group, PrecisionView)
    assert np.isnan(to_numpy(group.main_grad)).sum() == 1


@dataclass
class ListGroup:
    """A stand-in for torch FSDP2's groups (telemetry.TensorListView): per-parameter shards whose
    compute weight is their cast to ``compute_dtype`` at the next all-gather."""

    main_weights: list[torch.Tensor]
    main_grads: list[torch.Tensor]
    compute_dtype: torch.dtype | None
    process_group: object = None


@pytest.mark.parametrize("compute_dtype", [torch.float16, torch.bfloat16])
def test_tensor_list_groups_against_numpy_reference(compute_dtype, monkeypatch):
    monkeypatch.setattr(kernels, "CHUNK_ELEMENTS", 7)  # several chunks per tensor
    messy, after = messy_fp16_group()
    g = torch.Generator().manual_seed(5)
    mains = [messy.main_weight.clone(), torch.randn(33, generator=g), torch.zeros(0)]
    new = [after, mains[1] + torch.where(torch.rand(33, generator=g) < 0.5, 1e-6, 1e-1), torch.zeros(0)]
    grads = [messy.main_grad.float(), torch.randn(33, generator=g)]  # the empty shard has no grad
    group = ListGroup([m.clone() for m in mains], grads, compute_dtype)
    snapshot = take_snapshot([group])
    for weight, value in zip(group.main_weights, new, strict=True):
        weight.copy_(value)
    stats = precision.compute_stats(snapshot, [group])

    def cast(t: torch.Tensor) -> np.ndarray:
        return to_numpy(t.to(compute_dtype))

    reference = reference_stats(
        [to_numpy(m) for m in mains],
        [cast(m) for m in mains],
        [to_numpy(m) for m in new],
        [cast(m) for m in new],
        [to_numpy(grads[0]), to_numpy(grads[1]), None],
    )
    assert stats.nonfinite == reference["nonfinite"], (stats.nonfinite, reference["nonfinite"])
    for key in ("overflow", "underflow", "changed", "lost"):
        assert getattr(stats, key) == reference[key], f"{key}: want {reference[key]}, got {getattr(stats, key)}"
    assert stats.lost_ratio == pytest.approx(reference["lost_ratio"], rel=1e-12)
    assert stats.refresh_error == pytest.approx(reference["refresh_error"], rel=1e-5)
    assert stats.grad_amax == reference["grad_amax"] == rows.GRAD_AMAX_NONFINITE
    if compute_dtype == torch.float16:  # 7.1e4 overflows fp16, 2e-8 underflows it
        assert (stats.overflow, stats.underflow) == (1, 1)


def test_user_given_compute_dtype_applies_where_the_policy_names_none():
    """FSDP_PATCH_COMPUTE_DTYPE (an autocast model): the diagnostics then cast to it; without it
    the compute weight is the main weight and nothing can be lost."""
    main = torch.linspace(1, 2, 64)
    new = main + 1e-5  # below bf16's resolution near 1-2: every update lost in bf16
    results = {}
    for default in (None, torch.bfloat16):
        group = ListGroup([main.clone()], [torch.ones(64)], compute_dtype=None)
        snapshot = take_snapshot([group], default_compute_dtype=default)
        group.main_weights[0].copy_(new)
        results[default] = precision.compute_stats(snapshot, [group])
    assert (results[None].changed, results[None].lost) == (64, 0), results[None]
    assert (results[torch.bfloat16].changed, results[torch.bfloat16].lost) == (64, 64), results[torch.bfloat16]


@dataclass
class Float8Group(Group):
    """A stand-in for a ``fully_shard`` group of torchao's float8 weights: its compute weight is
    float8 data scaled by a per-weight scale (``fsdp_patch.sharding.float8_copy``)."""

    float8: object = "torch.float8_e4m3fn"


def test_a_float8_groups_copy_is_not_compared_with_its_main_weights():
    """Its scaled float8 values would read as refresh errors, lost updates and flushed weights far
    past a bf16 copy's thresholds: the diagnostics read its main weights and grads alone."""
    main = torch.tensor([0.5, -1.0, 1e-6, 2.0])
    scale = torch.finfo(torch.float8_e4m3fn).max / main.abs().max()
    group = Float8Group(main.clone(), (main * scale).to(torch.float8_e4m3fn), torch.tensor([1.0, NAN, 0.0, 0.0]))
    snapshot = take_snapshot([group])
    group.main_weight.add_(1e-7)  # every update below float8's resolution
    stats = precision.compute_stats(snapshot, [group])
    want = {(semconv.TENSOR_MAIN_GRAD, semconv.NONFINITE_NAN): 1}
    assert {k: v for k, v in stats.nonfinite.items() if v} == want, f"expected {want}, got {stats.nonfinite}"
    got = (stats.lost, stats.underflow, stats.overflow, stats.refresh_error)
    assert got == (0, 0, 0, 0.0), f"expected no refresh checks on the float8 copy, got (lost, under, over, error) {got}"
