"""Per-parameter precision rows from flat buffers, against a per-tensor reference on each parameter."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from fsdp_patch.telemetry import semconv
from fsdp_patch.telemetry.diagnostics import kernels, param_stats, precision
from fsdp_patch.telemetry.diagnostics import rows as ps
from fsdp_patch.telemetry.diagnostics.groups import take_snapshot
from telemetry_testing import ListGroup, reference_stats, to_numpy

from fsdp_patch.sharding.layout import GroupLayout

NAN, INF = math.nan, math.inf


@dataclass
class FlatGroup:
    """A stand-in for fsdp_patch's ParameterGroup: flat buffers in a real layout, with names."""

    main_weight: torch.Tensor
    compute_weight: torch.Tensor
    main_grad: torch.Tensor | None
    layout: GroupLayout
    names: list[str]
    process_group: object = None
    params: list = field(default_factory=list)


# Large enough that the word count (>= 16384 elements) and several chunks are exercised, with
# lengths that are not multiples of 1024; shards of 3 ranks are uneven (rank 2 owns fewer rows of
# a.weight and no row of c.bias).
SHAPES = [torch.Size((50, 1000)), torch.Size((7,)), torch.Size((3, 5)), torch.Size((60, 900)), torch.Size((2,))]
NAMES = ["a.weight", "a.bias", "b.weight", "c.weight", "c.bias"]


def flat_group(
    seed: int, compute_dtype: torch.dtype | None = torch.bfloat16, rank: int = 1
) -> tuple[FlatGroup, torch.Tensor]:
    layout = GroupLayout.build(SHAPES, world_size=3, rank=rank)
    g = torch.Generator().manual_seed(seed)
    main = torch.zeros(layout.shard_numel)
    new = torch.zeros(layout.shard_numel)
    grad = torch.zeros(layout.shard_numel)
    for p in layout.params:
        n = p.local_numel
        main[p.offset : p.offset + n] = torch.randn(n, generator=g)
        scale = torch.where(torch.rand(n, generator=g) < 0.5, 1e-6, 1e-1)
        new[p.offset : p.offset + n] = main[p.offset : p.offset + n] + scale * torch.randn(n, generator=g)
        grad[p.offset : p.offset + n] = torch.randn(n, generator=g)
    # b.weight: NaN/Inf in the new main weight and the grad; c.bias: an update lost entirely.
    b, c_bias = layout.params[2], layout.params[4]
    new[b.offset] = NAN
    new[b.offset + 1] = -INF
    grad[b.offset + 2] = INF
    main[c_bias.offset : c_bias.offset + c_bias.local_numel] = 1.0
    new[c_bias.offset : c_bias.offset + c_bias.local_numel] = 1.0 + 1e-5  # below bf16's and fp16's rounding step at 1
    compute = main.clone() if compute_dtype is None else main.to(compute_dtype)
    group = FlatGroup(main.clone(), compute, grad.to(torch.bfloat16), layout, NAMES)
    if compute_dtype is None:
        group.compute_weight = group.main_weight
    return group, new


def step(groups: list, news: list[torch.Tensor], states=None, detail: bool = True):
    snapshot = take_snapshot(groups)
    befores = [
        (g.main_weight.clone(), None if g.compute_weight is g.main_weight else g.compute_weight.clone()) for g in groups
    ]
    for group, new in zip(groups, news, strict=True):
        group.main_weight.copy_(new)
        if group.compute_weight is not group.main_weight:
            group.compute_weight.copy_(group.main_weight)
    table = ps.param_table(groups)
    rows = param_stats.local_rows(snapshot, groups, table, states, detail=detail)
    return table, rows.tolist(), befores


def reference_row(main_before, compute_before, main_after, compute_after, grad) -> dict[str, float]:
    ref = reference_stats(
        [to_numpy(main_before)],
        [None if compute_before is None else to_numpy(compute_before)],
        [to_numpy(main_after)],
        [None if compute_after is None else to_numpy(compute_after)],
        [None if grad is None else to_numpy(grad)],
    )
    c = main_after if compute_after is None else compute_after
    finite = torch.isfinite(main_after) & torch.isfinite(c)
    m = main_after.double()[finite]
    diff = main_after.double() - main_before.double()
    ref["main_sq"] = float((m**2).sum())
    ref["diff_sq"] = float(((c.double()[finite] - m) ** 2).sum())
    ref["update_sq"] = float((diff[torch.isfinite(diff)] ** 2).sum())
    return ref


