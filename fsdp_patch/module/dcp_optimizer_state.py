"""torch's ``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` on a fresh optimizer over
sharded parameters whose main grads have their own dtype.

Before a DCP load, torch's ``torch.distributed.checkpoint.state_dict`` makes the state of an
optimizer that has none through ``_init_optim_state``: it assigns ``torch.zeros_like(param)``
as every parameter's grad and takes a step with ``lr=0``. Under mixed precision a sharded
parameter's grad has the main-grad dtype, which the parameter advertises through
``Tensor.grad_dtype``, and autograd refuses a grad of the parameter's own dtype, so torch's path
fails ("attempting to assign a gradient with dtype 'float' to a tensor with grad_dtype
'BFloat16'") where FSDP2, whose grads have the parameter's dtype, needs nothing.

While a parameter group whose main grads differ in dtype from its main weights exists,
``_init_optim_state`` is wrapped (a :class:`~fsdp_patch.torch_interop.scoped_patch.ScopedPatch`, restored
exactly after the last such group): for an optimizer holding such parameters, in the cases where
torch's would make state (none yet, no grads), the state is made by
:func:`fsdp_patch.optimizer.init_optimizer_state`'s neutral initialization (a zero step with
``grad_dtype``-matched grads that leaves the parameters, step counters and moments as a fresh
optimizer has them); every other optimizer goes to torch's function. Calling
``init_optimizer_state`` first, as the API page asks, still works and is then not needed.

Alternatives considered:
    - Only adding a note naming ``init_optimizer_state`` to torch's error: the script that works
      under FSDP2 would still fail; the call the note would name is the one made here.
    - Assigning grads that torch's ``zeros_like`` would accept (``grad_dtype=None``): the main
      grads' dtype is the contract the parameters advertise, and a grad of another dtype would
      reach the optimizer adapter as a foreign grad.
    - Making the state at ``fully_shard_optimizer``: every run would pay a synthetic step and
      the optimizer's state memory at start-up, also when it never loads a checkpoint.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

import torch

from ..torch_interop.scoped_patch import ScopedPatch

__all__ = ["track_grad_dtype_mismatch"]


def _torch_state_dict_module() -> Any:
    return importlib.import_module("torch.distributed.checkpoint.state_dict")


def _grad_dtype_aware(original: Any) -> Any:
    @functools.wraps(original)
    def _init_optim_state(optim: torch.optim.Optimizer) -> None:
        if _needs_grad_dtype_matched_init(optim):
            from ..adapter.state_init import init_optimizer_state

            init_optimizer_state(optim, leave_zero_grads=False)
            return
        original(optim)

    return _init_optim_state


_PATCH = ScopedPatch(_torch_state_dict_module, "_init_optim_state", _grad_dtype_aware)


def track_grad_dtype_mismatch(group: object) -> None:
    """Keeps torch's optimizer-state initialization grad-dtype aware while ``group`` lives."""
    _PATCH.hold(group)


def _needs_grad_dtype_matched_init(optim: torch.optim.Optimizer) -> bool:
    """Whether torch's ``_init_optim_state`` would assign grads (no state, no grad yet) and one
    of them would be refused (a sharded parameter whose grad dtype is not its dtype)."""
    from ..sharding import parameter_group_of

    if optim.state:
        return False
    refused = False
    for param_group in optim.param_groups:
        for param in param_group["params"]:
            if param.grad is not None:
                return False  # torch's makes no state then either
            if not refused and param.requires_grad and parameter_group_of(param) is not None:
                refused = param.grad_dtype not in (None, param.dtype)
    return refused
