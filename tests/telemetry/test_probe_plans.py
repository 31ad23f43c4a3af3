"""How the lists a step checks are reduced (``probe_plans``): few calls a step, and still the name
of the parameter a NaN/Inf is in.

A flat buffer of several parameters (``fully_shard``'s main weights) is reduced once and read as
the parameter holding its first non-finite element; a list of small tensors on a CPU whose values
are read only as finite is copied into one buffer and reduced once, and told apart tensor by
tensor only where it held a NaN/Inf.
"""

from __future__ import annotations

import math
from unittest import mock

import pytest
import torch
from fsdp_patch.telemetry import semconv
from fsdp_patch.telemetry.diagnostics import probe_plans
from fsdp_patch.telemetry.diagnostics.probe_plans import CONCATENATED, EACH, LOCATED, ReductionPlan
from fsdp_patch.telemetry.diagnostics.probes import AFTER, BEFORE, POOL_LIST, POOL_WHERE, PreparedChecks, ProbeLog

WW = semconv.ORIGIN_WEIGHT_WRITE
SEGMENTS = [(0, "blocks.0.weight"), (6, "blocks.0.bias"), (8, "blocks.1.weight")]


def _read(prepared: PreparedChecks) -> list[tuple[str, bool, bool]]:
    log = ProbeLog()
    log.check_prepared(prepared)
    return [(c.probe.where, c.finite, c.nan) for c in log.read(log.stacked())]


def _flat(**writes: float) -> torch.Tensor:
    buffer = torch.arange(12, dtype=torch.float32)
    for place, value in writes.items():
        buffer[int(place.removeprefix("at"))] = value
    return buffer


@pytest.mark.parametrize(
    ("writes", "want"),
    [
        ({}, ("blocks", True, False)),
        ({"at7": math.nan}, ("blocks.0.bias", False, True)),
        ({"at11": math.inf}, ("blocks.1.weight", False, False)),
        ({"at2": -math.inf}, ("blocks.0.weight", False, False)),
        ({"at9": math.nan, "at3": math.inf}, ("blocks.1.weight", False, True)),  # the NaN is named
    ],
)
def test_a_flat_buffer_is_read_as_the_parameter_of_its_non_finite_element(writes, want) -> None:
    prepared = PreparedChecks(WW, [("blocks", _flat(**writes), BEFORE, "blocks")], [SEGMENTS], pooled=POOL_LIST)
    kinds = [plan.kind for plan in prepared.plans]
    assert kinds == [LOCATED], f"a flat buffer with segments: want one LOCATED plan, got {kinds}"
    got = _read(prepared)
    assert got == [want], f"writes {writes}: want {[want]}, got {got}"


def test_a_place_past_float32_integers_names_the_right_parameter() -> None:
    """An index above 2**24 (a shard of a large model) is kept in int64, not in the values' dtype."""
    size = 2**24 + 8
    buffer = torch.zeros(size, dtype=torch.float32)
    buffer[2**24 + 3] = math.nan
    segments = [(0, "first"), (2**24 + 1, "second"), (2**24 + 3, "third")]
    got = _read(PreparedChecks(WW, [("unit", buffer, BEFORE, "unit")], [segments]))
    assert got == [("third", False, True)], f"a NaN at 2**24 + 3: want it named 'third', got {got}"


def test_small_weights_on_a_cpu_are_reduced_by_one_call_and_told_apart_only_when_not_finite() -> None:
    tensors = [torch.full((4,), float(i + 1)) for i in range(5)]
    items = [(f"p{i}", t, BEFORE, "g") for i, t in enumerate(tensors)]
    prepared = PreparedChecks(WW, items, pooled=POOL_LIST)
    kinds = [plan.kind for plan in prepared.plans]
    assert kinds == [CONCATENATED], f"five small float32 tensors: want one CONCATENATED plan, got {kinds}"
    with mock.patch.object(torch, "aminmax", wraps=torch.aminmax) as aminmax:
        got = _read(prepared)
    assert aminmax.call_count == 1, f"all finite: want one aminmax over the list, got {aminmax.call_count}"
    assert got == [(f"p{i}", True, False) for i in range(5)], f"all finite: got {got}"
    tensors[3][2] = math.nan
    tensors[1][0] = math.inf
    got = _read(prepared)
    want = [("p0", True, False), ("p1", False, False), ("p2", True, False), ("p3", False, True), ("p4", True, False)]
    assert got == want, f"an Inf in p1 and a NaN in p3: want {want}, got {got}"


