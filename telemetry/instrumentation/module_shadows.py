"""When the float32 shadow runs, and what it says: one adapted optimizer's shadowed iterations.

:class:`~.iterations.IterationWatch` owns one :class:`ModuleShadows`. A shadowed iteration is the
same span as an audited one (:mod:`.op_audits`: from the end of one optimizer step to the end of the
next), and its forwards run under :class:`~..diagnostics.module_shadow.ModuleShadow`: each leaf
module recomputed in float32 from the fp32 main weights on its own inputs. The second iteration is
shadowed, then every ``FSDP_PATCH_PRECISION_SHADOW_EVERY``-th; an escalated one is not (escalation
is a rank's own, and the shadow gathers each unit's main weights: every rank must shadow the same
iterations). What it found goes on the span of the step that ends the iteration: events
``fsdp.precision.shadow``, the ``FSDP_PATCH_PRECISION_TOP_K`` modules whose output differs most from
float32 in units of their dtype's rounding.

Process-wide while a shadowed iteration runs: forward hooks on the watched models' units and leaf
modules, all removed, exactly, when it ends and by :meth:`ModuleShadows.close`. One shadow runs at
a time in a process. A model with ``torch.compile``d modules is not shadowed.
"""

from __future__ import annotations

import logging

import torch
from opentelemetry.trace import Span
from opentelemetry.util.types import AttributeValue

from fsdp_patch.module.model_units import sharded_models

from .. import env, semconv
from ..diagnostics.module_shadow import ModuleCost, ModuleShadow
from .op_audits import compiled

__all__ = ["ModuleShadows", "abandon_running", "event_attributes"]

_logger = logging.getLogger(__name__)

_RUNNING: list[ModuleShadow] = []


class ModuleShadows:
    """The shadowed iterations of one optimizer (see the module).

    Args:
        optimizer: The adapted optimizer (its parameters find the models to shadow).
        every: The shadow's interval (``0``: off).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, every: int) -> None:
        self.every = every
        self._params = [p for group in optimizer.param_groups for p in group["params"]]
        self._shadow: ModuleShadow | None = None
        self._top_k = max(env.precision_top_k(), 1)

    @classmethod
    def from_environment(cls, optimizer: torch.optim.Optimizer, diagnostics_on: bool) -> ModuleShadows:
        return cls(optimizer, env.precision_shadow_every() if diagnostics_on else 0)

    def due(self, iteration: int) -> bool:
        """Whether iteration ``iteration`` (the one step ``iteration`` ends) is shadowed."""
        return self.every > 0 and (iteration == 2 or iteration % self.every == 0)

    @property
    def running(self) -> bool:
        return self._shadow is not None

    def start(self) -> None:
        """Shadow the iteration that starts now, unless another shadow runs."""
        if self._shadow is not None or _RUNNING:
            return
        models = sharded_models(self._params)
        if not models or any(compiled(model.root) for model in models):
            return
        shadow = ModuleShadow(models)
        shadow.start()
        _RUNNING.append(shadow)
        self._shadow = shadow

    def finish(self, step: int, span: Span | None, rank: int) -> list[ModuleCost]:
        """End the running shadow: its costliest modules go on ``span`` (that of step ``step``)."""
        shadow, self._shadow = self._shadow, None
        if shadow is None:
            return []
        _forget(shadow)
        costs = shadow.finish()
        if shadow.failed:
            _logger.debug("float32 shadow: the recompute could not run %s", shadow.failed)
        shown = costs[: self._top_k]
        if span is not None:
            for order, cost in enumerate(shown):
                span.add_event(semconv.EVENT_SHADOW, event_attributes(cost, step, rank, order))
        return shown

    def close(self) -> None:
        """Stop a running shadow without reading it (telemetry turned off, the optimizer gone)."""
        shadow, self._shadow = self._shadow, None
        if shadow is not None:
            _forget(shadow)
            shadow.stop()


def _forget(shadow: ModuleShadow) -> None:
    if shadow in _RUNNING:
        _RUNNING.remove(shadow)


def abandon_running() -> int:
    """Stop every shadow running in this process without reading it; returns how many there were."""
    running = list(_RUNNING)
    _RUNNING.clear()
    for shadow in running:
        shadow.stop()
    return len(running)


def event_attributes(cost: ModuleCost, step: int, rank: int, order: int) -> dict[str, AttributeValue]:
    """The attributes of one ``fsdp.precision.shadow`` event."""
    return {
        semconv.ATTR_STEP: step,
        semconv.ATTR_RANK: rank,
        semconv.ATTR_SHADOW_MODULE: cost.module,
        semconv.ATTR_SHADOW_MODULE_TYPE: cost.module_type,
        semconv.ATTR_SHADOW_DTYPE: str(cost.dtype).removeprefix("torch."),
        semconv.ATTR_SHADOW_ERROR: cost.error,
        semconv.ATTR_SHADOW_WEIGHT_ERROR: cost.weight_error,
        semconv.ATTR_SHADOW_ROUNDING: cost.rounding,
        semconv.ATTR_SHADOW_HEADROOM: cost.headroom,
        semconv.ATTR_SHADOW_UNDERFLOW: cost.underflow,
        semconv.ATTR_SHADOW_NONFINITE: cost.nonfinite,
        semconv.ATTR_SHADOW_ORDER: order,
    }
