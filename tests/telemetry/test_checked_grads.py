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
