"""``copy.deepcopy``, ``copy.copy`` and pickling of an adapted optimizer.

Semantics: a copy is a plain optimizer of the same class, not adapted (no wrapper,
``adaptation_of(copy) is None``), exactly what torch makes of any optimizer, whose
``__getstate__`` keeps only ``defaults``, ``state`` and ``param_groups``:

- ``copy.copy``: shares the parameters, state and param groups (torch's shallow copy);
- ``copy.deepcopy``: copies of the parameters (same values, ``requires_grad``, ``grad_dtype``
  and grad) and of the state; the copies are not FSDP-managed;
- pickling: the same copies, without grads (torch never pickles a parameter's grad).

Why the adapter takes part: ``Tensor.__deepcopy__`` assigns the copied grad before
``grad_dtype``, which a parameter whose grad dtype differs from its dtype refuses; and the
sharded parameters' local tensors are views into their group's flat buffer, which a copy or a
pickle of the parameter would carry whole. So the adapted optimizer carries instance-level
``__deepcopy__`` and ``__reduce_ex__`` (``copy`` and ``pickle`` look these up on the instance)
that substitute, for each sharded parameter, a DTensor parameter over a contiguous clone.
They hold the optimizer weakly, and the undo removes them.
"""

from __future__ import annotations

import copy
import weakref
from collections import defaultdict
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..sharding import parameter_group_of

__all__ = ["CopySupport"]

_NAMES = ("__deepcopy__", "__reduce_ex__")


def _copy_dtensor(tensor: DTensor) -> DTensor:
    local = tensor._local_tensor.detach().clone()
    return DTensor.from_local(
        local, tensor.device_mesh, tensor.placements, run_check=False, shape=tensor.shape, stride=tensor.stride()
    )


def _copy_param(param: nn.Parameter, with_grad: bool) -> nn.Parameter:
    copied = nn.Parameter(_copy_dtensor(cast(DTensor, param)), requires_grad=param.requires_grad)
    copied.grad_dtype = param.grad_dtype
    if with_grad and param.grad is not None:
        grad = param.grad
        copied.grad = _copy_dtensor(grad) if isinstance(grad, DTensor) else grad.detach().clone()
    return copied


def _sharded_params(optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
    seen: dict[int, nn.Parameter] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            if parameter_group_of(param) is not None:
                seen.setdefault(id(param), param)
    return list(seen.values())


def _deepcopy(optimizer_ref: weakref.ref[torch.optim.Optimizer], memo: dict[int, Any]) -> torch.optim.Optimizer:
    optimizer = optimizer_ref()
    assert optimizer is not None
    for param in _sharded_params(optimizer):
        if id(param) not in memo:
            memo[id(param)] = _copy_param(param, with_grad=True)
    cls = type(optimizer)
    result = cls.__new__(cls)
    memo[id(optimizer)] = result
    result.__setstate__(copy.deepcopy(optimizer.__getstate__(), memo))
    return result


class _PicklingState:
    """The optimizer's state for ``__reduce_ex__``: as is for ``copy.copy``, with the sharded
    parameters replaced by picklable copies when a pickler reduces it."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.state = optimizer.__getstate__()
        self.sharded = _sharded_params(optimizer)

    def __reduce__(self) -> tuple[Any, ...]:
        copies = {id(p): _copy_param(p, with_grad=False) for p in self.sharded}
        state = dict(self.state)
        state["state"] = defaultdict(dict, {copies.get(id(p), p): v for p, v in self.state["state"].items()})
        state["param_groups"] = [
            {**group, "params": [copies.get(id(p), p) for p in group["params"]]} for group in self.state["param_groups"]
        ]
        return (dict, (state,))


def _rebuild(cls: type[torch.optim.Optimizer], state: Any) -> torch.optim.Optimizer:
    if isinstance(state, _PicklingState):  # copy.copy: never pickled
        state = state.state
    result = cls.__new__(cls)
    result.__setstate__(state)
    return result


def _reduce_ex(optimizer_ref: weakref.ref[torch.optim.Optimizer], protocol: int) -> tuple[Any, ...]:
    optimizer = optimizer_ref()
    assert optimizer is not None
    return (_rebuild, (type(optimizer), _PicklingState(optimizer)))


class _Bound:
    """``fn(optimizer_ref, *args)`` as an instance attribute, without a reference cycle."""

    __slots__ = ("_fn", "_ref")

    def __init__(self, fn: Any, optimizer: torch.optim.Optimizer) -> None:
        self._fn = fn
        self._ref = weakref.ref(optimizer)

    def __call__(self, *args: Any) -> Any:
        return self._fn(self._ref, *args)


class CopySupport:
    """Installs (and removes) the instance-level copy and pickle support on one optimizer."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        clash = [name for name in _NAMES if name in optimizer.__dict__]
        if clash:
            raise ValueError(f"fully_shard_optimizer: the optimizer instance already defines {clash}")
        self._installed = {"__deepcopy__": _Bound(_deepcopy, optimizer), "__reduce_ex__": _Bound(_reduce_ex, optimizer)}
        optimizer.__dict__.update(self._installed)

    def detach(self, optimizer: torch.optim.Optimizer) -> None:
        for name, value in self._installed.items():
            if optimizer.__dict__.get(name) is value:
                del optimizer.__dict__[name]
