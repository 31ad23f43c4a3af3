"""Default attachment: torch's per-instance step pre/post hooks (Megatron-FSDP's adapter design).

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

from .events import NullObserver
from .step_sequence import StepSequence

__all__ = ["HookAttachment"]


class HookAttachment:
    """Drives the step sequence from torch's step pre-hook (``begin``) and post-hook (``end``)."""

    kind = "hooks"

    def __init__(self, optimizer: torch.optim.Optimizer, sequence: StepSequence) -> None:
        self._sequence = sequence
        # Telemetry is off here: the sequence reports to nothing, and tells peers so at the
        # first step's settings check.
        self._observer = NullObserver()
        self._handles: list[RemovableHandle] = []
        try:
            self._handles.append(optimizer.register_step_pre_hook(self._pre_hook))
            self._handles.append(optimizer.register_step_post_hook(self._post_hook))
        except BaseException:
            self.detach(optimizer)
            raise

    def _pre_hook(
        self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        rest = args[1:]
        new_args, new_kwargs = self._sequence.begin(self._observer, None, rest, kwargs)
        if new_args is rest and new_kwargs is kwargs:
            return None  # no closure to wrap
        return (args[0], *new_args), new_kwargs

    def _post_hook(self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._sequence.end(completed=True)

    def detach(self, optimizer: torch.optim.Optimizer) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