@pytest.mark.parametrize("rank", [1, 2])
@pytest.mark.parametrize("chunk", [kernels.CHUNK_ELEMENTS, 9000, 13])
@pytest.mark.parametrize("compute_dtype", [torch.bfloat16, torch.float16, None])
def test_rows_equal_a_per_tensor_reference(monkeypatch, chunk: int, compute_dtype, rank: int) -> None:
    monkeypatch.setattr(kernels, "CHUNK_ELEMENTS", chunk)
    group, new = flat_group(seed=1, compute_dtype=compute_dtype, rank=rank)
    table, rows, ((main_before, compute_before),) = step([group], [new])
    assert [s.name for s in table] == NAMES
    assert [(s.start, s.length) for s in table] == [(p.offset, p.local_numel) for p in group.layout.params]
    for slot, row in zip(table, rows, strict=True):
        cut = slice(slot.start, slot.start + slot.length)
        compute_after = None if compute_dtype is None else group.compute_weight[cut]
        ref = reference_row(
            main_before[cut],
            None if compute_before is None else compute_before[cut],
            group.main_weight[cut],
            compute_after,
            group.main_grad[cut],
        )
        got = {
            "changed": row[ps.CHANGED],
            "lost": row[ps.LOST],
            "overflow": row[ps.OVERFLOW],
            "underflow": row[ps.UNDERFLOW],
            **{
                f"{t}/{k}": row[s]
                for (t, k), s in zip(
                    [
                        (t, k)
                        for t in (semconv.TENSOR_MAIN_GRAD, semconv.TENSOR_MAIN_WEIGHT, semconv.TENSOR_COMPUTE_WEIGHT)
                        for k in semconv.NONFINITE_KINDS
                    ],
                    (ps.GRAD_NAN, ps.GRAD_INF, ps.MAIN_NAN, ps.MAIN_INF, ps.COMPUTE_NAN, ps.COMPUTE_INF),
                    strict=True,
                )
            },
            "numel": row[ps.NUMEL],
            "grad_amax": row[ps.GRAD_AMAX],
        }
        want = {
            "changed": ref["changed"],
            "lost": ref["lost"],
            "overflow": ref["overflow"],
            "underflow": ref["underflow"],
            **{f"{t}/{k}": v for (t, k), v in ref["nonfinite"].items()},
            "numel": slot.length,
            "grad_amax": ref["grad_amax"],
        }
        assert got == want, f"{slot.name}: want {want}, got {got}"
        for key, slot_index, rel in (("main_sq", ps.MAIN_SQ, 1e-6), ("diff_sq", ps.DIFF_SQ, 1e-5)):
            assert row[slot_index] == pytest.approx(ref[key], rel=rel, abs=1e-30), f"{slot.name} {key}"
        want_update = ref["update_sq"]  # every parameter's update, whether its compute dtype is narrower or not
        assert row[ps.UPDATE_SQ] == pytest.approx(want_update, rel=1e-5, abs=1e-30), f"{slot.name}: update_sq"
    assert rows[2][ps.MAIN_NAN] == 1 and rows[2][ps.GRAD_INF] == 1, "b.weight's planted NaN/Inf"
    assert (table[4].length == 0) == (rank == 2), "rank 2 holds no row of c.bias"
    if compute_dtype is not None and rank == 1:
        assert rows[4][ps.LOST] == rows[4][ps.CHANGED] > 0, "c.bias: every update lost"


