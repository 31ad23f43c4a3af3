"""Opt-in attachment: a wrapt wrapper on the instance's ``step`` and ``zero_grad``.

Chosen when telemetry is on (``FSDP_PATCH_TELEMETRY=1``): wrapping the call, rather than
hooking before and after it, lets one span enclose the whole step, time each phase, and put
the original grads back in a ``finally`` when the optimizer's own update raises.

Composition with learning-rate schedulers: ``LRScheduler`` re-wraps ``optimizer.step`` by
binding ``optimizer.step.__func__`` to the optimizer. A plain bound wrapper would hand out the
class's raw function there and be silently bypassed, so the bound wrapper's ``__func__`` is
the unbound wrapper itself: re-binding it yields this wrapper again. A scheduler created
before the adaptation is wrapped as it stands, which keeps its ``_wrapped_by_lr_sched`` mark
visible through the proxy.
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol

import torch
import wrapt

from .closure import CastingClosure, replace_closure
from .step_core import StepCore, StepPlan, _MismatchError, find_closure

__all__ = ["WraptAttachment"]

_MISSING = object()


class _BoundMethodWrapper(wrapt.BoundFunctionWrapper):
    @property
    def __func__(self) -> Any:  # type: ignore[override]
        return self._self_parent


class _MethodWrapper(wrapt.FunctionWrapper):
    __bound_function_wrapper__ = _BoundMethodWrapper


class StepObserver(Protocol):
    """What the wrapt attachment reports to; ``telemetry.OptimizerObserver`` implements it."""

    def step(self, attributes: dict[str, Any]) -> Any: ...
    def phase(self, name: str) -> Any: ...
    def zero_grad(self, set_to_none: bool) -> Any: ...
    def record_cast(self, kind: str, source: torch.dtype, target: torch.dtype, nbytes: int) -> None: ...
    def record_mismatches(self, param_dtype: torch.dtype, grad_dtype: torch.dtype, action: str, count: int) -> None: ...
    def precision_due(self, step_number: int) -> bool: ...
    def precision_begin(self, groups: Any) -> Any: ...
    def precision_end(self, snapshot: Any, groups: Any) -> None: ...


class WraptAttachment:
    kind = "wrapt"

    def __init__(self, optimizer: torch.optim.Optimizer, core: StepCore, observer: StepObserver) -> None:
        self._core = core
        self._observer = observer
        self._active = True
        self._saved: dict[str, Any] = {}
        # Weakly: a bound wrapper holds the optimizer, and the adaptation registry holds us.
        self._installed: dict[str, weakref.ref[Any]] = {}
        bound_wrappers: dict[str, Any] = {}
        for name, wrapper in (("step", self._step), ("zero_grad", self._zero_grad)):
            previous = optimizer.__dict__.get(name, _MISSING)
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

    # ------------------------------------------------------------------ step
    def _step(self, wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not self._active:
            return wrapped(*args, **kwargs)
        core, observer = self._core, self._observer
        state: dict[str, Any] = {"cast_bytes": 0}
        with observer.step({"fsdp.precision_aware": core.precision_aware}) as scope:
            core.restore(carry_back=True)
            closure, positional = find_closure(args, kwargs)

            def remember(plan: StepPlan) -> None:
                # A closure may run several times per step (LBFGS): the first plan's mismatches
                # are this step's; every cast is counted.
                if "plan" not in state:
                    self._record_mismatches(plan)
                    scope.set_attribute("fsdp.params.count", plan.params_count)
                    scope.set_attribute("fsdp.groups.count", plan.groups_count)
                state["plan"] = plan

            def traced_cast(plan: StepPlan) -> int:
                with observer.phase("cast_grads"):
                    nbytes = core.cast(plan)
                for group, written in plan.cast_records:
                    if written:
                        observer.record_cast("grad", group.grads_dtype, group.main_dtype, written)
                state["cast_bytes"] += nbytes
                scope.set_attribute("fsdp.cast.bytes", state["cast_bytes"])
                return nbytes

            def traced_refresh(plan: StepPlan) -> int:
                return self._refresh(plan.groups)

            try:
                if closure is None:
                    plan = core.plan()
                    remember(plan)
                    traced_cast(plan)
                else:
                    casting = CastingClosure(closure, core, remember, traced_cast, traced_refresh)
                    args, kwargs = replace_closure(args, kwargs, casting, positional)
                # With a closure the grads do not exist yet; the groups are known all the same.
                groups = state["plan"].groups if "plan" in state else core.plan(check_grads=False).groups
                snapshot = None
                if observer.precision_due(scope.step_number):
                    snapshot = observer.precision_begin(groups)
                try:
                    with observer.phase("inner_step"):
                        out = wrapped(*args, **kwargs)
                finally:
                    with observer.phase("restore_grads"):
                        core.restore(carry_back=False)
            except _MismatchError as error:
                if "plan" not in state:
                    self._record_mismatches(error.plan)
                raise
            self._refresh(groups)
            if snapshot is not None:
                with observer.phase("precision"):
                    observer.precision_end(snapshot, groups)
        return out

    def _refresh(self, groups: Any) -> int:
        total = 0
        with self._observer.phase("refresh"):
            for group in groups:
                nbytes = group.refresh_compute_weight()
                if nbytes:
                    self._observer.record_cast("weight_refresh", group.main_dtype, group.compute_dtype, nbytes)
                total += nbytes
        return total

    def _record_mismatches(self, plan: StepPlan) -> None:
        for (param_dtype, grad_dtype, action), count in plan.mismatches.items():
            self._observer.record_mismatches(param_dtype, grad_dtype, action, count)

    # ------------------------------------------------------------------ zero_grad
    def _zero_grad(self, wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not self._active:
            return wrapped(*args, **kwargs)
        set_to_none = kwargs.get("set_to_none", args[0] if args else True)
        with self._observer.zero_grad(bool(set_to_none)):
            return wrapped(*args, **kwargs)

    def detach(self, optimizer: torch.optim.Optimizer) -> None:
        self._core.restore(carry_back=True)
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
