"""Closures: cast after the closure has produced the grads, restore before it runs again."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .step_core import StepCore, StepPlan

__all__ = ["CastingClosure"]


class CastingClosure:
    """Wraps a step closure so that every call sees original grads and leaves cast ones.

    Optimizers such as LBFGS call the closure several times per step and move the weights in
    between; each call first puts the original grads back (backward accumulates into them),
    refreshes the compute weights if an earlier call already ran (so that forward gathers the
    weights the optimizer is evaluating), then validates and casts the new grads.

    Args:
        closure: The user's closure.
        core: The adapter core.
        on_plan: Called with each new plan (the attachment keeps the latest for refresh).
        cast: Performs the cast of a plan (lets the wrapt attachment trace it).
        refresh: Refreshes the compute weights of a plan's groups (lets the wrapt attachment
            trace it).
    """

    def __init__(
        self,
        closure: Callable[[], Any],
        core: StepCore,
        on_plan: Callable[[StepPlan], None],
        cast: Callable[[StepPlan], int] | None = None,
        refresh: Callable[[StepPlan], int] | None = None,
    ) -> None:
        self._closure = closure
        self._core = core
        self._on_plan = on_plan
        self._cast = cast or core.cast
        self._refresh = refresh or core.refresh
        self._last_plan: StepPlan | None = None

    def __call__(self) -> Any:
        self._core.restore(carry_back=False)
        if self._last_plan is not None:
            self._refresh(self._last_plan)
        loss = self._closure()
        plan = self._core.plan()
        self._last_plan = plan
        self._on_plan(plan)
        self._cast(plan)
        return loss


def replace_closure(
    args: tuple[Any, ...], kwargs: dict[str, Any], closure: Any, positional: bool
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``args``/``kwargs`` of ``step`` (``args`` without self) with ``closure`` substituted."""
    if positional:
        return (closure, *args[1:]), kwargs
    return args, {**kwargs, "closure": closure}
