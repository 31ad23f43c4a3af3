"""The adapted step, written once: plan, cast, (the optimizer's own step), restore, refresh.

The wrapt wrapper (:mod:`.wrapt_attachment`) encloses the optimizer's step between
:meth:`~StepSequence.begin` and :meth:`~StepSequence.end`, and calls ``end(completed=False)``
when the step raised. A step closure goes through the same sequence (see
:class:`~.closure.CastingClosure`). The sequence reports what it does to a
:class:`~.events.StepObserver` as typed events; with telemetry off that is a
:class:`~.events.NullObserver`, so no telemetry runs.

Order of one step: the first step checks the collective settings across ranks; grads a failed
step left cast are put back (keeping what the user did to them); the plan is made and reported
(a plain parameter with a mismatched grad stops the step here, before anything is cast); the
grads are cast; the optimizer steps; the original grads are put back; the compute weights of
every FSDP group the optimizer holds are refreshed; precision diagnostics run where due.

Alternatives considered:
    - A shared core of steps (plan, cast, restore, refresh) that each attachment sequences
      itself: the sequence is then written several times (the wrapper, closures, the refresh)
      and the copies drift apart. Here the wrapper only decides when ``begin`` and ``end`` run.
    - Telemetry calls inside the sequence behind ``if telemetry``: the sequence reports to an
      observer either way; the ``NullObserver`` makes no OpenTelemetry call.
"""

from __future__ import annotations

import operator
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from ..sharding import ParameterGroup
from ..torch_interop.profiling import around
from .closure import CastingClosure, find_closure, replace_closure
from .events import GroupCast, Phase, StepObserver, StepScope
from .grad_cast import GroupGradCast
from .settings_check import check_collective_settings
from .step_plan import OptimizerShape, StepPlan, plan_step

__all__ = ["StepSequence", "StepState"]

_GRAD = operator.attrgetter("grad")


@dataclass(eq=False)
class StepState:
    """One step between :meth:`StepSequence.begin` and :meth:`StepSequence.end`.

    Holds nothing that keeps grads alive, so that a step whose ``begin`` raised (and whose
    ``end`` never comes) holds no memory.
    """

    observer: StepObserver
    reported: bool = False
    snapshot: Any = None
    observed: list[Any] | None = None


