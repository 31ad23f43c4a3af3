"""Gathering and freeing as FSDP2 does them, under ``fully_shard``: ``unshard(async_op=True)``,
``reshard()`` by hand, ``set_reshard_after_forward`` and ``set_reshard_after_backward`` at run time,
``set_unshard_in_backward(False)``, and ``reshard_after_forward=<int>`` (4 ranks: re-gathered over
the smaller group, the argument read as FSDP2 reads it).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from tests.fsdp import pattern_models
from tests.fsdp.fsdp2_api import STEPS, Api, CountingAllGather, both, compare, full_copy, net, train
from tests.fsdp.pattern_models import Net, rows

# -- scripts (run on the ranks) -------------------------------------------------------------------


def unshard_async_script(impl: str, wait: bool) -> dict[str, Any]:
    """``unshard(async_op=True)`` on every unit before each forward, the handles waited for
    (``wait``) or left to the forward."""
    api = Api.of(impl)
    model = api.shard(net())
    handles: list[Any] = []

    def prefetch(model: Net, step: int, micro: int) -> None:
        for unit in (model, *model.blocks):
            handle = unit.unshard(async_op=True)
            handles.append(type(handle).__name__)
            if wait:
                handle.wait()

    result = train(api, model, before_forward=prefetch)
    result["facts"] = {"handle": handles[0], "handles": len(handles), "sync_returns": repr(model.unshard())}
    model.reshard()
    return result


def reshard_by_hand_script(impl: str) -> dict[str, Any]:
    """``reshard_after_forward=False`` on every unit, a forward with grad whose backward never
    runs, then ``reshard()`` on every unit: the module holds its sharded parameters again, and
    training goes on."""
    api = Api.of(impl)
    model = api.shard(net(), reshard_after_forward=False)
    model(torch.randn(2, pattern_models.IN))
    held_after_forward = sorted({type(p).__name__ for p in model.parameters()})
    for unit in (model, *model.blocks):
        unit.reshard()
    held_after_reshard = sorted({type(p).__name__ for p in model.parameters()})
    result = train(api, model)
    result["facts"] = {"after_forward": held_after_forward, "after_reshard": held_after_reshard}
    return result


def reshard_after_forward_setter_script(impl: str) -> dict[str, Any]:
    """``set_reshard_after_forward``: ``False`` on every unit keeps the blocks gathered after a
    forward; ``True`` frees every unit after forward, the root's too (whose default keeps them)."""
    api = Api.of(impl)
    model = api.shard(net())
    kinds = {}
    for setting in (False, True):
        model.set_reshard_after_forward(setting)
        out = model(torch.randn(2, pattern_models.IN))
        kinds[str(setting)] = {
            "block": sorted({type(p).__name__ for p in model.blocks[0].parameters()}),
            "root": sorted({type(p).__name__ for p in model.head.parameters()}),
        }
        out.sum().backward()
        model.zero_grad(set_to_none=True)
    result = train(api, model)
    try:
        model.set_reshard_after_forward(1)  # type: ignore[arg-type]
        refusal = "accepted"
    except ValueError as error:
        refusal = type(error).__name__
    result["facts"] = {"kinds": kinds, "non_bool": refusal}
    return result


def reshard_after_backward_script(impl: str) -> dict[str, Any]:
    """Gradient accumulation over 2 microbatches with ``set_reshard_after_backward(last)``: the
    blocks stay gathered between the microbatches without sync."""
    api = Api.of(impl)
    model = api.shard(net())
    gathered: list[bool] = []

    def before(model: Net, step: int, micro: int) -> None:
        model.set_reshard_after_backward(micro == 1)

    def after(model: Net, step: int, micro: int) -> None:
        gathered.append(_block_gathered(model.blocks[0], impl))

    result = train(api, model, microbatches=2, before_forward=before, after_backward=after)
    result["facts"] = {"gathered": gathered}
    return result


def _block_gathered(block: nn.Module, impl: str) -> bool:
    if impl == "ours":
        return any(group.unsharded_storage_bytes() > 0 for group in block.fsdp_parameter_groups)
    from fsdp_patch.torch_interop.torch_compat import fsdp2_state_param_groups

    return any(group.is_unsharded for group in fsdp2_state_param_groups(block._get_fsdp_state()))


