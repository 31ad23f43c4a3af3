"""Models made of many same-size parameters, for the adapter's own cost (cases 1 to 4).

One ``fully_shard`` unit on a world-size-1 mesh (no collective waits on another rank) holding
``count`` parameters of ``numel`` elements each, in the compute dtype; one backward leaves main
grads on every parameter, and the optimizers under test step them again and again.
"""

from __future__ import annotations

import torch
from torch import nn

from fsdp_patch import MixedPrecisionPolicy, fully_shard, parameter_groups

__all__ = ["NoStep", "PerTensorCast", "flat_copy_floor", "many_params"]


class _Many(nn.Module):
    def __init__(self, count: int, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.weights = nn.ParameterList(nn.Parameter(torch.randn(shape) * 0.01) for _ in range(count))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([w.sum() for w in self.weights]).sum() * x


def many_params(
    count: int,
    numel: int,
    device: torch.device,
    *,
    compute: torch.dtype = torch.bfloat16,
    grads: torch.dtype | None = None,
    variant: int = 0,
) -> nn.Module:
    """A sharded module of ``count`` parameters of ``numel`` elements with main grads on all.

    Args:
        count: Parameters.
        numel: Elements each.
        device: Where the shards live.
        compute: Compute dtype (the module's dtype before sharding); main weights are fp32.
        grads: Main-grad dtype (``None``: the compute dtype).
        variant: Give models measured side by side different variants: the parameters get
            ``variant`` leading dimensions of size 1 (same elements, same work). DTensor's
            sharding-propagation cache compares the specs of a call with those of the cached
            entry by ``__eq__`` (~0.6 µs each) unless they are the very same objects; two models
            with equal shapes share entries, and whichever ran second would pay ~1 µs per
            parameter per foreach op.
    """
    torch.manual_seed(0)
    model = _Many(count, (1,) * variant + (numel,)).to(device=device, dtype=compute)
    fully_shard(model, mp_policy=MixedPrecisionPolicy(main_grads_dtype=grads))
    model(torch.ones((), device=device, dtype=compute)).backward()
    return model


class NoStep(torch.optim.Optimizer):
    """An optimizer whose update does nothing: what is left of an adapted step is the adapter."""

    def __init__(self, params: object) -> None:
        super().__init__(params, {})

    def step(self, closure: object = None) -> None:  # type: ignore[override]
        return None


class PerTensorCast:
    """A per-tensor adapter done by hand: a cast, a restore and a refresh per tensor, around a step.

    Args:
        model: A module from :func:`many_params` with bf16 main grads.
        optimizer: An unadapted optimizer over its parameters.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.params = list(model.parameters())
        self.optimizer = optimizer
        groups = parameter_groups(model)
        self.refresh_pairs = [
            (layout.local_view(group.compute_weight), layout.local_view(group.main_weight))
            for group in groups
            for layout in group.layout.params
        ]

    def step(self) -> None:
        saved = []
        for param in self.params:
            grad = param.grad
            saved.append((param, grad, param.grad_dtype))
            param.grad = None
            param.grad_dtype = param.dtype
            param.grad = grad.to(param.dtype)
        try:
            self.optimizer.step()
        finally:
            for param, grad, grad_dtype in saved:
                param.grad = None
                param.grad_dtype = grad_dtype
                param.grad = grad
        with torch.no_grad():
            for compute, main in self.refresh_pairs:
                compute.copy_(main)


def flat_copy_floor(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(cast target, main grads, compute copy, main weights) of the module's one group: the
    floor of an adapted step is ``target.copy_(grads)`` then ``compute.copy_(main)``."""
    (group,) = parameter_groups(model)
    assert group.main_grad is not None
    target = torch.empty_like(group.main_grad, dtype=group.main_dtype)
    return target, group.main_grad, group.compute_weight, group.main_weight
