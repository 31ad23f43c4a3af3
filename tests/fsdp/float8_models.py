"""torchao float8 models for the all-gather extension tests, and the runs that train them.

A 3-layer MLP whose ``nn.Linear`` layers torchao's ``convert_to_float8_training`` swaps for
``Float8Linear`` (tensorwise scaling unless told otherwise, fp8 matmuls emulated: the CPU has
none), built in bf16, sharded layer by layer then at the root by ``fully_shard`` (fp32 main
weights, the adapter) or by torch's FSDP2 (fp32 parameters holding the bf16 values,
``param_dtype=bf16``) as the control. Its layers' row counts are :data:`EVEN` over 2 and 4 ranks
(FSDP2's float8 all-gather on gloo aborts on uneven shards: torchao's extension returns unpadded
inputs, and the ranks' sizes disagree) or :data:`UNEVEN`.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

BF16 = torch.bfloat16
IN = 32
EVEN = (40, 24, 8)  # each layer's rows: 2 and 4 ranks hold equal shards
UNEVEN = (41, 25, 10)  # 2 ranks: 21/20, 13/12, 5/5; 4 ranks: 11/11/11/8, 7/7/7/4, 3/3/3/1
BATCH = 16  # rows per step, divisible by 1, 2 and 4 ranks
STEPS = 3
LR = 0.1


def require_torchao() -> None:
    """Skips the calling test where torchao's float8 training does not import (torchao is a dev
    extra; a torch outside its range, as ``make test-torch`` runs, may not load it)."""
    try:
        import torchao.float8  # noqa: F401
    except Exception as exc:
        pytest.skip(f"torchao.float8 does not import here: {type(exc).__name__}: {exc}")


def float8_mlp(
    fp8_all_gather: bool, rows: tuple[int, int, int] = EVEN, seed: int = 0, config: Any = None
) -> nn.Sequential:
    """The MLP in bf16, its layers converted to ``Float8Linear`` with ``config`` (default:
    tensorwise, emulated, torchao's ``enable_fsdp_float8_all_gather`` as given)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(seed)
    hidden, middle, out = rows
    model = nn.Sequential(
        nn.Linear(IN, hidden), nn.GELU(), nn.Linear(hidden, middle), nn.GELU(), nn.Linear(middle, out)
    ).to(BF16)
    if config is None:
        config = Float8LinearConfig(emulate=True, enable_fsdp_float8_all_gather=fp8_all_gather)
    return convert_to_float8_training(model, config=config)


def linears(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, nn.Linear)]


def shard(
    model: nn.Sequential, impl: str, reshard_after_forward: bool | int | None = None, mesh: Any = None
) -> nn.Sequential:
    """Each linear layer a unit, then the root: ``fully_shard`` (``"ours"``, on ``mesh`` where
    given: HSDP's 2-D) or FSDP2."""
    if impl == "ours":
        from fsdp_patch import fully_shard

        for layer in linears(model):
            fully_shard(layer, reshard_after_forward=reshard_after_forward, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model.float()  # fp32 parameters holding the bf16 model's values, as ours' main weights start
    policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=BF16)
    for layer in linears(model):
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def batches(out: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(BATCH, IN, generator=generator), torch.randn(BATCH, out, generator=generator))
        for _ in range(STEPS)
    ]


def my_rows(x: torch.Tensor) -> torch.Tensor:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    return x.chunk(world_size)[rank]


def train(model: nn.Module, impl: str) -> dict[str, Any]:
    """STEPS SGD steps on this rank's rows (adapted for ``fully_shard``): this rank's loss of
    each step and the full fp32 parameters at the end (a :class:`~tests.fsdp.training_runs.Run`).
    SGD: an update proportional to the grad, so that float8 rounding shows in the parameters in
    proportion (Adam's normalized update turns a small grad's rounding into a whole step)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    if impl == "ours":
        from fsdp_patch.optimizer import fully_shard_optimizer

        fully_shard_optimizer(optimizer)
    losses = []
    for x, y in batches(linears(model)[-1].out_features):
        loss = F.mse_loss(model(my_rows(x).to(BF16)).float(), my_rows(y))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    params = {name: param.full_tensor().detach().float() for name, param in model.named_parameters()}
    return {"losses": losses, "params": params}
