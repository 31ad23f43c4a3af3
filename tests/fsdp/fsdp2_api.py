"""What the FSDP2 API tests share (``tests/fsdp/test_fsdp2_api_*.py``): each script there uses one
part of FSDP2's public API and trains on 2 ranks with ``fully_shard`` ("ours") and with torch's
FSDP2 (the control), which must agree.

A script is written once, against whichever ``fully_shard`` / ``MixedPrecisionPolicy`` it is
given (:class:`Api`), as a user migrating by changing one import would have it; what it observes
besides its losses and final weights (dtypes, what stayed gathered, hook calls) is compared too
(:func:`compare`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from tests.comparison import max_abs_difference
from tests.fsdp.pattern_models import Net, data, rows

WORLD_SIZE = 2
STEPS = 3
LR = 0.05
# fp32: the two reduce over ranks in different orders of rounding (FSDP2 pre- and post-divides on
# gloo, which has no averaging op), so final weights agree to float32 rounding after 3 steps.
FP32_TOL = 1e-5
BF16 = torch.bfloat16


@dataclasses.dataclass
class Api:
    """What a script imports: FSDP2's or ours."""

    impl: str
    fully_shard: Callable[..., nn.Module]
    policy: type

    @classmethod
    def of(cls, impl: str) -> Api:
        if impl == "ours":
            from fsdp_patch import MixedPrecisionPolicy, fully_shard

            return cls(impl, fully_shard, MixedPrecisionPolicy)
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        return cls(impl, fully_shard, MixedPrecisionPolicy)

    def shard(self, model: Net, **kwargs: Any) -> Net:
        for block in model.blocks:
            self.fully_shard(block, **kwargs)
        self.fully_shard(model, **kwargs)
        return model

    def optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
        if self.impl == "ours":
            from fsdp_patch.optimizer import fully_shard_optimizer

            fully_shard_optimizer(optimizer)
        return optimizer


def full_copy(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().float().clone()


def train(
    api: Api,
    model: Net,
    *,
    microbatches: int = 1,
    before_forward: Callable[[Net, int, int], None] | None = None,
    after_backward: Callable[[Net, int, int], None] | None = None,
    input_dtype: torch.dtype | None = None,
) -> dict[str, Any]:
    """SGD with momentum over ``STEPS`` steps of this rank's rows, ``microbatches`` per step
    (gradient sync on the last only); the callbacks run around each microbatch."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    optimizer = api.optimizer(model)
    losses = []
    for step, (x, y) in enumerate(data(STEPS)):
        x, y = rows(x, rank, world_size), rows(y, rank, world_size)
        for micro, (xm, ym) in enumerate(zip(x.chunk(microbatches), y.chunk(microbatches), strict=True)):
            last = micro == microbatches - 1
            if microbatches > 1:
                model.set_requires_gradient_sync(last)
            if before_forward is not None:
                before_forward(model, step, micro)
            out = model(xm if input_dtype is None else xm.to(input_dtype))
            loss = F.mse_loss(out.float(), ym)
            loss.backward()
            if after_backward is not None:
                after_backward(model, step, micro)
            losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    return {"losses": losses, "params": {n: full_copy(p) for n, p in model.named_parameters()}}


def net(seed: int = 0, **options: Any) -> Net:
    torch.manual_seed(seed)
    return Net(norm=True, **options)


def compare(
    results: list[dict[str, Any]], fsdp2: list[dict[str, Any]], tol: float = FP32_TOL, facts: bool = True
) -> None:
    for rank, (got, want) in enumerate(zip(results, fsdp2, strict=True)):
        diff, where = max_abs_difference(got["params"], want["params"])
        assert diff <= tol, f"rank {rank}: final weights differ from FSDP2's by {diff:.3g} at {where} (tolerance {tol})"
        losses = max(abs(a - b) for a, b in zip(got["losses"], want["losses"], strict=True))
        assert losses <= max(tol, 1e-5) * 10, f"rank {rank}: losses {got['losses']} against FSDP2's {want['losses']}"
        if facts:
            assert got.get("facts") == want.get("facts"), (
                f"rank {rank}: observed {got.get('facts')}, FSDP2 {want.get('facts')}"
            )


def both(run_once: Callable[..., list[Any]], fn: Callable[..., dict[str, Any]], *args: Any) -> tuple[list, list]:
    return run_once(WORLD_SIZE, fn, "ours", *args), run_once(WORLD_SIZE, fn, "fsdp2", *args)


class CountingAllGather:
    """A custom all-gather (FSDP2's ``AllGather`` interface) that counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, async_op: bool = False
    ) -> Any:
        self.calls += 1
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


class CountingReduceScatter:
    """A custom reduce-scatter (FSDP2's ``ReduceScatter`` interface) that counts its calls."""

    def __init__(self) -> None:
        self.calls = 0
        self.ops: set[str] = set()

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any, async_op: bool = False
    ) -> Any:
        self.calls += 1
        self.ops.add(str(op))
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
