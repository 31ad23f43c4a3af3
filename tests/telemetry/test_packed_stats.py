"""Small parameters' rows made in packs (``packed_stats``) equal the rows of their own passes, for
each form of compute weight (the main weight itself, a materialized copy, a cast made at each
gather), with NaN/Inf, signed zeros, zero and tiny grads and optimizer state in them."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch
from fsdp_patch.telemetry.diagnostics import packed_stats, param_stats
from fsdp_patch.telemetry.diagnostics import rows as ps
from fsdp_patch.telemetry.diagnostics.groups import take_snapshot
from fsdp_patch.telemetry.diagnostics.segments import segments
from telemetry_testing import ListGroup

from fsdp_patch.sharding.layout import GroupLayout

NAN, INF = math.nan, math.inf
# Many small parameters (a pack or two), one too large to pack between them.
SHAPES = [(4, 4), (7,), (3, 5), (2,), (6, 3), (1,), (200, 90), (5, 5), (9,)]
SUMS = (ps.MAIN_SQ, ps.DIFF_SQ, ps.UPDATE_SQ, ps.GRAD_AMAX)


@dataclass
class FlatGroup:
    """A stand-in for fsdp_patch's ParameterGroup: flat buffers in a real layout."""

    main_weight: torch.Tensor
    compute_weight: torch.Tensor
    main_grad: torch.Tensor
    layout: GroupLayout
    names: list[str]
    process_group: object = None
    params: list = field(default_factory=list)


def _values(n: int, g: torch.Generator) -> torch.Tensor:
    values = torch.randn(n, generator=g) * 10.0 ** torch.randint(-9, 2, (n,), generator=g).float()
    values[torch.rand(n, generator=g) < 0.2] = 0.0
    return values


def _plant(main: torch.Tensor, new: torch.Tensor, grad: torch.Tensor, offsets: list[int]) -> None:
    """NaN/Inf in the third parameter's new weight and grad, a signed zero written in the fourth,
    a change below bf16's rounding step in the fifth."""
    new[offsets[2]] = NAN
    new[offsets[2] + 1] = -INF
    grad[offsets[2] + 2] = INF
    main[offsets[3]] = 0.0
    new[offsets[3]] = -0.0
    new[offsets[4] : offsets[4] + 3] = main[offsets[4] : offsets[4] + 3] * (1 + 1e-6)


def _flat(compute: bool, seed: int) -> tuple[FlatGroup, torch.Tensor]:
    layout = GroupLayout.build([torch.Size(s) for s in SHAPES], world_size=2, rank=0)
    g = torch.Generator().manual_seed(seed)
    main, new, grad = (torch.zeros(layout.shard_numel) for _ in range(3))
    for p in layout.params:
        n = p.local_numel
        main[p.offset : p.offset + n] = torch.randn(n, generator=g)
        new[p.offset : p.offset + n] = main[p.offset : p.offset + n] + _values(n, g)
        grad[p.offset : p.offset + n] = _values(n, g)
    _plant(main, new, grad, [p.offset for p in layout.params])
    group = FlatGroup(main.clone(), main.to(torch.bfloat16), grad, layout, [f"p{i}" for i in range(len(SHAPES))])
    if not compute:
        group.compute_weight = group.main_weight
    return group, new