class Embedded(nn.Module):
    """An embedding (its own unit) in front of the pattern model's layers: an embedding's weight
    grad reads the indices only, so its backward needs no all-gather."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, pattern_models.IN)
        self.net = Net(norm=True)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.net(self.embed(ids))


def unshard_in_backward_script(impl: str) -> dict[str, Any]:
    """``set_unshard_in_backward(False)`` on an embedding unit; the rest as usual."""
    api = Api.of(impl)
    torch.manual_seed(0)
    model = Embedded()
    api.fully_shard(model.embed)
    api.shard(model.net)
    api.fully_shard(model)
    model.embed.set_unshard_in_backward(False)
    optimizer = api.optimizer(model)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(STEPS):
        ids = rows(torch.randint(0, 10, (pattern_models.BATCH,), generator=gen), rank, world_size)
        target = rows(torch.randn(pattern_models.BATCH, pattern_models.OUT, generator=gen), rank, world_size)
        loss = F.mse_loss(model(ids), target)
        loss.backward()
        losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    return {"losses": losses, "params": {n: full_copy(p) for n, p in model.named_parameters()}}


# -- tests -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("wait", [True, False])
def test_unshard_async_op_returns_a_handle_and_trains_like_fsdp2(run_once, wait) -> None:
    ours, fsdp2 = both(run_once, unshard_async_script, wait)
    compare(ours, fsdp2, facts=False)
    assert ours[0]["facts"]["handles"] == fsdp2[0]["facts"]["handles"] == 3 * STEPS
    assert ours[0]["facts"]["handle"] == "UnshardHandle", ours[0]["facts"]
    assert ours[0]["facts"]["sync_returns"] == fsdp2[0]["facts"]["sync_returns"] == "None"


def test_reshard_puts_the_sharded_parameters_back_after_a_forward_that_kept_them(run_once) -> None:
    ours, fsdp2 = both(run_once, reshard_by_hand_script)
    compare(ours, fsdp2)
    facts = ours[0]["facts"]
    assert facts == {"after_forward": ["Parameter"], "after_reshard": ["DTensor"]}, f"ours: {facts}"


def test_set_reshard_after_forward_at_run_time(run_once) -> None:
    ours, fsdp2 = both(run_once, reshard_after_forward_setter_script)
    compare(ours, fsdp2)
    want = {
        "False": {"block": ["Parameter"], "root": ["Parameter"]},
        "True": {"block": ["DTensor"], "root": ["DTensor"]},
    }
    assert ours[0]["facts"] == {"kinds": want, "non_bool": "ValueError"}, ours[0]["facts"]


def test_set_reshard_after_backward_keeps_the_blocks_gathered_between_microbatches(run_once) -> None:
    ours, fsdp2 = both(run_once, reshard_after_backward_script)
    compare(ours, fsdp2)
    want = [True, False] * STEPS
    assert ours[0]["facts"]["gathered"] == want, f"want gathered after the first microbatch only: {ours[0]['facts']}"


def test_set_unshard_in_backward_false_on_an_embedding(run_once) -> None:
    ours, fsdp2 = both(run_once, unshard_in_backward_script)
    compare(ours, fsdp2)


# -- reshard_after_forward=<int>, 4 ranks -----------------------------------------------------------


class SizeRecordingAllGather(CountingAllGather):
    """A custom all-gather that notes the size of each group it gathers over."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, async_op: bool = False
    ) -> Any:
        self.sizes.append(dist.get_world_size(group))
        return super().__call__(output_tensor, input_tensor, group, async_op)


def reshard_to_group_script(impl: str) -> dict[str, Any]:
    """``reshard_after_forward=2`` on 4 ranks: after forward each block keeps half of its
    unsharded parameters, and backward re-gathers over 2 ranks."""
    api = Api.of(impl)
    model = api.shard(net(), reshard_after_forward=2)
    comm = SizeRecordingAllGather()
    for block in model.blocks:
        block.set_custom_all_gather(comm)
    kept: list[float] = []

    def after_forward_probe(model: Net, step: int, micro: int) -> None:
        if impl == "ours" and step == 0:
            out = model(torch.randn(2, pattern_models.IN))
            group = model.blocks[0].fsdp_parameter_groups[0]
            whole = group.layout.unsharded_numel * group.compute_weight.element_size()
            kept.append(group.unsharded_storage_bytes() / whole)
            kept.append(float(isinstance(model.blocks[0].ff.fc1.weight, DTensor)))
            out.sum().backward()
            model.zero_grad(set_to_none=True)

    result = train(api, model, before_forward=after_forward_probe)
    result["facts"] = {"kept": kept, "sizes": sorted(set(comm.sizes))}
    return result


def test_reshard_after_forward_int_regathers_over_the_smaller_group(run_once) -> None:
    ours, fsdp2 = run_once(4, reshard_to_group_script, "ours"), run_once(4, reshard_to_group_script, "fsdp2")
    compare(ours, fsdp2, facts=False)
    facts = ours[0]["facts"]
    # Half kept after forward, the sharded parameters registered; gathers over 4 (forward) and 2 (backward).
    assert facts == {"kept": [0.5, 1.0], "sizes": [2, 4]}, f"ours: {facts}"


def reshard_after_forward_arguments_script() -> dict[str, str]:
    from fsdp_patch import fully_shard

    got = {}
    for value in (3, 0, 2.5, 1, 4):
        model = net()
        try:
            fully_shard(model, reshard_after_forward=value)  # type: ignore[arg-type]
            state = model._fsdp_state
            to_group = any(group.unsharding.post_forward_group is not None for group in state.groups)
            got[repr(value)] = f"reshard {state.reshard_after_forward_setting}, to group {to_group}"
        except (ValueError, TypeError) as error:
            got[repr(value)] = type(error).__name__
    return got


def test_reshard_after_forward_int_is_read_as_fsdp2_reads_it(run_once) -> None:
    got = run_once(4, reshard_after_forward_arguments_script)[0]
    want = {
        "3": "ValueError",
        "0": "ValueError",
        "2.5": "TypeError",
        "1": "reshard False, to group False",
        "4": "reshard True, to group False",
    }
    assert got == want, f"want {want}, got {got}"
