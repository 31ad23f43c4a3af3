"""The sharding layers driven directly, below any module: a parameter group's grad accumulation
and presence (``MainGrads``) and its compute-copy refresh count, on 2 gloo ranks.

Backward is played by hand: grads are set on the group's unsharded parameters, then
``post_backward`` reduces them (average over ranks) and ``finalize_grads`` installs the sharded
grads. Values are small integers, so every sum and average is exact.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from fsdp_patch import MixedPrecisionPolicy, ParameterGroup

WORLD_SIZE = 2
SHAPES = ((3, 2), (5,))  # 3 and 5 rows: uneven on 2 ranks


def _group(dtype: torch.dtype = torch.float32, compute_copy: str = "persistent") -> ParameterGroup:
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randint(-4, 5, shape).to(dtype)) for shape in SHAPES]
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(compute_copy=compute_copy)  # type: ignore[arg-type]
    return ParameterGroup(params, ["a", "b"], mesh, policy, torch.device("cpu"))


def _backward(group: ParameterGroup, grads: list[torch.Tensor | None]) -> None:
    """One backward's grads (full shapes; ``None``: no grad on this rank), reduced and installed."""
    for param, grad in zip(group.unsharded_params, grads, strict=True):
        param.grad = None if grad is None else grad.clone()
    group.post_backward(sync=True)
    group.finalize_grads()


def _grad(group: ParameterGroup, index: int) -> torch.Tensor | None:
    grad = group.params[index].grad
    return None if grad is None else grad.full_tensor()  # type: ignore[union-attr]


def _ones(index: int, value: float) -> torch.Tensor:
    return torch.full(SHAPES[index], value)


def _assert_grad(group: ParameterGroup, index: int, want: torch.Tensor | None, what: str) -> None:
    got = _grad(group, index)
    if want is None or got is None:
        assert got is None and want is None, f"{what}: grad {got}, want {want}"
        return
    assert torch.equal(got, want), f"{what}: grad {got.tolist()}, want {want.tolist()}"


def dropped_grad_run() -> None:
    group = _group()
    _backward(group, [_ones(0, 1.0), _ones(1, 2.0)])
    group.params[0].grad = None  # dropped; its view is collected
    _backward(group, [_ones(0, 3.0), _ones(1, 4.0)])
    _assert_grad(group, 0, _ones(0, 3.0), "a grad set to None, then a backward")
    _assert_grad(group, 1, _ones(1, 6.0), "a grad kept, then a backward")


def kept_view_run() -> None:
    group = _group()
    _backward(group, [_ones(0, 1.0), _ones(1, 2.0)])
    held = group.params[0].grad
    group.params[0].grad = None  # dropped by the parameter, kept by the user
    _backward(group, [_ones(0, 3.0), _ones(1, 4.0)])
    got = held.full_tensor()  # type: ignore[union-attr]
    assert torch.equal(got, _ones(0, 1.0)), f"the grad a user kept was written: {got.tolist()}"
    _assert_grad(group, 0, _ones(0, 3.0), "a dropped grad the user kept, then a backward")
    _assert_grad(group, 1, _ones(1, 6.0), "a grad kept, then a backward")


def presence_run() -> None:
    rank = dist.get_rank()
    group = _group()
    _backward(group, [_ones(0, 2.0), None])
    _assert_grad(group, 1, None, "a parameter no rank produced a grad for")
    _assert_grad(group, 0, _ones(0, 2.0), "a parameter every rank produced a grad for")
    _backward(group, [_ones(0, 1.0), _ones(1, 4.0) if rank == 0 else None])
    _assert_grad(group, 1, _ones(1, 2.0), "a parameter only rank 0 produced a grad for: the ranks' average")
    _assert_grad(group, 0, _ones(0, 3.0), "a parameter with a grad, accumulated")
    group.params[1].grad = None
    _backward(group, [_ones(0, 1.0), None])
    _assert_grad(group, 1, None, "a parameter whose grad was dropped and that got none")
    _assert_grad(group, 0, _ones(0, 4.0), "a parameter with a grad, accumulated again")


def ownership_run() -> None:
    group = _group()
    _backward(group, [_ones(0, 1.0), _ones(1, 1.0)])
    assert group.main_grad_storage_bytes() > 0, "no main-grad memory after a backward"
    group.params[0].grad = None
    assert group.main_grad is not None, "the main grads were freed while a view was still a grad"
    group.params[1].grad = None
    assert group.main_grad is None, "the main grads outlived every grad view"


@pytest.mark.parametrize(
    "scenario", (dropped_grad_run, kept_view_run, presence_run, ownership_run), ids=lambda f: f.__name__
)
def test_main_grads(dist_pool: Any, scenario: Any) -> None:
    dist_pool(WORLD_SIZE).run(scenario)


def refresh_count_run(compute_copy: str) -> None:
    """A gather made before a refresh is not taken for current after it."""
    group = _group(torch.bfloat16, compute_copy)
    group.unshard()  # as an explicit FSDPModule.unshard() before an optimizer step
    with torch.no_grad():
        group.main_weight.mul_(2)  # the step
    group.refresh_compute_weight()  # the adapter's refresh after it
    group.invalidate_compute_copy()  # the next forward
    group.unshard()
    torch.manual_seed(0)
    for index, param in enumerate(group.unsharded_params):
        want = torch.randint(-4, 5, SHAPES[index]).to(torch.bfloat16) * 2
        assert torch.equal(param.detach(), want), f"{compute_copy}: unsharded {param.tolist()}, want {want.tolist()}"
    group.reshard()


@pytest.mark.parametrize("compute_copy", ("persistent", "per_gather"))
def test_refresh_makes_earlier_gathers_out_of_date(dist_pool: Any, compute_copy: str) -> None:
    dist_pool(WORLD_SIZE).run(refresh_count_run, compute_copy)
