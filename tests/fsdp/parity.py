"""What a parity test needs on its ranks: the model, its three contenders, and comparisons that say
what they found.

A parity test trains one pattern with ``fully_shard`` ("ours"), with torch FSDP2 ("fsdp2", the
control) and, in fp32, with the unsharded model in one process ("reference", which sees every
row of each batch while the sharded contenders see their rank's rows; with equal slices the
ranks' averaged grads are the reference's). In bf16 (compute dtype bf16, fp32 main weights)
ours runs with both compute-copy lifetimes and is held to FSDP2 with the same dtypes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypedDict

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from tests.comparison import max_abs_difference

IN, DIM, HIDDEN, OUT = 6, 12, 20, 5  # OUT rows split (3, 2) on 2 ranks, (2, 2, 1, 0) on 4
BATCH = 8  # rows per step, divisible by 1, 2 and 4 ranks
BF16 = torch.bfloat16
TOL = 1e-5
FP32_CONTENDERS = ("reference", "fsdp2", "ours")
BF16_CONTENDERS = ("fsdp2", "ours", "ours_per_gather")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(self.norm(x))))


class NetOptions(TypedDict, total=False):
    """Keyword arguments of :class:`Net`."""

    spare: bool
    aux: bool


class Net(nn.Module):
    """Input layer, two residual blocks (each its own unit), head (in the root unit).

    Args:
        spare: Adds ``spare``, a root parameter no forward uses.
        aux: Adds ``aux``, a second head that a forward uses only when asked to.
    """

    def __init__(self, spare: bool = False, aux: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(IN, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(DIM, OUT)
        self.spare = nn.Parameter(torch.randn(3, DIM)) if spare else None
        self.aux = nn.Linear(DIM, OUT) if aux else None

    def forward(self, x: torch.Tensor, use_aux: bool = False) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for block in self.blocks:
            h = block(h)
        out = self.head(h)
        if use_aux:
            assert self.aux is not None
            out = out + self.aux(h)
        return out


def world() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def shard(model: nn.Module, impl: str, precision: str, *, main_grads_dtype: torch.dtype | None = None) -> nn.Module:
    """Shards each block, then the root, as ``impl`` does (``reference``: left unsharded).

    bf16: ours gets ``model.bfloat16()`` first (the compute dtype is the module's) with main
    grads in ``main_grads_dtype`` (bf16 by default); FSDP2 gets ``param_dtype=bf16`` and
    reduces in the same dtype as ours, its fp32 parameters holding the bf16 model's values.
    """
    if impl == "reference":
        return model
    bf16 = precision == "bf16"
    if impl.startswith("ours"):
        from fsdp_patch import MixedPrecisionPolicy, fully_shard

        if bf16:
            model.bfloat16()
        policy = MixedPrecisionPolicy(
            main_grads_dtype=main_grads_dtype, compute_copy="per_gather" if impl == "ours_per_gather" else "persistent"
        )
        for block in model.blocks:  # type: ignore[union-attr]
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        return model
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    if bf16 and not any(p.is_meta for p in model.parameters()):
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(BF16))
    policy = TorchPolicy(param_dtype=BF16, reduce_dtype=main_grads_dtype or BF16) if bf16 else TorchPolicy()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:  # type: ignore[union-attr]
        torch_fully_shard(block, mesh=mesh, mp_policy=policy)
    torch_fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def build(impl: str, precision: str, seed: int = 0, net: NetOptions | None = None, **shard_kwargs: Any) -> nn.Module:
    torch.manual_seed(seed)
    return shard(Net(**(net or {})), impl, precision, **shard_kwargs)


def adapt(optimizer: torch.optim.Optimizer, impl: str, precision: str) -> torch.optim.Optimizer:
    """Ours in bf16 steps through the optimizer adapter (grads cast to the main weights' dtype)."""
    if impl.startswith("ours") and precision == "bf16":
        from fsdp_patch.optimizer import fully_shard_optimizer

        fully_shard_optimizer(optimizer)
    return optimizer


def batches(steps: int, seed: int = 5) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(BATCH, IN, generator=gen), torch.randn(BATCH, OUT, generator=gen)) for _ in range(steps)]


def my_rows(impl: str, x: torch.Tensor) -> torch.Tensor:
    """The rows ``impl`` sees on this rank: all of them for the reference."""
    if impl == "reference":
        return x
    rank, world_size = world()
    per = x.shape[0] // world_size
    return x[rank * per : (rank + 1) * per]


def loss_of(
    model: nn.Module, impl: str, precision: str, x: torch.Tensor, y: torch.Tensor, **forward: Any
) -> torch.Tensor:
    x, y = my_rows(impl, x), my_rows(impl, y)
    if impl.startswith("ours") and precision == "bf16":
        x = x.to(BF16)  # FSDP2 casts forward inputs to its param_dtype itself
    return F.mse_loss(model(x, **forward).float(), y)


def global_loss(loss: torch.Tensor, impl: str) -> float:
    """The loss over all rows of the batch: the ranks' mean (each rank's loss is over its rows)."""
    value = loss.detach().float().reshape(1).clone()
    if impl != "reference":
        dist.all_reduce(value)
        value /= dist.get_world_size()
    return value.item()


def full(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """The whole value (a collective for a DTensor), detached, on the CPU."""
    if tensor is None:
        return None
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: full(p).float() for name, p in model.named_parameters()}  # type: ignore[union-attr]


def full_grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {name: full(p.grad) for name, p in model.named_parameters()}


def assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str, tol: float = TOL) -> None:
    diff, where = max_abs_difference(got, want)
    assert diff <= tol, f"{what}: differs by {diff:.3g} (worst at {where}), tolerance {tol}"


def assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    diff, where = max_abs_difference(got, want)
    assert diff == 0.0, f"{what}: differs by {diff:.3g} (worst at {where}); expected bitwise equal"


def assert_parity(results: dict[str, Any], precision: str, what: str, key: str = "params", tol: float = TOL) -> None:
    """fp32: FSDP2 (the control, first: if it fails the test is wrong) and ours within ``tol``
    of the reference; bf16: each ours bitwise equal to FSDP2."""
    if precision == "fp32":
        for impl in ("fsdp2", "ours"):
            assert_close(
                results[impl][key], results["reference"][key], f"{what}, {impl} against the unsharded model", tol
            )
    else:
        for impl in ("ours", "ours_per_gather"):
            assert_equal(results[impl][key], results["fsdp2"][key], f"{what}, {impl} (bf16) against FSDP2 (bf16)")


def contenders(precision: str) -> tuple[str, ...]:
    return FP32_CONTENDERS if precision == "fp32" else BF16_CONTENDERS


def run_contenders(
    train: Callable[[str], dict[str, Any]], precision: str, impls: Iterable[str] | None = None
) -> dict[str, Any]:
    """``train(impl)`` for each contender of ``precision``, in order."""
    return {impl: train(impl) for impl in (impls or contenders(precision))}
