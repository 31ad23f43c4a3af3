"""The attachment: a wrapt wrapper on the instance's ``step`` and ``zero_grad``.

The same with telemetry on or off; only the observer differs (telemetry's, or a
:class:`~.events.NullObserver`). Wrapping the call, rather than hooking before and after it,
lets one span enclose the whole step, time each phase, and put the original grads back as an
exception raised by the optimizer's own update (or by a step hook) passes through.

Order with the user's own step hooks: torch runs them inside ``Optimizer.step``, so every
global and instance pre- and post-hook, registered before or after the adaptation, runs inside
the wrapper: all of them see the cast grads, and the post-hooks see the updated main weights
before their compute copy is refreshed.

Composition with learning-rate schedulers: ``LRScheduler`` re-wraps ``optimizer.step`` by
binding ``optimizer.step.__func__`` to the optimizer. A plain bound wrapper would hand out the
class's raw function there and be silently bypassed, so the bound wrapper's ``__func__`` is
the unbound wrapper itself: re-binding it yields this wrapper again. A scheduler created
before the adaptation is wrapped as it stands, which keeps its ``_wrapped_by_lr_sched`` mark
visible through the proxy.

Alternatives considered:
    - torch's per-instance step pre/post hooks (Megatron-FSDP's adapter design): they cannot
      enclose the update, so an exception raised by it (or by a hook registered after ours)
      leaves the cast grads on the parameters until something repairs them, and a span cannot
      enclose the step.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import wrapt

from ..torch_interop.profiling import around, label
from .events import NullObserver, Phase, StepObserver, StepScope
from .step_sequence import StepSequence

__all__ = ["WraptAttachment"]

_MISSING = object()


class _BoundMethodWrapper(wrapt.BoundFunctionWrapper):
    @property
    def __func__(self) -> Any:
        return self._self_parent


class _MethodWrapper(wrapt.FunctionWrapper):
    __bound_function_wrapper__ = _BoundMethodWrapper


class WraptAttachment:
    """Encloses the step sequence around the optimizer's own step, in the observer's step span."""

    def __init__(self, optimizer: torch.optim.Optimizer, sequence: StepSequence, observer: StepObserver) -> None:
        self._sequence = sequence
        self.observer = observer
        self._active = True
        self._saved: dict[str, Any] = {}
        # Weakly: a bound wrapper holds the optimizer, and the adaptation registry holds us.
        self._installed: dict[str, weakref.ref[Any]] = {}
        bound_wrappers: dict[str, Any] = {}
        for name, wrapper in (("step", self._step), ("zero_grad", self._zero_grad)):
            previous = optimizer.__dict__.get(name, _MISSING)
            bound: Any
            if previous is _MISSING:
                # Wrap the class's function and bind it, so __func__ re-binding keeps us.
                bound = _MethodWrapper(getattr(type(optimizer), name), wrapper).__get__(optimizer, type(optimizer))
            else:
                # Something (an LR scheduler) already replaced the method on the instance.
                bound = _MethodWrapper(previous, wrapper)
            self._saved[name] = previous
            self._installed[name] = weakref.ref(bound)
            bound_wrappers[name] = bound
        optimizer.__dict__.update(bound_wrappers)

    @property
    def observer(self) -> StepObserver:
        """The observer steps report to; replaced to turn telemetry on or off."""
        return self._observer

    @observer.setter
    def observer(self, observer: StepObserver) -> None:
        self._observer = observer
        # Telemetry off: no span to open and nothing to time, so the wrapper skips the step's
        # and the inner step's contexts (about 1 us of Python per step) and zero_grad's; the
        # sequence runs and reports to it like to any observer (no-ops). A subclass may
        # observe something: not skipped.
        self._null = observer if type(observer) is NullObserver else None

    # ------------------------------------------------------------------ step
    def _step(self, wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not self._active:
            return wrapped(*args, **kwargs)
        null = self._null
        if null is not None:
            return self._run(null, null.count_step(), False, wrapped, args, kwargs)
        observer = self._observer
        with observer.step() as scope:
            return self._run(observer, scope, True, wrapped, args, kwargs)

    def _run(
        self,
        observer: StepObserver,
        scope: StepScope,
        timed: bool,
        wrapped: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """The sequence around the optimizer's own step (in the ``INNER_STEP`` phase if ``timed``)."""
        sequence = self._sequence
        args, kwargs = sequence.begin(observer, scope, args, kwargs)
        try:
            if timed:
                with around("step.inner_step", observer.phase(Phase.INNER_STEP)):
                    out = wrapped(*args, **kwargs)
            else:
                with label("step.inner_step"):
                    out = wrapped(*args, **kwargs)
        except BaseException:
            sequence.end(completed=False)
            raise
        sequence.end(completed=True)
        return out

    # ------------------------------------------------------------------ zero_grad
    def _zero_grad(self, wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not self._active or self._null is not None:
            return wrapped(*args, **kwargs)
        set_to_none = kwargs.get("set_to_none", args[0] if args else True)
        with self._observer.zero_grad(bool(set_to_none)):
            return wrapped(*args, **kwargs)

    def detach(self, optimizer: torch.optim.Optimizer) -> None:
        self._active = False
        for name, previous in self._saved.items():
            installed = self._installed[name]()
            if installed is None or optimizer.__dict__.get(name) is not installed:
                # Someone wrapped our wrapper since (a scheduler): it stays, and ours passes through.
                continue
            if previous is _MISSING:
                del optimizer.__dict__[name]
            else:
                optimizer.__dict__[name] = previous