def _list(seed: int) -> tuple[ListGroup, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    sizes = [math.prod(s) for s in SHAPES]
    main = torch.randn(sum(sizes), generator=g)
    new = main + _values(main.numel(), g)
    grad = _values(main.numel(), g)
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    _plant(main, new, grad, offsets)
    split = lambda t: [piece.clone() for piece in t.split(sizes)]  # noqa: E731
    return ListGroup(split(main), split(grad), torch.bfloat16, [f"p{i}" for i in range(len(SHAPES))]), split(new)


def _states(table: list[ps.ParamSlot], seed: int) -> list[list[ps.StateTensor]]:
    g = torch.Generator().manual_seed(seed)
    states = []
    for i, slot in enumerate(table):
        exp_avg = torch.randn(slot.length, generator=g)
        exp_avg_sq = torch.rand(slot.length, generator=g)
        exp_avg_sq[torch.rand(slot.length, generator=g) < 0.3] = 0.0
        if i == 1:
            exp_avg[0] = NAN
        if i == 4:
            exp_avg_sq[1] = INF
        states.append([ps.StateTensor("exp_avg", 0, exp_avg, True), ps.StateTensor("exp_avg_sq", 1, exp_avg_sq)])
    return states


def _rows(form: str, seed: int) -> tuple[list[ps.ParamSlot], list[list[float]], int]:
    """The rows of one step of ``form``'s group, and how many packs ran."""
    if form == "derived":
        group, news = _list(seed)
        snapshot = take_snapshot([group])
        for weight, new in zip(group.main_weights, news, strict=True):
            weight.copy_(new)
    else:
        group, new = _flat(form == "copy", seed)
        snapshot = take_snapshot([group])
        group.main_weight.copy_(new)
        if group.compute_weight is not group.main_weight:
            group.compute_weight.copy_(group.main_weight)
    table = ps.param_table([group])
    states = _states(table, seed)
    runs, _ = packed_stats.packs(segments(snapshot, [group], table, states))
    below = float(torch.finfo(torch.float16).tiny)
    rows = param_stats.local_rows(snapshot, [group], table, states, underflow_below=below).tolist()
    return table, rows, len(runs)


@pytest.mark.parametrize("form", ["main", "copy", "derived"])
def test_packed_rows_equal_each_parameters_own(monkeypatch, form: str) -> None:
    table, packed, runs = _rows(form, seed=11)
    assert runs >= 2, f"{form}: want the small parameters on either side of the large one packed, got {runs} packs"
    monkeypatch.setattr(packed_stats, "PACK_MAX_SEGMENT", 0)
    _, own, none = _rows(form, seed=11)
    assert none == 0, f"{form}: packing turned off, yet {none} packs ran"
    for slot, got, want in zip(table, packed, own, strict=True):
        exact = {k: v for k, v in enumerate(got) if k not in SUMS}
        want_exact = {k: v for k, v in enumerate(want) if k not in SUMS}
        differ = {k: (exact[k], want_exact[k]) for k in exact if str(exact[k]) != str(want_exact[k])}
        assert not differ, f"{form}, {slot.name}: slots (packed, own) that differ: {differ}"
        for k in SUMS:
            assert got[k] == pytest.approx(want[k], rel=1e-5, abs=1e-30, nan_ok=True), (
                f"{form}, {slot.name}: slot {k} packed {got[k]}, own {want[k]}"
            )
    flagged = packed[2]
    assert flagged[ps.MAIN_NAN] == 1 and flagged[ps.MAIN_INF] == 1 and flagged[ps.GRAD_INF] == 1, (
        f"{form}: the planted NaN/Inf of p2, counted by round 2 after a packed round 1: {flagged}"
    )
    assert any(row[ps.STATE_FLUSHED] for row in packed), f"{form}: no exp_avg_sq flushed counted"


def test_a_pack_holds_consecutive_small_parameters_of_one_kind() -> None:
    group, new = _flat(True, seed=3)
    snapshot = take_snapshot([group])
    table = ps.param_table([group])
    found = segments(snapshot, [group], table, None)
    runs, alone = packed_stats.packs(found)
    large = [i for i, s in enumerate(table) if s.length > packed_stats.PACK_MAX_SEGMENT]
    assert large == [6], f"want p6 the one parameter too large to pack, got {large}"
    assert runs == [[0, 1, 2, 3, 4, 5], [7, 8]], f"want the runs on either side of p6, got {runs}"
    assert alone == [6], f"want p6 alone, got {alone}"
