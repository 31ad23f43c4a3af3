"""The record of grads checked and not written since (``checked_grads``): what the step does not
check again."""

from __future__ import annotations

import torch
from fsdp_patch.telemetry.instrumentation.checked_grads import CheckedGrads


def test_grads_recorded_and_unwritten_are_not_written() -> None:
    grads = [torch.ones(3), torch.ones(2), torch.ones(4)]
    checked = CheckedGrads()
    checked.record(grads)
    got = checked.written(grads)
    assert got == [], f"every grad recorded and unwritten: want none written, got {got}"


def test_a_write_a_grad_not_recorded_and_a_new_tensor_are_each_written() -> None:
    grads = [torch.ones(3), torch.ones(2), torch.ones(4)]
    checked = CheckedGrads()
    checked.record(grads[:2])
    grads[1].mul_(2.0)  # written in place: its version moves
    got = checked.written(grads)
    assert got == [1, 2], f"want the written grad (1) and the one never recorded (2), got {got}"
    replaced = [grads[0], grads[0] * 1.0]  # a new tensor where a recorded one was
    got = checked.written(replaced)
    assert got == [1], f"a new tensor: want it written, got {got}"


def test_cleared_nothing_is_checked() -> None:
    grads = [torch.ones(3)]
    checked = CheckedGrads()
    checked.record(grads)
    checked.clear()
    got = checked.written(grads)
    assert got == [0], f"after clear: want the grad written (not checked), got {got}"


def test_a_parameters_grad_written_replaced_or_dropped_since_the_snapshot_has_moved() -> None:
    """The parameters' own grads as a backward left them (a write through a grad's DTensor moves
    its counter, not its shard's): a write, a new grad, a grad dropped each read as moved."""
    params = [torch.nn.Parameter(torch.ones(2)) for _ in range(3)]
    for p in params:
        p.grad = torch.ones(2)
    checked = CheckedGrads()
    assert not checked.moved(params), "no snapshot taken: want nothing moved"
    checked.snapshot(params)
    assert not checked.moved(params), "nothing written since the snapshot: want nothing moved"
    params[1].grad.mul_(2.0)
    assert checked.moved(params), "a grad written in place: want moved"
    checked.snapshot(params)
    params[2].grad = torch.ones(2)
    assert checked.moved(params), "a grad replaced by a new tensor: want moved"
    checked.snapshot(params)
    params[0].grad = None
    assert checked.moved(params), "a grad dropped: want moved"
    checked.clear()
    assert not checked.moved(params), "cleared: want no snapshot to compare with"