@pytest.mark.parametrize("compute_dtype", [torch.bfloat16, None])
def test_a_nan_the_step_removes_is_left_out_of_the_update_norm_alone(compute_dtype) -> None:
    """Only the weights before the step hold the NaN: the update's norm is over its finite
    elements, every other slot of that parameter as for a clean one, the other parameters untouched."""
    group, new = flat_group(seed=5, compute_dtype=compute_dtype)
    a = group.layout.params[0]
    group.main_weight[a.offset + 3] = NAN  # the step writes a finite value over it
    if compute_dtype is not None:
        group.compute_weight.copy_(group.main_weight)
    table, rows, ((main_before, compute_before),) = step([group], [new])
    cut = slice(a.offset, a.offset + a.local_numel)
    ref = reference_row(
        main_before[cut],
        None if compute_before is None else compute_before[cut],
        group.main_weight[cut],
        None if compute_dtype is None else group.compute_weight[cut],
        group.main_grad[cut],
    )
    row = rows[0]
    got = {"changed": row[ps.CHANGED], "lost": row[ps.LOST], "main nan": row[ps.MAIN_NAN]}
    want = {"changed": ref["changed"], "lost": ref["lost"], "main nan": 0}
    assert got == want, f"a.weight: want {want}, got {got}"
    want_update = ref["update_sq"]
    assert math.isfinite(row[ps.UPDATE_SQ]), f"a.weight's update norm is {row[ps.UPDATE_SQ]}, want a finite sum"
    assert row[ps.UPDATE_SQ] == pytest.approx(want_update, rel=1e-5), "over the finite elements of the update"
    assert row[ps.MAIN_SQ] == pytest.approx(ref["main_sq"], rel=1e-6)
    clean, clean_new = flat_group(seed=5, compute_dtype=compute_dtype)
    _, clean_rows, _ = step([clean], [clean_new])
    assert rows[1:] == clean_rows[1:], "the other parameters' rows are those of the same step without the NaN"


def test_rows_add_up_to_the_whole_model_vector() -> None:
    group, new = flat_group(seed=2)
    table, rows, _ = step([group], [new])
    group2, new2 = flat_group(seed=2)
    snapshot = take_snapshot([group2])
    group2.main_weight.copy_(new2)
    group2.compute_weight.copy_(group2.main_weight)
    whole = precision.local_stats(snapshot, [group2]).tolist()  # one slot for the whole buffer
    summed = ps.totals(torch.tensor(rows, dtype=torch.float64)).tolist()
    sums = (ps.DIFF_SQ, ps.MAIN_SQ)  # float sums, in another order
    assert [v for i, v in enumerate(summed) if i not in sums] == [v for i, v in enumerate(whole) if i not in sums], (
        f"rows summed {summed}, whole model {whole}"
    )
    assert [summed[i] for i in sums] == pytest.approx([whole[i] for i in sums], rel=1e-6)


def test_word_count_ignores_what_earlier_masks_left() -> None:
    long = kernels.masks.get("mask", torch.zeros(1), 40_000)
    long.fill_(True)
    for n in (16_384, 17_000, 20_001, 39_999):
        mask = kernels.masks.get("mask", torch.zeros(1), n)
        mask.fill_(False)
        mask[::3] = True
        got, want = int(kernels.count_true(mask)), int(torch.count_nonzero(mask))
        assert got == want, f"n={n}: word count {got}, count_nonzero {want}"


def test_state_rows_count_nonfinite_and_flushed_exp_avg_sq() -> None:
    group, new = flat_group(seed=3, compute_dtype=torch.bfloat16)
    group.main_grad[: group.layout.params[0].local_numel].zero_()  # a.weight: no grad at all ...
    group.main_grad[0:10] = 1e-3  # ... but for ten elements
    table = ps.param_table([group])
    exp_avg = [torch.zeros(s.length) for s in table]
    exp_avg_sq = [torch.ones(s.length) for s in table]
    exp_avg[1][2] = NAN  # a.bias
    exp_avg_sq[3][:5] = INF  # c.weight
    exp_avg_sq[0][:20] = 0.0  # a.weight: 10 with a grad (flushed), 10 without
    states = [
        [ps.StateTensor("exp_avg", 0, a), ps.StateTensor("exp_avg_sq", 1, b)]
        for a, b in zip(exp_avg, exp_avg_sq, strict=True)
    ]
    _, rows, _ = step([group], [new], states)
    got = {
        (table[i].name, k): rows[i][slot]
        for i in range(len(table))
        for k, slot in (
            ("exp_avg nan", ps.STATE_NAN),
            ("exp_avg_sq inf", ps.STATE_INF + 2),
            ("flushed", ps.STATE_FLUSHED),
        )
        if rows[i][slot]
    }
    want = {("a.bias", "exp_avg nan"): 1, ("c.weight", "exp_avg_sq inf"): 5, ("a.weight", "flushed"): 10}
    assert got == want, f"want {want}, got {got}"
    other, other_new = flat_group(seed=3)
    _, plain, _ = step([other], [other_new], states, detail=False)
    assert all(r[ps.UPDATE_SQ] == 0 and r[ps.STATE_FLUSHED] == 0 and r[ps.STATE_NAN] == 0 for r in plain), (
        "detail=False computes no attribution slots"
    )