class StepSequence:
    """Casts grads around an optimizer's step and refreshes compute weights after it.

    Args:
        optimizer: The adapted optimizer (held weakly: the adaptation registry holds the
            sequence and must not keep the optimizer alive).
        precision_aware: The optimizer takes mixed-precision grads as they are; skip casts.

    Raises:
        TypeError: A param group holds something that is not an ``nn.Parameter``.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, precision_aware: bool) -> None:
        self._optimizer_ref = weakref.ref(optimizer)
        self.precision_aware = precision_aware
        self._shape = OptimizerShape(optimizer, precision_aware)
        self._in_flight: list[GroupGradCast] = []
        self._settings_checked = False
        self._step: StepState | None = None
        # Whether cast buffers persist between steps; None: the device's default (see keep_cast_buffers).
        self._keep_setting: bool | None = None
        self._keep = self._default_keep()

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        optimizer = self._optimizer_ref()
        if optimizer is None:
            raise ReferenceError("the adapted optimizer has been garbage-collected")
        return optimizer

    def shape(self) -> OptimizerShape:
        """The optimizer's parameters sorted by kind, rebuilt when ``param_groups`` changed.

        Raises:
            TypeError: A param group holds something that is not an ``nn.Parameter``.
        """
        shape = self._shape
        optimizer = self.optimizer
        if not shape.matches(optimizer):
            self.restore(carry_back=True)
            new = OptimizerShape(optimizer, self.precision_aware, shape.casts_by_key())
            kept = {id(cast) for cast in new.casts}
            for cast in shape.casts:
                if id(cast) not in kept:
                    cast.release()
            self._shape = shape = new
            self._keep = self._default_keep() if self._keep_setting is None else self._keep_setting
        return shape

    # ------------------------------------------------------------------ the sequence
    def begin(
        self, observer: StepObserver, scope: StepScope, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Everything before the optimizer's own step; returns its ``args``/``kwargs`` (a
        closure among them is wrapped so that every call of it leaves cast grads).

        Args:
            observer: Receives the step's events.
            scope: The running step's scope (its number schedules the diagnostics).
            args: ``step``'s positional arguments after ``self``.
            kwargs: Its keyword arguments.

        Raises:
            TypeError: A param group holds a non-Parameter, or a plain parameter's grad dtype
                differs from its dtype (unless precision aware). Nothing is cast then.
            CollectiveSettingsError: At the first step, ranks disagree on telemetry settings.
        """
        if not self._settings_checked:
            self._settings_checked = True
            shape = self.shape()
            check_collective_settings([*shape.groups, *shape.fsdp2], observer.collective_settings)
        self.restore(carry_back=True)
        state = self._step = StepState(observer)
        closure, positional = find_closure(args, kwargs)
        if closure is None:
            self.prepare(state)
        else:
            args, kwargs = replace_closure(args, kwargs, CastingClosure(closure, self, state), positional)
        if observer.precision_due(scope.step_number):
            shape = self._shape
            state.observed = [*shape.groups, *shape.fsdp2]
            try:
                state.snapshot = observer.precision_begin(state.observed)
            except BaseException:
                self.end(completed=False)
                raise
        return args, kwargs

    def prepare(self, state: StepState) -> None:
        """Plans the step, reports the plan (the first one of the step) and casts the grads."""
        plan = plan_step(self.shape(), self.precision_aware)
        observer = state.observer
        if not state.reported:
            state.reported = True
            observer.step_planned(plan.planned)  # type: ignore[arg-type]
        if plan.rejection is not None:
            raise _MismatchError(plan.rejection)
        # Also when nothing is cast: every step has its phases.
        with around("step.cast_grads", observer.phase(Phase.CAST_GRADS)):
            written = self._cast(plan)
        for group, nbytes in written:
            if nbytes:
                observer.grads_cast(GroupCast(group.grads_dtype, group.main_dtype, nbytes))

    def _cast(self, plan: StepPlan) -> list[tuple[ParameterGroup, int]]:
        written: list[tuple[ParameterGroup, int]] = []
        try:
            for task in plan.casts:
                share = task.share
                group, cast = share.group, share.cast
                assert cast is not None
                if task.originals is None:
                    main_grad = group.adopt_foreign_grads(share.indices)
                    originals = list(map(_GRAD, share.params))
                    all_present = all(grad is not None for grad in originals)
                else:
                    held = group.main_grad
                    # A plan lists originals only for groups whose grads are views of the buffer.
                    assert held is not None
                    main_grad, originals, all_present = held, task.originals, task.all_present
                self._in_flight.append(cast)
                written.append((group, cast.cast(main_grad, originals, all_present, release=not self._keep)))
        except BaseException:
            self.restore(carry_back=False)
            raise
        return written

    def end(self, completed: bool) -> None:
        """Everything after the optimizer's own step: restore the grads; if the step
        ``completed``, refresh the compute weights and finish the diagnostics."""
        state, self._step = self._step, None
        # The wrapper calls end only after begin returned; a step re-entered from inside its own
        # update (a step hook calling step) has ended the shared state already.
        if state is None:  # pragma: no cover
            self.restore(carry_back=False)
            return
        observer = state.observer
        with around("step.restore_grads", observer.phase(Phase.RESTORE_GRADS)):
            self.restore(carry_back=False)
        if not self._keep:
            self.release_buffers()
        if not completed:
            return
        self.refresh(observer)
        if state.snapshot is not None and state.observed is not None:
            with around("step.precision", observer.phase(Phase.PRECISION)):
                observer.precision_end(state.snapshot, state.observed)

    def restore(self, carry_back: bool) -> None:
        """Puts every cast group's original grads back; safe to call at any time.

        Args:
            carry_back: Write the cast copies' current values back into the main grads (see
                :meth:`GroupGradCast.restore`). ``False`` right after an update, which reads
                grads only; ``True`` when repairing a step that raised.
        """
        while self._in_flight:
            cast = self._in_flight.pop()
            cast.restore(carry_back)
            if not self._keep:
                cast.release()  # now: the next group's restore allocates its main grads anew

    def refresh(self, observer: StepObserver) -> None:
        """Refreshes the compute copy of every FSDP group the optimizer holds (marks it stale,
        for ``compute_copy="per_gather"`` groups: every all-gather casts its own)."""
        with around("step.refresh", observer.phase(Phase.REFRESH)):
            for group in self._shape.groups:
                if group.compute_per_gather:
                    group.mark_weights_changed()
                    continue
                nbytes = group.refresh_compute_weight(after_step=True)
                if nbytes:
                    observer.weights_refreshed(GroupCast(group.main_dtype, group.compute_weight.dtype, nbytes))

    # ------------------------------------------------------------------ cast buffers
    def _default_keep(self) -> bool:
        # CPU: a fresh buffer costs page faults at every step, a kept one nothing. CUDA: the
        # caching allocator hands the same block back at once, and between steps it serves
        # activations instead. A per_gather compute copy asks for FSDP2's memory: freed.
        return all(
            cast.group.main_weight.device.type == "cpu" and not cast.group.compute_per_gather
            for cast in self._shape.casts
        )

    def keep_buffers(self, keep: bool | None) -> None:
        """Whether cast buffers persist between steps (``None``: the device's default)."""
        self._keep_setting = keep
        self._keep = self._default_keep() if keep is None else keep
        if not self._keep:
            self.release_buffers()

    def release_buffers(self) -> None:
        """Frees the memory of every cast buffer not in use (the next cast re-materializes it)."""
        for cast in self._shape.casts:
            cast.release()

    def buffer_bytes(self) -> int:
        return sum(cast.nbytes for cast in self._shape.casts)

    def detach(self) -> None:
        """Puts cast grads back and frees the cast buffers (the adaptation is being undone)."""
        self.restore(carry_back=True)
        self.release_buffers()


class _MismatchError(TypeError):
    """A rejected dtype mismatch (telemetry reports it as the public ``TypeError``)."""
