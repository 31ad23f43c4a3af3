"""What a step reports to its observer: typed events, no telemetry names.

The adapter tells an observer *what happened* (a step began with this plan, this FSDP group's
grads were cast, its compute weights refreshed, ...); the observer (``fsdp_patch.telemetry``)
decides how that becomes spans, attributes and metrics, whose names live in
``telemetry/semconv.py`` only. The step sequence (``step_sequence.py``) reports to an observer
at every step: telemetry's, or with telemetry off a :class:`NullObserver`.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch

__all__ = [
    "GroupCast",
    "Mismatch",
    "MismatchAction",
    "NullObserver",
    "Phase",
    "StepObserver",
    "StepPlanned",
    "StepScope",
]


class Phase(enum.Enum):
    """The parts of one adapted step, in the order they run."""

    CAST_GRADS = enum.auto()
    INNER_STEP = enum.auto()
    RESTORE_GRADS = enum.auto()
    REFRESH = enum.auto()
    PRECISION = enum.auto()


class MismatchAction(enum.Enum):
    """What the adapter did with a parameter whose grad dtype differs from its dtype."""

    CAST = enum.auto()
    PASSTHROUGH = enum.auto()
    REJECTED = enum.auto()


@dataclass(frozen=True)
class Mismatch:
    """``count`` parameters of one step with these dtypes, handled with ``action``."""

    param_dtype: torch.dtype
    grad_dtype: torch.dtype
    action: MismatchAction
    count: int


@dataclass(frozen=True)
class StepPlanned:
    """A step's plan, reported once per step before anything is cast, also for a step whose
    plan is rejected (its ``REJECTED`` mismatches are then followed by the step's exception).

    Attributes:
        params_count: Parameters in the optimizer's param groups.
        groups_count: FSDP parameter groups (``fully_shard``'s or torch FSDP2's) the step touches.
        mismatches: Parameters whose grad dtype differs from their dtype, by dtypes and action.
    """

    params_count: int
    groups_count: int
    mismatches: tuple[Mismatch, ...]


@dataclass(frozen=True)
class GroupCast:
    """One FSDP group's cast: its grads before the inner step, or its compute weights after it.

    Attributes:
        source: Dtype cast from.
        target: Dtype cast to.
        nbytes: Bytes written (the size of the cast's output).
    """

    source: torch.dtype
    target: torch.dtype
    nbytes: int


class StepScope(Protocol):
    """The running step, as :meth:`StepObserver.step` yields it."""

    @property
    def step_number(self) -> int:
        """1 for the optimizer's first step, counting up (the diagnostics schedule reads it)."""


class StepObserver(Protocol):
    """What a step sequence reports to; ``fsdp_patch.telemetry.OptimizerObserver`` implements it.

    Order within one ``optimizer.step()``: enter :meth:`step`; :meth:`step_planned` once;
    :meth:`phase` ``CAST_GRADS`` around the grad casts with :meth:`grads_cast` per group;
    ``INNER_STEP`` around the optimizer's own step; ``RESTORE_GRADS``; ``REFRESH`` with
    :meth:`weights_refreshed` per group; on steps where :meth:`precision_due` says so,
    :meth:`precision_begin` before ``INNER_STEP`` and :meth:`precision_end` inside ``PRECISION``
    after ``REFRESH``. A closure that runs several times (LBFGS) repeats the casts and refreshes
    inside ``INNER_STEP``. An exception leaves every context it passes through unchanged.
    """

    def step(self) -> AbstractContextManager[StepScope]: ...
    def phase(self, phase: Phase) -> AbstractContextManager[None]: ...
    def step_planned(self, event: StepPlanned) -> None: ...
    def grads_cast(self, event: GroupCast) -> None: ...
    def weights_refreshed(self, event: GroupCast) -> None: ...
    def zero_grad(self, set_to_none: bool) -> AbstractContextManager[None]: ...
    def precision_due(self, step_number: int) -> bool: ...
    def precision_begin(self, groups: Sequence[Any]) -> Any: ...
    def precision_end(self, snapshot: Any, groups: Sequence[Any]) -> None: ...
    @property
    def step_count(self) -> int:
        """Steps observed so far (a replacing observer continues from it)."""

    @property
    def collective_settings(self) -> tuple[bool | int, ...]:
        """``(telemetry on, diagnostics interval[, per-parameter detail])``: what every rank must
        agree on (see ``settings_check``)."""


class _NullScope:
    __slots__ = ("step_number",)

    def __init__(self, step_number: int) -> None:
        self.step_number = step_number


class _Nothing:
    """A reusable context manager that does nothing (cheaper than ``contextlib.nullcontext()`` per call)."""

    __slots__ = ("value",)

    def __init__(self, value: Any = None) -> None:
        self.value = value

    def __enter__(self) -> Any:
        return self.value

    def __exit__(self, *exc: object) -> None:
        return None


_NOTHING = _Nothing()


class NullObserver:
    """Observes nothing; counts steps so that a later observer continues the numbering.

    The observer of every optimizer adapted with telemetry off, and the one installed when
    telemetry is turned off (uninstrumented).

    Args:
        step_count: Steps already taken.
    """

    def __init__(self, step_count: int = 0) -> None:
        # One scope and one context, reused at every step: nothing is allocated per step.
        self._scope = _NullScope(step_count)
        self._stepping = _Nothing(self._scope)

    @property
    def step_count(self) -> int:
        return self._scope.step_number

    @property
    def collective_settings(self) -> tuple[bool, int]:
        return (False, 0)

    def count_step(self) -> StepScope:
        """Counts one step and returns its scope: :meth:`step` without the context, for a
        caller with nothing to enclose."""
        self._scope.step_number += 1
        return self._scope

    def step(self) -> AbstractContextManager[StepScope]:
        self.count_step()
        return self._stepping

    def phase(self, phase: Phase) -> AbstractContextManager[None]:
        return _NOTHING

    def zero_grad(self, set_to_none: bool) -> AbstractContextManager[None]:
        return _NOTHING

    def step_planned(self, event: StepPlanned) -> None:
        pass

    def grads_cast(self, event: GroupCast) -> None:
        pass

    def weights_refreshed(self, event: GroupCast) -> None:
        pass

    def precision_due(self, step_number: int) -> bool:
        return False

    def precision_begin(self, groups: Sequence[Any]) -> Any:
        return None

    def precision_end(self, snapshot: Any, groups: Sequence[Any]) -> None:
        pass