def test_the_staging_buffer_keeps_the_values_as_they_were_checked() -> None:
    """The tensors told apart are those the check copied, not the tensors as they are when read
    (a forward between may have spread the NaN to every weight)."""
    tensors = [torch.ones(3), torch.ones(3)]
    prepared = PreparedChecks(WW, [(f"p{i}", t, BEFORE, "g") for i, t in enumerate(tensors)], pooled=POOL_LIST)
    tensors[1][0] = math.nan
    log = ProbeLog()
    log.check_prepared(prepared)
    tensors[0][0] = math.nan  # after the check
    got = [(c.probe.where, c.nan) for c in log.read(log.stacked())]
    assert got == [("p0", False), ("p1", True)], f"want only p1 NaN as checked, got {got}"


def test_a_log_read_after_the_list_was_checked_again_tells_apart_its_own_values() -> None:
    """A log is read an iteration later, after the same list was checked again (FSDP2's reduced
    grads of the next backward): a NaN that the later check no longer sees is still told apart in
    the log that saw it, and a log read finite gives its buffer back for the next check."""
    grads = [torch.ones(3), torch.ones(3)]
    prepared = PreparedChecks(semconv.ORIGIN_REDUCE, [("unit", g, AFTER, "") for g in grads], pooled=POOL_LIST)
    grads[1][2] = math.nan
    earlier = ProbeLog()
    earlier.check_prepared(prepared)
    earlier_values = earlier.stacked()
    grads[1][2] = 1.0  # the next iteration's grads: finite
    later = ProbeLog()
    later.check_prepared(prepared)
    got = [(c.probe.where, c.nan) for c in earlier.read(earlier_values)]
    assert got == [("unit", False), ("unit", True)], f"the earlier log: want only its second grad NaN, got {got}"
    buffer = prepared.plans[0].staged
    later_values = later.stacked()
    assert all(c.finite for c in later.read(later_values)), "the later log: want every grad finite"
    later.release()
    again = ProbeLog()
    again.check_prepared(prepared)
    assert prepared.plans[0].staged is buffer, "a log read finite: want its staging buffer reused by the next check"
    got = [(c.probe.where, c.nan) for c in earlier.read(earlier_values)]
    assert got == [("unit", False), ("unit", True)], f"the log found NaN keeps its own buffer: got {got}"


def test_lists_read_for_their_values_are_not_concatenated() -> None:
    """Grads (their zeros are read: a zeroed group) keep a value per tensor, and large tensors on a
    CPU an aminmax each."""
    small = [torch.ones(4), torch.zeros(4)]
    plans = PreparedChecks(semconv.ORIGIN_REDUCE, [(f"g{i}", t, "", "") for i, t in enumerate(small)]).plans
    assert [p.kind for p in plans] == [EACH], f"grads: want EACH, got {[p.kind for p in plans]}"
    large = [torch.ones(probe_plans.CPU_SMALL_NUMEL * 4) for _ in range(3)]
    plan = ReductionPlan(large, frozenset(), concatenate=True)
    assert plan.kind == EACH, f"large CPU tensors: want EACH, got {plan.kind}"


