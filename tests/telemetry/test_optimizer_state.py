"""The optimizer state tensors the diagnostics read per parameter, and when they are read anew."""

from __future__ import annotations

import torch
from fsdp_patch.telemetry.diagnostics import rows
from fsdp_patch.telemetry.diagnostics.optimizer_state import StateTensors


def _table(params: list[torch.nn.Parameter]) -> list[rows.ParamSlot]:
    return [rows.ParamSlot(f"p{i}", "", p, 0, i, 0, p.numel(), None, p.dtype) for i, p in enumerate(params)]


def _stepped_adamw() -> tuple[torch.optim.AdamW, list[torch.nn.Parameter]]:
    params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(5))]
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()
    return optimizer, params


def _storage(states: list[list[rows.StateTensor]]) -> list[list[tuple[str, int]]]:
    return [[(s.key, s.local.data_ptr()) for s in slot] for slot in states]


def test_state_tensors_read_each_floating_tensor_flattened_with_its_key() -> None:
    optimizer, params = _stepped_adamw()
    states, keys = StateTensors().read(optimizer, _table(params))
    assert keys == [("exp_avg", "exp_avg_sq")] * 2, f"keys {keys}"  # 'step' is 0-d: not read
    got = [[(s.key, s.index, tuple(s.local.shape), s.shows_in_weight) for s in slot] for slot in states]
    want = [
        [("exp_avg", 0, (12,), True), ("exp_avg_sq", 1, (12,), False)],
        [("exp_avg", 0, (5,), True), ("exp_avg_sq", 1, (5,), False)],
    ]
    assert got == want, f"want {want}, got {got}"
    exp_avg_sq = optimizer.state[params[0]]["exp_avg_sq"]
    assert torch.equal(states[0][1].local, exp_avg_sq.reshape(-1)), "the record views the state tensor itself"


def test_records_are_reused_while_the_state_holds_the_same_tensors_and_read_anew_after_a_load() -> None:
    optimizer, params = _stepped_adamw()
    table = _table(params)
    reader = StateTensors()
    first, _ = reader.read(optimizer, table)
    optimizer.step()  # updates the state in place
    second, _ = reader.read(optimizer, table)
    assert all(a is b for a, b in zip(first, second, strict=True)), "an in-place update keeps the records"

    optimizer.state[params[1]]["exp_avg_sq"] = torch.zeros(5)  # one tensor replaced by the user
    third, _ = reader.read(optimizer, table)
    assert third[0] is second[0], "the untouched slot keeps its records"
    got = third[1][1].local.data_ptr()
    want = optimizer.state[params[1]]["exp_avg_sq"].data_ptr()
    assert got == want, f"the replaced exp_avg_sq is read: record at {got:#x}, state tensor at {want:#x}"

    optimizer.load_state_dict(optimizer.state_dict())  # new state dicts and tensors
    fourth, _ = reader.read(optimizer, table)
    got_ptrs, want_ptrs = (
        _storage(fourth),
        [[(k, optimizer.state[p][k].data_ptr()) for k in ("exp_avg", "exp_avg_sq")] for p in params],
    )
    assert got_ptrs == want_ptrs, f"after load_state_dict: records at {got_ptrs}, state tensors at {want_ptrs}"
