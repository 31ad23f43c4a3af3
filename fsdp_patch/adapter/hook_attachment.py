"""Default attachment: torch's per-instance step pre/post hooks (the seed's design).

No OpenTelemetry call is made on this path.

Exception safety: a pre-hook cannot wrap the optimizer's own step in ``try/finally``. Errors
from validation leave nothing cast (validation precedes casting); an error raised by a
closure leaves nothing cast (each closure call restores before it runs the user's closure,
and casts only after it returned); an error raised by the optimizer's own update (or by a
step hook after ours) leaves the cast grads on the parameters until the next ``step``, the
next backward or ``remove_fully_shard_optimizer``, which put the original grads back first,
keeping what the user did meanwhile: ``zero_grad()`` then backward gives fresh grads, and no
``zero_grad`` accumulates onto the original ones, as without the adapter. The wrapt
attachment restores them at once.

Order with the user's own step hooks: torch runs global pre-hooks, then instance pre-hooks
in registration order, the update, instance post-hooks in registration order, then global
post-hooks. Pre-hooks registered after the adaptation see the cast fp32 grads; global
pre-hooks and instance pre-hooks registered before it see the original grads. Instance
post-hooks registered after the adaptation and global post-hooks see the original grads and
refreshed compute weights; instance post-hooks registered before it see the cast grads.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from ..fsdp2 import fsdp2_groups
from .closure import CastingClosure, replace_closure
from .settings_check import check_collective_settings
from .step_core import StepCore, StepPlan, find_closure

__all__ = ["HookAttachment"]


class HookAttachment:
    kind = "hooks"

    def __init__(self, optimizer: torch.optim.Optimizer, core: StepCore) -> None:
        self._core = core
        self._settings_checked = False
        self._plan: StepPlan | None = None
        self._handles: list[RemovableHandle] = []
        try:
            self._handles.append(optimizer.register_step_pre_hook(self._pre_hook))
            self._handles.append(optimizer.register_step_post_hook(self._post_hook))
        except BaseException:
            self.detach(optimizer)
            raise

    def _set_plan(self, plan: StepPlan) -> None:
        self._plan = plan

    def _pre_hook(
        self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        if not self._settings_checked:
            # Telemetry is off here; peers with it on must learn that before their diagnostics.
            self._settings_checked = True
            params = (p for group in optimizer.param_groups for p in group["params"])
            groups = [*self._core.plan(check_grads=False).groups, *fsdp2_groups(params)]
            check_collective_settings(groups, telemetry_on=False, precision_every=0)
        self._core.restore(carry_back=True)
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
        self._core.restore(carry_back=False)
        plan, self._plan = self._plan, None
        if plan is not None:
            self._core.refresh(plan)

    def detach(self, optimizer: torch.optim.Optimizer) -> None:
        self._core.restore(carry_back=True)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
