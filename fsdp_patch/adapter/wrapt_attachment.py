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
from typing import Any

import torch
import wrapt

from ..fsdp2 import FSDP2Group, fsdp2_groups
from .closure import CastingClosure, replace_closure
from .events import GroupCast, Mismatch, Phase, StepObserver, StepPlanned
from .settings_check import check_collective_settings
from .step_core import StepCore, StepPlan, _MismatchError, find_closure

__all__ = ["WraptAttachment"]

_MISSING = object()


class _BoundMethodWrapper(wrapt.BoundFunctionWrapper):
    @property
    def __func__(self) -> Any:  # type: ignore[override]
        return self._self_parent


class _MethodWrapper(wrapt.FunctionWrapper):
    __bound_function_wrapper__ = _BoundMethodWrapper


class WraptAttachment:
    kind = "wrapt"

    def __init__(self, optimizer: torch.optim.Optimizer, core: StepCore, observer: StepObserver) -> None:
        self._core = core
        self._observer = observer
        self._active = True
        self._settings_checked = False
        self._fsdp2_key: tuple[int, ...] | None = None
        self._fsdp2: list[FSDP2Group] = []
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

    @property
    def observer(self) -> StepObserver:
        """The observer steps report to; replaced to turn telemetry on or off."""
        return self._observer

    @observer.setter
    def observer(self, observer: StepObserver) -> None:
        self._observer = observer

    # ------------------------------------------------------------------ step
    def _fsdp2_groups(self, optimizer: torch.optim.Optimizer) -> list[FSDP2Group]:
        # Parameters FSDP2 manages: nothing to cast or refresh, but telemetry observes them.
        # Cached on the identity of the parameters, so the lookup runs again only when they change.
        key = tuple(id(p) for group in optimizer.param_groups for p in group["params"])
        if key != self._fsdp2_key:
            self._fsdp2_key = key
            self._fsdp2 = fsdp2_groups(p for group in optimizer.param_groups for p in group["params"])
        return self._fsdp2

    def _planned(self, plan: StepPlan, fsdp2: list[FSDP2Group]) -> None:
        mismatches = tuple(
            Mismatch(param_dtype, grad_dtype, action, count)
            for (param_dtype, grad_dtype, action), count in plan.mismatches.items()
        )
        self._observer.step_planned(StepPlanned(plan.params_count, len(plan.groups) + len(fsdp2), mismatches))

    def _step(self, wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not self._active:
            return wrapped(*args, **kwargs)
        core, observer = self._core, self._observer
        fsdp2 = self._fsdp2_groups(core.optimizer)
        planned: list[StepPlan] = []
        with observer.step() as scope:
            if not self._settings_checked:
                self._settings_checked = True
                check_collective_settings([*core.plan(check_grads=False).groups, *fsdp2], *observer.collective_settings)
            core.restore(carry_back=True)
            closure, positional = find_closure(args, kwargs)

            def remember(plan: StepPlan) -> None:
                # A closure may run several times per step (LBFGS): the first plan is this
                # step's; every cast and refresh is counted.
                if not planned:
                    self._planned(plan, fsdp2)
                planned.append(plan)

            def traced_cast(plan: StepPlan) -> int:
                with observer.phase(Phase.CAST_GRADS):
                    nbytes = core.cast(plan)
                for group, written in plan.cast_records:
                    if written:
                        observer.grads_cast(GroupCast(group.grads_dtype, group.main_dtype, written))
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
                groups = planned[0].groups if planned else core.plan(check_grads=False).groups
                observed = [*groups, *fsdp2]
                snapshot = None
                if observer.precision_due(scope.step_number):
                    snapshot = observer.precision_begin(observed)
                try:
                    with observer.phase(Phase.INNER_STEP):
                        out = wrapped(*args, **kwargs)
                finally:
                    with observer.phase(Phase.RESTORE_GRADS):
                        core.restore(carry_back=False)
            except _MismatchError as error:
                if not planned:
                    self._planned(error.plan, fsdp2)
                raise
            self._refresh(groups)
            if snapshot is not None:
                with observer.phase(Phase.PRECISION):
                    observer.precision_end(snapshot, observed)
        return out

    def _refresh(self, groups: Any) -> int:
        total = 0
        with self._observer.phase(Phase.REFRESH):
            for group in groups:
                nbytes = group.refresh_compute_weight()
                if nbytes:
                    self._observer.weights_refreshed(GroupCast(group.main_dtype, group.compute_dtype, nbytes))
                total += nbytes
        return total

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
