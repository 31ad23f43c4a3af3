"""Closures: cast after the closure has produced the grads, restore before it runs again."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .step_sequence import StepSequence, StepState

__all__ = ["CastingClosure", "find_closure", "replace_closure"]


class CastingClosure:
    """Wraps a step closure so that every call sees original grads and leaves cast ones.

    Optimizers such as LBFGS call the closure several times per step and move the weights in
    between; each call first puts the original grads back (backward accumulates into them),
    refreshes the compute weights if an earlier call already ran (so that forward gathers the
    weights the optimizer is evaluating), then validates and casts the new grads through the
    step sequence, which reports to the step's observer.

    Args:
        closure: The user's closure.
        sequence: The adapted step's sequence.
        state: The running step.
    """

    def __init__(self, closure: Callable[[], Any], sequence: StepSequence, state: StepState) -> None:
        self._closure = closure
        self._sequence = sequence
        self._state = state
        self._calls = 0

    def __call__(self) -> Any:
        self._sequence.restore(carry_back=False)
        if self._calls:
            self._sequence.refresh(self._state.observer)
        self._calls += 1
        loss = self._closure()
        self._sequence.prepare(self._state)
        return loss


def find_closure(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, bool]:
    """The closure passed to ``optimizer.step`` and whether it came positionally.

    ``args`` are the arguments after ``self``.
    """
    if "closure" in kwargs:
        return kwargs["closure"], False
    if args:
        return args[0], True
    return None, False


def replace_closure(
    args: tuple[Any, ...], kwargs: dict[str, Any], closure: Any, positional: bool
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``args``/``kwargs`` of ``step`` (``args`` without self) with ``closure`` substituted."""
    if positional:
        return (closure, *args[1:]), kwargs
    return args, {**kwargs, "closure": closure}
