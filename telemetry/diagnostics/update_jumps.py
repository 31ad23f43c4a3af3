"""Update jumps: each parameter's update size across diagnosed steps, and the steps at which it
jumped, with what changed at that step (``semconv.DIAGNOSTIC_UPDATE_JUMP``, ``UPDATE_JUMP_CAUSES``).

:class:`~.attribution.Attribution` keeps one :class:`UpdateHistory` per optimizer and asks it
about every parameter's row at each diagnosed step. No OpenTelemetry here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from .. import semconv
from . import rows as row_spec
from .optimizer_state import ParamContext

__all__ = ["UpdateHistory"]


UPDATE_JUMP = 100.0
"""An update this many times its parameter's usual size (the median of its last
:data:`UPDATE_HISTORY` diagnosed steps) is a jump: two orders of magnitude, beyond what a
schedule's warmup does between diagnosed steps (they thin out as it goes: 10, 20, 50, 100) or
a loss spike makes of Adam's normalized update."""
UPDATE_HISTORY = 5
"""Diagnosed steps of a parameter's update sizes kept; a jump needs at least two of them."""
ADAM_BOUND_MARGIN = 2.0
"""An Adam update is named where its RMS per unit of learning rate is this many times the bound
consistent moments allow (:func:`~.optimizer_state.adam_update_bound`): the bound holds for
every element, so even twice it over the RMS is state that is no longer Adam's."""
CHANGED_TENFOLD = 10.0
"""A learning rate or a largest grad that grew this many times since the last diagnosed step is
what changed at a jump."""


class UpdateHistory:
    """Each parameter's update size across diagnosed steps, and its jumps.

    The size is the update's RMS, ``sqrt(UPDATE_SQ / NUMEL)``. A jump is a size at least
    :data:`UPDATE_JUMP` times the median of the parameter's previous sizes whose size per unit of
    learning rate grew too (:data:`CHANGED_TENFOLD`: a schedule that raises the learning rate, a
    warm restart, moves the weights as much more as it means to), or, for Adam and AdamW, a size
    per unit of learning rate at least :data:`ADAM_BOUND_MARGIN` times the bound consistent moments
    allow (which needs no history: a run resumed from a damaged checkpoint jumps at its first step);
    the value is how many times the one or the other it is. What changed at that step is named by
    what this class also keeps: the learning rate and the largest grad at the parameter's last
    diagnosed step, and whether the optimizer's state was loaded since.
    """

    def __init__(self) -> None:
        # name -> the last UPDATE_HISTORY (size, size per unit of learning rate) that were no jump
        self._sizes: dict[str, list[tuple[float, float | None]]] = {}
        self._last: dict[str, tuple[float | None, float]] = {}  # name -> (lr, grad amax)

    def judge(
        self, name: str, row: Sequence[float], context: ParamContext, state_loaded: bool
    ) -> tuple[float, str] | None:
        """``(how many times too large, what changed)`` for a jump at this step, else ``None``."""
        numel, update_sq = row[row_spec.NUMEL], row[row_spec.UPDATE_SQ]
        lr, grad = context.lr, row[row_spec.GRAD_AMAX]
        last_lr, last_grad = self._last.get(name, (None, 0.0))
        self._last[name] = (lr, grad)
        if numel <= 0 or update_sq <= 0 or not math.isfinite(update_sq):
            return None
        size = math.sqrt(update_sq / numel)
        per_lr = size / lr if lr else None
        history = self._sizes.setdefault(name, [])
        ratio = 0.0
        if len(history) >= 2:
            jumped = size / _median([s for s, _ in history])
            rates = [r for _, r in history if r]
            if jumped >= UPDATE_JUMP and (per_lr is None or not rates or per_lr >= CHANGED_TENFOLD * _median(rates)):
                ratio = jumped
        if not ratio and context.update_bound is not None and per_lr is not None:
            decay = context.decoupled_decay * math.sqrt(max(row[row_spec.MAIN_SQ], 0.0) / numel)
            over = per_lr / (context.update_bound + decay)
            ratio = over if over >= ADAM_BOUND_MARGIN else 0.0
        if not ratio:  # a jump is not the parameter's usual size: only the others are kept
            history.append((size, per_lr))
            del history[:-UPDATE_HISTORY]
            return None
        if state_loaded:
            cause = semconv.UPDATE_JUMP_STATE_LOADED
        elif lr and last_lr and lr >= CHANGED_TENFOLD * last_lr:
            cause = semconv.UPDATE_JUMP_LR
        elif last_grad > 0 and math.isfinite(grad) and grad >= CHANGED_TENFOLD * last_grad:
            cause = semconv.UPDATE_JUMP_GRADS
        else:
            cause = semconv.UPDATE_JUMP_STATE
        return ratio, cause


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]
