"""The one core both attachments share: validate, cast grads, step, restore, refresh.

The core never decides *when* it runs; an attachment (torch's step hooks, or a wrapt wrapper)
calls :meth:`StepCore.plan`, :meth:`StepCore.cast`, :meth:`StepCore.restore` and
:meth:`StepCore.refresh` around the optimizer's own step.
"""

from __future__ import annotations

import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..parameter_group import ParameterGroup, parameter_group_of
from .events import MismatchAction

__all__ = ["StepCore", "StepPlan", "MismatchKey"]

MismatchKey = tuple[torch.dtype, torch.dtype, MismatchAction]


@dataclass
class StepPlan:
    """What one optimizer step will touch, computed before anything is changed.

    Attributes:
        groups: FSDP groups with at least one parameter in the optimizer, in first-seen order.
        cast_groups: Groups whose grads get cast to the main-weight dtype this step, with the
            indices (in the group) of the parameters to cast: those the optimizer holds that
            have a grad. Grad presence is per parameter: several optimizers may each hold some
            of a group's parameters and zero only their own.
        mismatches: Mismatched parameters per (param dtype, grad dtype, action).
        params_count: Parameters in the optimizer's param groups.
        cast_bytes: Bytes the grad cast wrote (set by :meth:`StepCore.cast`).
        cast_records: (group, bytes written) per cast group (set by :meth:`StepCore.cast`).
    """

    groups: list[ParameterGroup]
    cast_groups: list[tuple[ParameterGroup, list[int]]]
    mismatches: Counter[MismatchKey] = field(default_factory=Counter)
    params_count: int = 0
    cast_bytes: int = 0
    cast_records: list[tuple[ParameterGroup, int]] = field(default_factory=list)


class StepCore:
    """Casts grads around an optimizer step and refreshes compute weights after it.

    Args:
        optimizer: The optimizer being adapted.
        precision_aware: The optimizer takes mixed-precision grads as they are; skip casts.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, precision_aware: bool) -> None:
        # Weakly: the adaptation registry holds the core strongly and must not keep the
        # optimizer (and its state) alive.
        self._optimizer_ref = weakref.ref(optimizer)
        self.precision_aware = precision_aware
        self._cast_in_flight: list[ParameterGroup] = []

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        optimizer = self._optimizer_ref()
        if optimizer is None:
            raise ReferenceError("the adapted optimizer no longer exists")
        return optimizer

    def plan(self, check_grads: bool = True) -> StepPlan:
        """Validates the optimizer's parameters and grads; changes nothing.

        Args:
            check_grads: Also validate grads and decide casts. ``False`` before a closure has
                produced the grads: the plan then only lists the groups.

        Raises:
            TypeError: A param group holds something that is not an ``nn.Parameter``, or a
                plain parameter's grad dtype differs from its dtype (unless precision aware).
        """
        groups: dict[int, ParameterGroup] = {}
        with_grads: dict[int, list[int]] = {}
        mismatches: Counter[MismatchKey] = Counter()
        rejected: list[str] = []
        params_count = 0
        for group_index, param_group in enumerate(self.optimizer.param_groups):
            for param_index, param in enumerate(param_group["params"]):
                params_count += 1
                if not isinstance(param, nn.Parameter):
                    raise TypeError(
                        f"fully_shard_optimizer expected nn.Parameter values in optimizer param groups; "
                        f"param_groups[{group_index}]['params'][{param_index}] is {type(param).__name__}"
                    )
                fsdp_group = parameter_group_of(param)
                if fsdp_group is not None:
                    groups.setdefault(id(fsdp_group), fsdp_group)
                    if param.grad is not None:
                        with_grads.setdefault(id(fsdp_group), []).append(fsdp_group.index_of(param))
                    continue
                grad = param.grad
                if grad is not None and grad.dtype != param.dtype:
                    if self.precision_aware:
                        mismatches[(param.dtype, grad.dtype, MismatchAction.PASSTHROUGH)] += 1
                    else:
                        mismatches[(param.dtype, grad.dtype, MismatchAction.REJECTED)] += 1
                        rejected.append(
                            f"param_groups[{group_index}]['params'][{param_index}] "
                            f"(shape {tuple(param.shape)}): dtype {param.dtype}, grad dtype {grad.dtype}"
                        )
        plan = StepPlan(list(groups.values()), [], mismatches, params_count)
        if not check_grads:
            return plan
        if rejected:
            raise _MismatchError(
                "fully_shard_optimizer: a parameter not managed by fully_shard has a grad whose dtype differs "
                "from its own, which the optimizer cannot update safely; expected equal dtypes or "
                f"precision_aware=True. Offending: {'; '.join(rejected[:5])}"
                + (f" (and {len(rejected) - 5} more)" if len(rejected) > 5 else ""),
                plan,
            )
        for fsdp_group in plan.groups:
            indices = with_grads.get(id(fsdp_group))
            if not indices or fsdp_group.grads_dtype == fsdp_group.main_dtype:
                continue
            action = MismatchAction.PASSTHROUGH if self.precision_aware else MismatchAction.CAST
            mismatches[(fsdp_group.main_dtype, fsdp_group.grads_dtype, action)] += len(indices)
            if not self.precision_aware:
                plan.cast_groups.append((fsdp_group, indices))
        return plan

    def cast(self, plan: StepPlan) -> int:
        """Casts the planned groups' grads to their main-weight dtype; returns bytes written."""
        plan.cast_records = []
        try:
            for fsdp_group, indices in plan.cast_groups:
                self._cast_in_flight.append(fsdp_group)
                plan.cast_records.append((fsdp_group, fsdp_group.cast_grads(fsdp_group.main_dtype, indices)))
        except BaseException:
            self.restore(carry_back=False)
            raise
        plan.cast_bytes = sum(nbytes for _, nbytes in plan.cast_records)
        return plan.cast_bytes

    def restore(self, carry_back: bool = True) -> None:
        """Puts every cast group's original grads back; safe to call at any time.

        Args:
            carry_back: Write the cast copies' current values back into the main grads (see
                :meth:`ParameterGroup.restore_grads`). ``False`` right after an update, which
                reads grads only; ``True`` when repairing a step that raised, after which the
                user may have zeroed or replaced the grads.
        """
        while self._cast_in_flight:
            self._cast_in_flight.pop().restore_grads(carry_back=carry_back)

    def refresh(self, plan: StepPlan) -> int:
        """Refreshes the compute copy of every group the optimizer touched; returns bytes."""
        return sum(fsdp_group.refresh_compute_weight() for fsdp_group in plan.groups)


class _MismatchError(TypeError):
    """A rejected dtype mismatch; carries the plan so telemetry can count the rejection."""

    def __init__(self, message: str, plan: StepPlan) -> None:
        super().__init__(message)
        self.plan = plan


def find_closure(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, bool]:
    """The closure passed to ``optimizer.step`` and whether it came positionally.

    ``args`` are the arguments after ``self``.
    """
    if "closure" in kwargs:
        return kwargs["closure"], False
    if args:
        return args[0], True
    return None, False
