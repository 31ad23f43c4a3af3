"""Methods other than ``forward`` as a unit's entry point (``model.encode(x)``, ``block.mix(h)``).

A unit gathers its parameters in its forward pre-hook and frees them in its forward hook, and
``nn.Module`` runs those hooks around ``forward`` only. :func:`register_fsdp_forward_method`
makes another method run the same hooks, as torch's function of the same name does for FSDP2.

torch's own ``torch.distributed.fsdp.register_fsdp_forward_method`` does nothing on a module
``fully_shard`` sharded: it acts only on instances of FSDP2's ``FSDPModule`` class and drives
FSDP2's private per-module state. This one takes the same arguments, acts on both kinds of
unit (an FSDP2 module is handed to torch's function) and, like torch's, does nothing on a
module neither sharded.

Alternatives considered:
    - Making every ``fully_shard`` module an instance of FSDP2's ``FSDPModule`` so that torch's
      function accepts it: torch's FSDP2 methods (``set_reshard_after_backward``,
      ``set_is_last_backward``, ``unshard(async_op=...)``, ...) and the code that calls them
      once it sees that class (pipelining schedules, FSDP2's memory tracker, ``torch.compile``'s
      guards on FSDP2 classes) would reach a state they do not know.
"""

from __future__ import annotations

import functools
from typing import Any

from torch import nn

from .fsdp_module import FSDPModule
from .training_state import TrainingState

__all__ = ["register_fsdp_forward_method"]

_MARK = "_fsdp_forward_method_of"


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Runs the unit's forward hooks around ``module.<method_name>``, as around ``forward``.

    The method then gathers the unit's parameters before it runs and frees them (or keeps them,
    by the unit's ``reshard_after_forward``) after it returns, and its output's backward
    reduces the grads, exactly as a call of the module would. A call made while the unit's
    forward is running already (``forward`` calling the method, or the method calling
    ``self(...)``) runs the method as is: the parameters are in place.

    Args:
        module: A module ``fully_shard`` (or torch's FSDP2 ``fully_shard``) was applied to;
            any other module is left as it is, so one script runs sharded or not.
        method_name: Name of the method to register.

    Raises:
        TypeError: ``method_name`` is not a string, or names a submodule or an attribute that
            is not callable.
        ValueError: ``module`` has no attribute ``method_name``.
    """
    if not isinstance(method_name, str):
        raise TypeError(f"register_fsdp_forward_method expected method_name to be a str, got {method_name!r}")
    if not isinstance(module, FSDPModule):
        from torch.distributed.fsdp import register_fsdp_forward_method as register_fsdp2

        register_fsdp2(module, method_name)  # FSDP2's own; a no-op on an unsharded module
        return
    if not hasattr(module, method_name):
        raise ValueError(f"register_fsdp_forward_method: {type(module).__name__} has no method {method_name!r}")
    method = getattr(module, method_name)
    if isinstance(method, nn.Module):
        raise TypeError(
            f"register_fsdp_forward_method: {type(module).__name__}.{method_name} is a submodule "
            f"({type(method).__name__}), not a method; shard it with fully_shard to make it a unit of its own"
        )
    if not callable(method):
        raise TypeError(
            f"register_fsdp_forward_method: {type(module).__name__}.{method_name} is a "
            f"{type(method).__name__}, not a method"
        )
    if getattr(method, _MARK, None) is module:
        return  # registered already
    state = module._fsdp_state

    @functools.wraps(method)
    def entry(*args: Any, **kwargs: Any) -> Any:
        if state.training_state is not TrainingState.IDLE:
            return method(*args, **kwargs)
        args, kwargs = state.pre_forward(module, args, kwargs)
        try:
            output = method(*args, **kwargs)
        except BaseException:
            state.abort_forward()
            raise
        return state.post_forward(module, args, output)

    setattr(entry, _MARK, module)
    setattr(module, method_name, entry)
