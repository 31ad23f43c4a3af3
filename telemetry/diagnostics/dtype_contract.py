"""The dtype contract of an adapted optimizer's tensors, audited without reading an element.

No OpenTelemetry here: :func:`audit_dtypes` returns plain :class:`ContractViolation` records,
which :mod:`fsdp_patch.telemetry.instrumentation.observer` names once each as span events and a
counter, at the first step, after every optimizer state load and on every diagnosed step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import semconv


@dataclass(frozen=True)
class ContractViolation:
    """A tensor whose dtype the contract does not expect.

    Attributes:
        param: The parameter's fully qualified name (or its place in the param groups).
        unit: Its unit (``""``: root, or not sharded).
        tensor: ``main_weight``, ``main_grad`` or ``optimizer_state``.
        state_key: The state key for optimizer state.
        expected: The dtype the contract expects.
        actual: The tensor's dtype.
    """

    param: str
    unit: str
    tensor: str
    state_key: str | None
    expected: torch.dtype
    actual: torch.dtype

    @property
    def key(self) -> tuple[str, str, str | None, torch.dtype]:
        return (self.param, self.tensor, self.state_key, self.actual)


_LOW_PRECISION = (torch.bfloat16, torch.float16)


def parameter_names(optimizer: torch.optim.Optimizer) -> dict[int, tuple[str, str]]:
    """``id(param) -> (name, unit)`` of every parameter of ``optimizer``: fully qualified names of
    ``fully_shard``'s and FSDP2's parameters, ``param_groups[g]['params'][i]`` for the others."""
    from fsdp_patch.module.model_units import group_prefix, user_name
    from fsdp_patch.module.shard_module import unit_name_of
    from fsdp_patch.sharding import parameter_group_of
    from fsdp_patch.torch_interop.fsdp2 import fsdp2_groups

    names: dict[int, tuple[str, str]] = {}
    plain = []
    for g, group in enumerate(optimizer.param_groups):
        for i, param in enumerate(group["params"]):
            owner = parameter_group_of(param)
            if owner is not None:
                prefix = group_prefix(owner)
                names[id(param)] = (
                    user_name(prefix, owner.names[owner.index_of(param)]),
                    user_name(prefix, unit_name_of(owner)),
                )
            else:
                names[id(param)] = (f"param_groups[{g}]['params'][{i}]", "")
                plain.append(param)
    for fsdp2 in fsdp2_groups(plain):
        prefix = group_prefix(fsdp2)
        for param, name in zip(fsdp2.members, fsdp2.names, strict=True):
            if id(param) in names:
                names[id(param)] = (user_name(prefix, name), user_name(prefix, fsdp2.unit_name))
    return names


def audit_dtypes(optimizer: torch.optim.Optimizer) -> list[ContractViolation]:
    """Every dtype the contract does not expect, without reading an element.

    The contract: a ``fully_shard`` parameter's main weight in its group's main dtype and its
    grad in the advertised main-grad dtype (``grad_dtype``); an FSDP2 parameter's main weight
    never bfloat16/float16 (the optimizer would update low-precision weights; float32 is named
    as expected), its grad in its own dtype; every optimizer state tensor (not ``step``) in its
    parameter's dtype.
    """
    from fsdp_patch.sharding import parameter_group_of
    from fsdp_patch.torch_interop.fsdp2 import fsdp2_groups

    found: list[tuple[torch.Tensor, str, str | None, torch.dtype, torch.dtype]] = []
    plain = []

    def add(param: torch.Tensor, tensor: str, key: str | None, expected: torch.dtype, actual: torch.dtype) -> None:
        if expected != actual:
            found.append((param, tensor, key, expected, actual))

    for group in optimizer.param_groups:
        for param in group["params"]:
            owner = parameter_group_of(param)
            if owner is not None:
                add(param, semconv.TENSOR_MAIN_WEIGHT, None, owner.main_dtype, param.dtype)
                if param.grad is not None:
                    add(param, semconv.TENSOR_MAIN_GRAD, None, owner.grads_dtype, param.grad.dtype)
            else:
                plain.append(param)
            for key, value in optimizer.state.get(param, {}).items():
                if torch.is_tensor(value) and value.is_floating_point() and value.dim() > 0:
                    add(param, semconv.TENSOR_OPTIMIZER_STATE, key, param.dtype, value.dtype)
    for fsdp2 in fsdp2_groups(plain) if plain else ():
        for param in fsdp2.params:
            if param.dtype in _LOW_PRECISION:
                add(param, semconv.TENSOR_MAIN_WEIGHT, None, torch.float32, param.dtype)
            if param.grad is not None:
                add(param, semconv.TENSOR_MAIN_GRAD, None, param.dtype, param.grad.dtype)
    if not found:
        return []
    names = parameter_names(optimizer)  # only now: it walks FSDP2's module states
    return [
        ContractViolation(*names.get(id(param), ("?", "")), tensor, key, expected, actual)
        for param, tensor, key, expected, actual in found
    ]