def test_table_of_tensor_list_groups_names_and_aligns_grads() -> None:
    mains = [torch.randn(5), torch.zeros(0), torch.randn(4)]
    group = ListGroup(
        [m.clone() for m in mains], [torch.ones(5), torch.full((4,), 2.0)], torch.bfloat16, ["x", "y", "z"]
    )
    snapshot = take_snapshot([group])
    for weight in group.main_weights:
        weight.add_(1.0)
    table = ps.param_table([group])
    rows = param_stats.local_rows(snapshot, [group], table).tolist()
    assert [(s.name, s.unit, s.length) for s in table] == [
        ("x", "blocks.3", 5),
        ("y", "blocks.3", 0),
        ("z", "blocks.3", 4),
    ]
    assert [r[ps.GRAD_AMAX] for r in rows] == [1.0, 0.0, 2.0], "grads matched to their shards by size"
    assert [r[ps.CHANGED] for r in rows] == [5, 0, 4]


def test_snapshot_mismatch_is_a_clear_error() -> None:
    group, _ = flat_group(seed=4)
    snapshot = take_snapshot([group])
    with pytest.raises(ValueError, match="snapshot holds 1 groups, got 2"):
        param_stats.local_rows(snapshot, [group, group], ps.param_table([group, group]))
    with pytest.raises(ValueError, match="optimizer state given for 1 parameters, the table has 5"):
        param_stats.local_rows(snapshot, [group], ps.param_table([group]), [[]])


def test_failed_payload_marks_the_step_incomplete() -> None:
    good = ps.payload(torch.zeros((3, ps.ROW), dtype=torch.float64))
    bad = ps.failed_payload(3, torch.device("cpu"))
    rows, complete = ps.split_status(ps.reduce_gathered(torch.stack([good, bad])))
    assert rows.shape == (3, ps.ROW) and not complete
    rows, complete = ps.split_status(ps.reduce_gathered(torch.stack([good, good])))
    assert complete and float(rows.abs().sum()) == 0.0
    assert np.isnan(bad.numpy()).all()


def test_grad_zeros_and_grads_below_a_normal_range_match_a_per_tensor_count() -> None:
    """GRAD_ZERO and GRAD_TINY of each parameter, against counts on its own grad: float16's smallest
    normal as the bound, grads of every magnitude, exact zeros and subnormal ones (fp32 main grads
    of a float16 backward keep what it computed below that normal)."""
    group, new = flat_group(seed=7, compute_dtype=torch.float16)
    g = torch.Generator().manual_seed(8)
    grad = torch.zeros(group.layout.shard_numel)
    for p in group.layout.params:
        n = p.local_numel
        magnitude = 10.0 ** torch.randint(-12, 1, (n,), generator=g).float()
        values = magnitude * torch.randn(n, generator=g)
        values[torch.rand(n, generator=g) < 0.3] = 0.0
        grad[p.offset : p.offset + n] = values
    group.main_grad = grad
    below = float(torch.finfo(torch.float16).tiny)
    snapshot = take_snapshot([group])
    group.main_weight.copy_(new)
    group.compute_weight.copy_(group.main_weight)
    table = ps.param_table([group])
    rows = param_stats.local_rows(snapshot, [group], table, underflow_below=below).tolist()
    got = {s.name: (rows[i][ps.GRAD_ZERO], rows[i][ps.GRAD_TINY]) for i, s in enumerate(table)}
    want = {}
    for p, name in zip(group.layout.params, NAMES, strict=True):
        segment = grad[p.offset : p.offset + p.local_numel]
        zeros = int((segment == 0).sum())
        want[name] = (float(zeros), float(int((segment.abs() < below).sum()) - zeros))
    assert got == want, f"want {want}, got {got}"
    plain = param_stats.local_rows(take_snapshot([group]), [group], table).tolist()
    unmeasured = [(r[ps.GRAD_ZERO], r[ps.GRAD_TINY]) for r in plain]
    assert unmeasured == [(0.0, 0.0)] * len(table), f"counted without being asked: {unmeasured}"
