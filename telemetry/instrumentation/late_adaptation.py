"""Optimizers whose parameters become FSDP-managed after construction, adapted before their first step.

The instrumentor adapts an optimizer when its construction ends, if ``fully_shard`` or torch
FSDP2 manage any of its parameters then. HF Accelerate's FSDP2 preparation (and the HF Trainer,
through it) builds the optimizer over the model's parameters *before* sharding, then swaps the
sharded parameters into its param groups in place; ``add_param_group`` after sharding does the
same with a new group. So while instrumented, an optimizer constructed over no FSDP-managed
parameter is *pending*: before each backward (``torch.autograd.backward``, which
``Tensor.backward`` calls) the pending optimizers are looked at again and those that hold
FSDP-managed parameters now are adapted, so that their first step is adapted and observed. The
backward is seen through the model watches' process-wide wrapper
(:func:`~.training_calls.listen_before_backward`): one wrapper on ``torch.autograd.backward``,
however many parts of telemetry need it, so that it comes off exactly whatever the order.

At its first step a pending optimizer stops being pending. If it holds FSDP-managed parameters
by then (its backward ran where the wrapper does not see it: ``torch.autograd.grad``), it is
adapted from its next step. Otherwise it is left alone, with one warning per process: when none
of its parameters has a gradient, the likely cause is an optimizer built before sharding, whose
parameters ``fully_shard`` or FSDP2 replaced and which therefore steps nothing the model trains
(FSDP2 does the same, silently); the fix is to build the optimizer after sharding.

The backward listener and the global step pre-hook exist only while an optimizer is pending (until
the first backward after none is), and both are removed then, or when the instrumentor is
uninstrumented.

Alternatives considered:
    - Adapting at the first step's pre-hook: the step is already running, so the adaptation's
      wrapper cannot enclose it; the first step (where set-up bugs show) would go unobserved.
    - A global module forward pre-hook: it runs at every module call of every model, and it
      interacts with ``torch.compile``'s guards; a backward is one call per iteration.
    - Hooking the param-group swap: Accelerate assigns to ``param_groups[i]["params"]`` of a
      plain dict, which offers no hook.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from .training_calls import listen_before_backward

__all__ = ["PendingOptimizers"]

_logger = logging.getLogger(__name__)


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _describe(optimizer: torch.optim.Optimizer) -> str:
    return f"{type(optimizer).__name__} over {len(_params(optimizer))} parameters"


class PendingOptimizers:
    """The optimizers constructed while instrumented over no FSDP-managed parameter (see the module).

    Args:
        managed: Whether ``fully_shard`` or FSDP2 manage any of an optimizer's parameters.
        adapt: Adapts an optimizer (with telemetry's observer).
    """

    def __init__(
        self, managed: Callable[[torch.optim.Optimizer], bool], adapt: Callable[[torch.optim.Optimizer], None]
    ) -> None:
        self._managed = managed
        self._adapt = adapt
        self._pending: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._unlisten: Callable[[], None] | None = None
        self._step_hook: RemovableHandle | None = None
        self._warned = False

    def add(self, optimizer: torch.optim.Optimizer) -> None:
        """Watch ``optimizer`` until its first step (installing the watch if none is running)."""
        self._pending.add(optimizer)
        if self._step_hook is None:
            self._step_hook = register_optimizer_step_pre_hook(self._before_step)
        if self._unlisten is None:
            self._unlisten = listen_before_backward(self._before_backward)

    def close(self) -> None:
        """Stop watching: the listener and the hook removed, nothing pending."""
        self._pending.clear()
        self._uninstall()

    def _uninstall(self) -> None:
        if self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None
        unlisten, self._unlisten = self._unlisten, None
        if unlisten is not None:
            unlisten()

    def _before_backward(self) -> None:
        ready = [optimizer for optimizer in list(self._pending) if self._managed(optimizer)]
        for optimizer in ready:
            self._pending.discard(optimizer)
            self._adapt(optimizer)  # its watches check this backward already (see listen_before_backward)
        if not self._pending:
            self._uninstall()  # after adapting: the shared wrapper stays for the adapted optimizer's watches

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if optimizer not in self._pending:
            return
        self._pending.discard(optimizer)
        if self._managed(optimizer):
            self._adapt(optimizer)
            _logger.warning(
                "fsdp_patch telemetry: %s was given FSDP-managed parameters after it was built and no backward "
                "(torch.autograd.backward) ran since; it is adapted and observed from its next step.",
                _describe(optimizer),
            )
        elif not any(p.grad is not None for p in _params(optimizer)):
            _logger.warning(
                "fsdp_patch telemetry: %s steps with no gradient on any of its parameters: they are not the "
                "parameters the model trains. An optimizer built before fully_shard (or torch FSDP2's "
                "fully_shard) keeps the parameters sharding replaced, and the model never trains; build the "
                "optimizer after sharding (over the sharded model's parameters()).",
                _describe(optimizer),
            )
        elif not self._warned:
            self._warned = True
            _logger.warning(
                "fsdp_patch telemetry: %s steps no parameter that fully_shard or torch FSDP2 manage; "
                "it is not instrumented.",
                _describe(optimizer),
            )
        # The hooks go at the next backward, or at close(): torch is iterating over the global
        # step hooks now, and removing one would change that dict while it does.
