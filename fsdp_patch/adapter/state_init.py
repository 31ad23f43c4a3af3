"""Neutral materialization of optimizer state, so a DCP load has tensors to fill.

torch's ``_init_optim_state`` (used by ``get_optimizer_state_dict``) assigns
``torch.zeros_like(param)`` as the grad, which a sharded parameter whose ``grad_dtype`` differs
from its dtype refuses, and then takes a real step with ``lr=0``: that advances step counters
and lets L2 weight decay leak into moment estimates. Here the synthetic step runs on zero grads
with weight decay off, bypassing every step hook and wrapper, and then everything it changed is
put back: parameters bitwise, grads, hyperparameters, and the state entries that a fresh
optimizer would hold at other values than the ones a zero-grad step leaves.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..sharding import ParameterGroup, parameter_group_of

__all__ = ["init_optimizer_state"]


def _reset_step(state: dict[str, Any], group: dict[str, Any]) -> None:
    if "step" in state:
        step = state["step"]
        if isinstance(step, torch.Tensor):
            step.zero_()
        else:
            state["step"] = type(step)(0)


def _reset_nadam(state: dict[str, Any], group: dict[str, Any]) -> None:
    if "mu_product" in state:
        state["mu_product"].fill_(1.0)


def _reset_adamax(state: dict[str, Any], group: dict[str, Any]) -> None:
    # A zero-grad step leaves exp_inf = eps; a fresh optimizer starts from zeros.
    if "exp_inf" in state:
        state["exp_inf"].zero_()


def _reset_rprop(state: dict[str, Any], group: dict[str, Any]) -> None:
    # A fresh optimizer fills step sizes with lr; the synthetic step clamps them into
    # [step_size_min, step_size_max] (torch's own _init_optim_state, stepping with lr=0,
    # even leaves them all at 0).
    if "step_size" in state:
        lr = group["lr"]
        state["step_size"].fill_(lr.item() if isinstance(lr, torch.Tensor) else lr)


def _reset_asgd(state: dict[str, Any], group: dict[str, Any]) -> None:
    if "eta" in state:
        lr = group["lr"]
        state["eta"].copy_(lr if isinstance(lr, torch.Tensor) else torch.as_tensor(lr))
    if "mu" in state:
        state["mu"].fill_(1.0)


# Entries a fresh optimizer holds at other values than a zero-grad step leaves behind. Moments
# and accumulators need nothing: a zero grad with weight decay off leaves them at zero.
_FRESH_STATE: list[tuple[type[torch.optim.Optimizer], Callable[[dict[str, Any], dict[str, Any]], None]]] = [
    (torch.optim.NAdam, _reset_nadam),
    (torch.optim.Adamax, _reset_adamax),
    (torch.optim.Rprop, _reset_rprop),
    (torch.optim.ASGD, _reset_asgd),
]


def _raw_step(optimizer: torch.optim.Optimizer) -> Callable[[torch.optim.Optimizer], Any]:
    step = type(optimizer).step
    # Optimizer wraps every subclass's step once to run hooks; the hook-free function is kept
    # as __wrapped__. A synthetic step must not reach user hooks, schedulers or telemetry.
    return getattr(step, "__wrapped__", step)


def _set_grad(param: torch.Tensor, grad: torch.Tensor | None, grad_dtype: torch.dtype | None) -> None:
    param.grad = None
    param.grad_dtype = grad_dtype
    param.grad = grad


def init_optimizer_state(optimizer: torch.optim.Optimizer, *, leave_zero_grads: bool = True) -> None:
    """Allocates optimizer state so a DCP load has DTensors to fill; changes nothing else.

    Afterwards the parameters are bitwise unchanged and the next real step gives bitwise the
    result an optimizer that was never initialized would give. A no-op once state exists.
    For a stateless optimizer (plain SGD), with ``leave_zero_grads``, ``grad_dtype``-matched
    zero grads are left on parameters that had none, so that torch's own initialization in
    ``get_optimizer_state_dict`` finds grads and stands aside; backward accumulates onto them.
    (Without it, the stateless optimizer is left as it was: what torch's initialization,
    which this stands in for, leaves too.)

    Raises:
        TypeError: ``optimizer`` is not a ``torch.optim.Optimizer`` or holds a non-Parameter.
        NotImplementedError: ``optimizer`` is an LBFGS, whose state is global to the
            optimizer (not per parameter) and whose step needs a closure.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"init_optimizer_state expected a torch.optim.Optimizer, got {type(optimizer)!r}")
    if isinstance(optimizer, torch.optim.LBFGS):
        raise NotImplementedError(
            "init_optimizer_state does not support LBFGS: its state is global, not per parameter, and its "
            "step needs a closure; load LBFGS state with optimizer.load_state_dict instead"
        )
    if optimizer.state:
        return
    params: list[nn.Parameter] = []
    for group_index, group in enumerate(optimizer.param_groups):
        for param_index, param in enumerate(group["params"]):
            if not isinstance(param, nn.Parameter):
                raise TypeError(
                    f"init_optimizer_state expected nn.Parameter values; param_groups[{group_index}]"
                    f"['params'][{param_index}] is {type(param).__name__}"
                )
            params.append(param)
    trainable = [p for p in params if p.requires_grad]

    fsdp_groups: dict[int, ParameterGroup] = {}
    for param in trainable:
        fsdp_group = parameter_group_of(param)
        if fsdp_group is not None:
            fsdp_groups.setdefault(id(fsdp_group), fsdp_group)
    saved_main = {key: fsdp_group.main_weight.clone() for key, fsdp_group in fsdp_groups.items()}
    saved_plain = {id(p): p.detach().clone() for p in trainable if parameter_group_of(p) is None}
    saved_grads = [(p, p.grad, p.grad_dtype) for p in trainable]
    saved_decay = [(pg, pg["weight_decay"]) for pg in optimizer.param_groups if "weight_decay" in pg]

    # The synthetic step bypasses the adapter's wrapper and the step hooks: the class's raw
    # step for most optimizers, and for a subclass whose step calls super().step() (which
    # runs the hooks) the instance's hook dicts emptied for the duration.
    hook_dicts: tuple[dict[int, Any], ...] = (optimizer._optimizer_step_pre_hooks, optimizer._optimizer_step_post_hooks)
    saved_hooks = [list(hooks.items()) for hooks in hook_dicts]
    try:
        for hooks in hook_dicts:
            hooks.clear()
        for param in trainable:
            _set_grad(param, torch.zeros_like(param), param.dtype)
        for pg, _ in saved_decay:
            pg["weight_decay"] = 0.0
        with torch.no_grad():
            _raw_step(optimizer)(optimizer)
    finally:
        for hooks, items in zip(hook_dicts, saved_hooks, strict=True):
            hooks.update(items)
        with torch.no_grad():
            for key, fsdp_group in fsdp_groups.items():
                fsdp_group.main_weight.copy_(saved_main[key])
            for param in trainable:
                if id(param) in saved_plain:
                    param.copy_(saved_plain[id(param)])
        for pg, decay in saved_decay:
            pg["weight_decay"] = decay
        for param, grad, grad_dtype in saved_grads:
            _set_grad(param, grad, grad_dtype)

    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param)
            if not state:
                continue
            _reset_step(state, group)
            for optimizer_type, reset in _FRESH_STATE:
                if isinstance(optimizer, optimizer_type):
                    reset(state, group)

    if not optimizer.state:
        if leave_zero_grads:
            _leave_zero_grads(trainable)
        return
    _ForgetUntouchedState.register(optimizer)


