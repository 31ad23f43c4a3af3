"""Checks held until a batch of them runs (``ProbeLog.hold``/``flush``): each held tensor reads as
a check made at once would, in its place among the iteration's checks; a batch repeated in the
next iteration's log plans nothing new; a tensor written in place after it was held is not read as
what it holds now."""

from __future__ import annotations

import math
from unittest import mock

import torch
from fsdp_patch.telemetry import semconv
from fsdp_patch.telemetry.diagnostics import probes
from fsdp_patch.telemetry.diagnostics.probes import INPUT, ProbeLog

FWD, LOSS = semconv.ORIGIN_FORWARD, semconv.ORIGIN_LOSS


def _outputs() -> dict[str, torch.Tensor]:
    return {
        "": torch.tensor([0.5, -1.0]),
        "blocks.0": torch.tensor([[1.0, -3.0], [2.0, 0.0]]),
        "blocks.1": torch.tensor([math.nan, 4.0, -2.0]),
        "blocks.2": torch.tensor([7.0, math.inf], dtype=torch.bfloat16),
    }


def _read(log: ProbeLog) -> list[tuple[str, str, str, int, float, float]]:
    got = []
    for c in log.read(log.stacked()):
        p = c.probe
        got.append((p.stage, p.where, p.dtype, p.microbatch, c.low, c.high))
    return got


def _same(got: list[tuple], want: list[tuple]) -> bool:
    """Equal, NaN equal to NaN."""
    return len(got) == len(want) and all(str(g) == str(w) for g, w in zip(got, want, strict=True))


def test_held_checks_read_as_checks_made_at_once_in_their_place() -> None:
    outputs = _outputs()
    loss = torch.tensor(2.5)
    at_once = ProbeLog()
    at_once.check(FWD, "", outputs[""], INPUT)
    for where in ("blocks.0", "blocks.1"):
        at_once.check(FWD, where, outputs[where])
    at_once.check(LOSS, "loss", loss)
    at_once.microbatch = 1
    at_once.check(FWD, "blocks.2", outputs["blocks.2"])
    want = _read(at_once)

    held = ProbeLog()
    held.hold(FWD, "", outputs[""], INPUT)
    for where in ("blocks.0", "blocks.1"):
        held.hold(FWD, where, outputs[where])
    written = held.flush()
    held.check(LOSS, "loss", loss)
    held.microbatch = 1
    held.hold(FWD, "blocks.2", outputs["blocks.2"])  # flushed by stacked()
    got = _read(held)
    assert written == [], f"nothing written in place: want no places back from flush, got {written}"
    assert _same(got, want), f"held checks: want them read as checks made at once\n  want {want}\n  got  {got}"


def test_a_check_made_at_once_between_holds_keeps_the_order_they_ran_in() -> None:
    log = ProbeLog()
    log.hold(FWD, "blocks.0", torch.ones(2))
    log.check(FWD, "blocks.0.fc", torch.ones(2))  # a check made at once (an escalated module's)
    log.hold(FWD, "blocks.1", torch.ones(2))
    got = [c.probe.where for c in log.read(log.stacked())]
    want = ["blocks.0", "blocks.0.fc", "blocks.1"]
    assert got == want, f"want the order the checks ran in {want}, got {got}"


def test_a_batch_repeated_in_the_next_log_plans_nothing_new() -> None:
    first = ProbeLog()
    for where, tensor in _outputs().items():
        first.hold(FWD, where, tensor)
    first.flush()
    nxt = ProbeLog(first.held_plans)
    with mock.patch.object(probes, "PreparedChecks", wraps=probes.PreparedChecks) as prepared:
        for where, tensor in _outputs().items():
            nxt.hold(FWD, where, tensor * 2)
        nxt.flush()
    assert prepared.call_count == 0, f"the same batch again: want its plan reused, got {prepared.call_count} made"
    got = [(c.probe.where, c.high) for c in nxt.read(nxt.stacked())]
    assert got[0] == ("", 1.0) and got[2][0] == "blocks.1", f"want the new tensors' values read, got {got}"


def test_a_tensor_written_in_place_after_it_was_held_is_not_read_and_its_place_is_given_back() -> None:
    log = ProbeLog()
    first, second = torch.ones(3), torch.ones(3)
    log.hold(FWD, "blocks.0", first)
    log.hold(FWD, "blocks.1", second)
    first.mul_(math.nan)  # after the hook saw it: a NaN its unit did not make
    written = log.flush()
    got = [(c.probe.where, c.finite) for c in log.read(log.stacked())]
    assert written == ["blocks.0"], f"want the place written in place given back, got {written}"
    assert got == [("blocks.1", True)], f"want only the tensor as held read, got {got}"


def test_a_held_tensor_is_let_go_once_its_batch_is_reduced() -> None:
    """A forward's unit outputs are the model's activations: once checked, neither the log nor the
    batch's plan kept for the next forward keeps them alive."""
    import gc
    import weakref

    log = ProbeLog()
    output = torch.ones(4) * 2.0  # held as it is (a tensor that records no autograd)
    log.hold(FWD, "blocks.0", output)
    log.flush()
    ref = weakref.ref(output)
    del output
    gc.collect()
    assert ref() is None, "a held unit output is still referenced after its batch was reduced"
    got = [(c.probe.where, c.high) for c in log.read(log.stacked())]
    assert got == [("blocks.0", 2.0)], f"want its value read from the reduction, got {got}"


def test_a_batch_whose_every_tensor_was_written_in_place_reads_as_nothing() -> None:
    log = ProbeLog()
    output = torch.ones(2)
    log.hold(FWD, "blocks.0", output)
    output.add_(1.0)
    written = log.flush()
    log.check(LOSS, "loss", torch.tensor(1.0))
    got = [c.probe.where for c in log.read(log.stacked())]
    assert written == ["blocks.0"] and got == ["loss"], (
        f"want blocks.0 given back and only the loss read, got {written}, {got}"
    )
