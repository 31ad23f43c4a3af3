"""``FSDPOptimizerInstrumentor``: fsdp_patch's telemetry as an OpenTelemetry instrumentation.

``opentelemetry-instrument python train.py`` finds it through the entry point ``fsdp_patch`` of
the ``opentelemetry_instrumentor`` group (``pyproject.toml``) and calls ``instrument()`` after
the SDK configurator has installed the global providers from ``OTEL_*``. An application can do
the same itself::

    from fsdp_patch.telemetry import FSDPOptimizerInstrumentor

    FSDPOptimizerInstrumentor().instrument(tracer_provider=tp, meter_provider=mp)  # both optional

While instrumented:

* ``fully_shard_optimizer`` gives the optimizer telemetry's observer, as with ``FSDP_PATCH_TELEMETRY=1``;
* every optimizer constructed over parameters that ``fsdp_patch.fully_shard`` or torch FSDP2
  manage is adapted by the instrumentor itself (no code change), when its construction ends:
  the first point where its parameters are known and, unlike a global step pre-hook, one that
  lets the adaptation enclose its first step. One given such parameters later (HF Accelerate
  swaps the sharded parameters into its param groups; ``add_param_group``) is adapted before
  the first backward that follows, and one that steps parameters sharding replaced is warned
  about (:mod:`.late_adaptation`). A later ``fully_shard_optimizer`` call with other
  settings (``precision_aware=True``) replaces that adaptation;
* optimizers adapted while telemetry was off (before instrumenting, or since uninstrumenting)
  report to telemetry from their next step on.

``uninstrument()`` turns telemetry off on every adapted optimizer (the adaptation keeps
working: grads are still cast and compute weights refreshed), removes the wrapper on
``torch.optim.Optimizer.__init__`` (and the watch of pending optimizers), and shuts down the embedded default providers, taking their
``atexit`` hook, the ``destroy_process_group`` wrapper and the logging filters with them.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import Any

import torch
import wrapt
from opentelemetry.instrumentation.instrumentor import BaseInstrumentor  # type: ignore[attr-defined]  # the module opts out of mypy (a file-level ignore)

from fsdp_patch.adapter import NullObserver, adapt_optimizer, adaptation_of, adaptations
from fsdp_patch.sharding import parameter_group_of
from fsdp_patch.torch_interop.fsdp2 import fsdp2_groups

from ..export import providers
from . import activation
from .late_adaptation import PendingOptimizers

__all__ = ["FSDPOptimizerInstrumentor"]

_logger = logging.getLogger(__name__)

_INIT_MARK = "_self_fsdp_patch_instrumentor"


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def fsdp_managed(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``fsdp_patch.fully_shard`` or torch FSDP2 manage any of the optimizer's parameters."""
    params = _params(optimizer)
    return any(parameter_group_of(p) is not None for p in params) or bool(fsdp2_groups(params))


def _adapt(optimizer: torch.optim.Optimizer) -> None:
    if adaptation_of(optimizer) is None:
        adapt_optimizer(
            optimizer,
            precision_aware=False,
            observer_factory=lambda: activation.observer_for(optimizer, precision_aware=False),
            implicit=True,
        )


# Optimizers built over no FSDP-managed parameter yet, adapted once they hold some (HF Accelerate).
_pending = PendingOptimizers(fsdp_managed, _adapt)


def _adapt_after_init(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    result = wrapped(*args, **kwargs)
    if activation.instrumented is None:  # uninstrumented while another wrapper kept ours in place
        return result
    if isinstance(instance, torch.optim.Optimizer) and adaptation_of(instance) is None:
        if fsdp_managed(instance):
            _adapt(instance)
        else:
            _pending.add(instance)
    return result


class FSDPOptimizerInstrumentor(BaseInstrumentor):
    """OpenTelemetry instrumentor of the optimizer boundary of fsdp_patch and torch FSDP2 (see the module)."""

    def instrumentation_dependencies(self) -> Collection[str]:
        return ("torch >= 2.11",)

    def _instrument(self, **kwargs: Any) -> None:
        """Turn telemetry on; ``tracer_provider``/``meter_provider`` replace the global ones."""
        activation.instrumented = {
            "tracer_provider": kwargs.get("tracer_provider"),
            "meter_provider": kwargs.get("meter_provider"),
        }
        init = torch.optim.Optimizer.__dict__["__init__"]
        if not getattr(init, _INIT_MARK, False):
            wrapper = wrapt.FunctionWrapper(init, _adapt_after_init)
            setattr(wrapper, _INIT_MARK, True)
            torch.optim.Optimizer.__init__ = wrapper  # type: ignore[method-assign]
        for optimizer, adaptation in adaptations():
            observer = adaptation.observer
            if isinstance(observer, NullObserver):
                adaptation.observer = activation.observer_for(
                    optimizer, adaptation.precision_aware, observer.step_count
                )

    def _uninstrument(self, **kwargs: Any) -> None:
        """Turn telemetry off on every adapted optimizer and remove everything installed."""
        init = torch.optim.Optimizer.__dict__["__init__"]
        if getattr(init, _INIT_MARK, False):
            torch.optim.Optimizer.__init__ = init.__wrapped__  # type: ignore[method-assign]
        elif getattr(init, "__wrapped__", None) is not None:
            _logger.warning(
                "fsdp_patch telemetry: torch.optim.Optimizer.__init__ was wrapped again after instrumenting; "
                "leaving that wrapper (ours inside it no longer adapts optimizers)."
            )
        activation.instrumented = None
        _pending.close()
        for _, adaptation in adaptations():
            observer = adaptation.observer
            if not isinstance(observer, NullObserver):
                adaptation.observer = NullObserver(observer.step_count)
                close = getattr(observer, "close", None)
                if close is not None:  # its model checks and process-wide wrappers go with it
                    close()
        providers.uninstall()