def _versions(value: torch.Tensor) -> tuple[int, int]:
    # DTensor ops bump the wrapper's counter; a DCP load writes through to_local(), which
    # bumps only the local tensor's.
    inner = value._local_tensor if isinstance(value, DTensor) else value
    return value._version, inner._version


class _ForgetUntouchedState:
    """One-shot step pre-hook: drops the state ``init_optimizer_state`` made if nothing filled it.

    Some state cannot be made neutral by resetting values: SGD's first step with momentum
    sets the buffer to the grad, a later one to ``momentum * buf + (1 - dampening) * grad``,
    so a zero buffer from the synthetic step changes the first update when dampening != 0.
    A checkpoint load replaces the state (``load_state_dict``) or writes into it (``dcp.load``);
    if neither happened before the first step, that step starts from empty state, exactly as
    on an optimizer that was never initialized.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self._entries: list[tuple[torch.Tensor, dict[str, Any], dict[str, tuple[Any, Any]]]] = [
            (
                param,
                state,
                {
                    key: (value, _versions(value) if isinstance(value, torch.Tensor) else None)
                    for key, value in state.items()
                },
            )
            for param, state in optimizer.state.items()
        ]
        self._handle: Any = None

    @classmethod
    def register(cls, optimizer: torch.optim.Optimizer) -> None:
        hook = cls(optimizer)
        hook._handle = optimizer.register_step_pre_hook(hook)

    def _untouched(self, optimizer: torch.optim.Optimizer) -> bool:
        if len(optimizer.state) != len(self._entries):
            return False
        for param, state, values in self._entries:
            if optimizer.state.get(param) is not state or state.keys() != values.keys():
                return False
            for key, (value, versions) in values.items():
                current = state[key]
                if current is not value:
                    return False
                if versions is not None and _versions(current) != versions:
                    return False
        return True

    def __call__(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._handle.remove()
        if self._untouched(optimizer):
            optimizer.state.clear()
        self._entries = []


def _leave_zero_grads(params: list[nn.Parameter]) -> None:
    for param in params:
        if param.grad is not None:
            continue
        group = parameter_group_of(param)
        if group is not None:
            group.install_zero_grads()
        else:
            dtype = param.grad_dtype if param.grad_dtype is not None else param.dtype
            param.grad = torch.zeros_like(param, dtype=dtype)
