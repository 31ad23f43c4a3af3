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
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from tests.comparison import max_abs_difference
from tests.fsdp import pattern_models

BF16 = torch.bfloat16
TOL = 1e-5
FP32_CONTENDERS = ("reference", "fsdp2", "ours")
BF16_CONTENDERS = ("fsdp2", "ours", "ours_per_gather")
batches = pattern_models.data


def world() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def make_net(**options: Any) -> pattern_models.Net:
    """The parity tests' model: the pattern tests' :class:`~tests.fsdp.pattern_models.Net` with a
    LayerNorm in front of each block's feed-forward."""
    return pattern_models.Net(norm=True, **options)


def shard(model: nn.Module, impl: str, precision: str, *, main_grads_dtype: torch.dtype | None = None) -> nn.Module:
    """Shards each block, then the root, as ``impl`` does (``reference``: left unsharded).

    bf16: ours gets the model in bf16 first (the compute dtype is the module's) with main grads
    in ``main_grads_dtype`` (bf16 by default); FSDP2 gets ``param_dtype=bf16`` and reduces in the
    same dtype as ours, its fp32 parameters holding the bf16 model's values.
    """
    return pattern_models.shard(
        model,  # type: ignore[arg-type]
        "ours" if impl.startswith("ours") else impl,
        dtype=BF16 if precision == "bf16" else None,
        main_grads_dtype=main_grads_dtype,
        reduce_dtype=main_grads_dtype,
        compute_copy="per_gather" if impl == "ours_per_gather" else "persistent",
    )


def build(
    impl: str, precision: str, seed: int = 0, net: pattern_models.NetOptions | None = None, **shard_kwargs: Any
) -> nn.Module:
    torch.manual_seed(seed)
    return shard(make_net(**(net or {})), impl, precision, **shard_kwargs)


def adapt(optimizer: torch.optim.Optimizer, impl: str, precision: str) -> torch.optim.Optimizer:
    """Ours in bf16 steps through the optimizer adapter (grads cast to the main weights' dtype)."""
    if impl.startswith("ours") and precision == "bf16":
        from fsdp_patch.optimizer import fully_shard_optimizer

        fully_shard_optimizer(optimizer)
    return optimizer


def my_rows(impl: str, x: torch.Tensor) -> torch.Tensor:
    """The rows ``impl`` sees on this rank: all of them for the reference."""
    return x if impl == "reference" else pattern_models.rows(x, *world())


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
