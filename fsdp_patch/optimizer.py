"""Optimizer adapter for the minimal Megatron-FSDP path.

``fully_shard_optimizer`` adapts an optimizer instance in place: around each ``step`` it casts
the grads of FSDP groups whose grad dtype differs from their main-weight dtype (one cast per
group buffer), runs the optimizer's own step, puts the original grads back, and refreshes the
compute copy of every group the optimizer touched.

Attachment: a wrapt wrapper on the instance's ``step`` and ``zero_grad``
(``adapter/wrapt_attachment.py``), telemetry on or off. The wrapper encloses the optimizer's
own step, so an exception raised inside it (by the update or by a step hook) passes through
after the original grads are back. What differs is the observer the step reports to, chosen by
the observer source registered in ``adapter.observer_source`` (telemetry's, following
``FSDP_PATCH_TELEMETRY`` and the telemetry instrumentor):

- unset, ``0``, ``false``, not instrumented: a ``NullObserver``; no OpenTelemetry call on the
  step, and with the variable unset nothing of ``fsdp_patch.telemetry`` imported.
- ``1``, ``true``, or ``FSDPOptimizerInstrumentor`` instrumented (``opentelemetry-instrument``):
  telemetry's observer, which emits spans and metrics (see the ``telemetry`` package). Both
  train bitwise identically.

Alternatives considered:
    - Monkey-patching ``step`` on the instance (chosen, through wrapt): it is the only
      attachment that encloses the step, so it can time it and restore grads as an exception
      passes; it is made to compose with LR schedulers, step hooks, copies and undo.
    - torch's step pre/post hooks (Megatron-FSDP's adapter design): an exception raised inside
      the update would leave the cast grads in place, and telemetry needs the wrapper anyway
      (a span encloses the step), so hooks would be a second attachment that fails differently.
    - Generating an FSDP-specific subclass per optimizer class: changes ``type(optimizer)``,
      which checkpoint and scheduler code inspects.
    - Casting from main-grad to main-weight dtype after the last microbatch (root
      post-backward): keeps an fp32 grad copy alive from backward to step.
    - Letting main weights and main grads share a dtype: enough for an FSDP2 drop-in, and then
      this adapter only refreshes.
"""

from __future__ import annotations

import torch

from .adapter import adapt_optimizer
from .adapter import init_optimizer_state as _init_optimizer_state
from .adapter.observer_source import registered_source

__all__ = ["fully_shard_optimizer", "init_optimizer_state"]


def fully_shard_optimizer(optimizer: torch.optim.Optimizer, *, precision_aware: bool = False) -> None:
    """Attach FSDP-aware step handling to an optimizer instance, in place.

    The adapted optimizer keeps its class, parameter groups and state. Calling this again with
    the same ``precision_aware`` does nothing (the observer it reports to stays; telemetry's
    instrumentor turns telemetry on and off on adapted optimizers);
    ``fsdp_patch.remove_fully_shard_optimizer`` undoes it.
    A copy (``copy.deepcopy``, pickling) is a plain, unadapted optimizer of the same class
    over copies of the parameters, which no FSDP group manages; ``copy.copy`` shares them.

    Args:
        optimizer: Optimizer instance to adapt in place.
        precision_aware: Whether the optimizer accepts FSDP's mixed-precision gradients without
            temporary casting. Compute weights are refreshed either way.

    Raises:
        TypeError: ``optimizer`` is not a ``torch.optim.Optimizer``, ``precision_aware`` is
            not a bool, or a param group holds something that is not an ``nn.Parameter``.
            Nothing is changed then.
        ValueError: ``FSDP_PATCH_TELEMETRY`` has an unaccepted value, the optimizer is
            already adapted with another ``precision_aware``, or it holds parameters that
            ``fully_shard`` replaced (it was built before sharding).
    """
    source = registered_source()
    factory = source.observer_factory(optimizer, precision_aware) if source is not None else None
    adapt_optimizer(optimizer, precision_aware=precision_aware, observer_factory=factory)


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Allocate optimizer state so a DCP load has DTensors to fill, neutrally.

    ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` initializes empty
    state through torch's ``_init_optim_state``, which assigns a parameter-dtype zero grad that
    a sharded parameter advertising a different ``grad_dtype`` rejects, and takes a real step
    that advances step counters and applies weight decay. This initializes the state with
    ``grad_dtype``-matched zero grads instead and undoes every side effect: parameters are
    bitwise unchanged and the next real step equals that of a never-initialized optimizer
    (state that no value makes neutral, such as SGD's momentum buffer under dampening, is
    dropped at that step if no load filled it in the meantime). A no-op once the state
    exists. A stateless optimizer (plain SGD) gets zero grads instead, so that torch's
    ``get_optimizer_state_dict`` finds grads and leaves the parameters alone.

    Args:
        optimizer: Optimizer whose (possibly empty) state should be materialized.

    Raises:
        TypeError: ``optimizer`` is not an Optimizer or holds a non-Parameter.
        NotImplementedError: ``optimizer`` is an LBFGS.
    """
    _init_optimizer_state(optimizer)