def test_grads_pooled_by_place_read_exactly_place_by_place() -> None:
    """A unit's reduced grads pooled together: every unit reads its own least and greatest values
    (a unit whose grads are all 0 reads 0 beside one whose grads are not)."""
    grads = {"blocks.0": [torch.zeros(3), torch.zeros(2)], "blocks.1": [torch.full((3,), -2.0), torch.ones(2)]}
    items = [(where, g, "", "") for where, held in grads.items() for g in held]
    prepared = PreparedChecks(semconv.ORIGIN_REDUCE, items, pooled=POOL_WHERE)
    kinds = [plan.kind for plan in prepared.plans]
    assert kinds == [CONCATENATED, CONCATENATED], f"two units' grads: want a pool each, got {kinds}"
    log = ProbeLog()
    log.check_prepared(prepared)
    got = [(c.probe.where, c.low, c.high) for c in log.read(log.stacked())]
    want = [("blocks.0", 0.0, 0.0)] * 2 + [("blocks.1", -2.0, 1.0)] * 2
    assert got == want, f"want {want}, got {got}"


@pytest.mark.parametrize("with_scalar", [False, True], ids=["shaped", "with-0-d"])
def test_a_retargeted_list_is_read_as_a_new_list_of_the_same_tensors_would_be(with_scalar: bool) -> None:
    """FSDP2's grads are new tensors every iteration, of their own shapes (a transposed one among
    them): a plan retargeted to them reads each unit's values, and tells a NaN apart, exactly as a
    plan made for them would (copied flattened by ``_chunk_cat``; a 0-d tensor, which it does not
    take, flattened first)."""

    def grads(nan: bool) -> list[torch.Tensor]:
        made = [torch.full((2, 3), 2.0).t(), torch.full((4,), -1.0), torch.full((3, 2), 5.0), torch.zeros(2)]
        if with_scalar:
            made.append(torch.tensor(7.0))
        if nan:
            made[2][1, 0] = math.nan
        return made

    def items(tensors: list[torch.Tensor]) -> list[tuple[str, torch.Tensor, str, str]]:
        return [("blocks.0" if i < 2 else "blocks.1", t, AFTER, "") for i, t in enumerate(tensors)]

    def read(prepared: PreparedChecks) -> list[tuple[str, str, str, bool]]:
        log = ProbeLog()
        log.check_prepared(prepared)
        return [(c.probe.where, repr(c.low), repr(c.high), c.nan) for c in log.read(log.stacked())]

    retargeted = PreparedChecks(semconv.ORIGIN_REDUCE, items(grads(False)), pooled=POOL_WHERE)
    read(retargeted)
    for nan in (False, True):
        now = grads(nan)
        retargeted.retarget(now)
        got, want = read(retargeted), read(PreparedChecks(semconv.ORIGIN_REDUCE, items(now), pooled=POOL_WHERE))
        assert got == want, f"nan={nan}: retargeted read {got}, a new plan {want}"
    assert [plan.kind for plan in retargeted.plans] == [CONCATENATED, CONCATENATED], "want a pool per unit"
    nans = [where for where, _, _, nan in got if nan]
    assert nans == ["blocks.1"], f"want the NaN told apart in blocks.1's third grad only, got {nans}"


@pytest.mark.parametrize(
    ("writes", "want"), [({"at7": math.nan}, "blocks.0.bias"), ({"at9": -math.inf}, "blocks.1.weight")]
)
def test_small_flat_buffers_pooled_on_a_cpu_still_name_the_parameter(writes, want) -> None:
    """Two units' flat buffers, small enough to be copied into one staging buffer: the unit
    holding the NaN/Inf is told apart, and within it the parameter, from that copy."""
    other = [(0, "head.weight"), (10, "head.bias")]
    items = [("blocks", _flat(**writes), BEFORE, "blocks"), ("head", _flat(), BEFORE, "head")]
    prepared = PreparedChecks(WW, items, [SEGMENTS, other], pooled=POOL_LIST)
    kinds = [plan.kind for plan in prepared.plans]
    assert kinds == [CONCATENATED], f"two small flat buffers pooled: want one CONCATENATED plan, got {kinds}"
    got = _read(prepared)
    assert [where for where, _, _ in got] == [want, "head"], f"writes {writes}: want [{want!r}, 'head'], got {got}"
    assert [finite for _, finite, _ in got] == [False, True], f"only the first buffer is non-finite: got {got}"
