"""Default attachment: torch's per-instance step pre/post hooks (the seed's design).

No OpenTelemetry call is made on this path.

Exception safety: a pre-hook cannot wrap the optimizer's own step in ``try/finally``. Errors
from validation leave nothing cast (validation precedes casting), errors raised by a closure
are caught by the closure wrapper, and an error raised by the optimizer's own update leaves
the cast grads in place until the next ``step`` or the next backward, which put the
original grads back first. The wrapt attachment restores them at once.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from .closure import CastingClosure, replace_closure
from .step_core import StepCore, StepPlan, find_closure

__all__ = ["HookAttachment"]


class HookAttachment:
    kind = "hooks"

    def __init__(self, optimizer: torch.optim.Optimizer, core: StepCore) -> None:
        self._core = core
        self._plan: StepPlan | None = None
        self._handles: list[RemovableHandle] = [
            optimizer.register_step_pre_hook(self._pre_hook),
            optimizer.register_step_post_hook(self._post_hook),
        ]

    def _set_plan(self, plan: StepPlan) -> None:
        self._plan = plan

    def _pre_hook(
        self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        self._core.restore()
        closure, positional = find_closure(args[1:], kwargs)
        if closure is None:
            plan = self._core.plan()
            self._plan = plan
            self._core.cast(plan)
            return None
        new_args, new_kwargs = replace_closure(
            args[1:], kwargs, CastingClosure(closure, self._core, self._set_plan), positional
        )
        return (args[0], *new_args), new_kwargs

    def _post_hook(self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._core.restore()
        plan, self._plan = self._plan, None
        if plan is not None:
            self._core.refresh(plan)

    def detach(self, optimizer: torch.optim.Optimizer) -> None:
        self._core.restore()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
