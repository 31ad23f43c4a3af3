"""Event ``fsdp.optimizer.lr_jump``: a param group's learning rate risen ``LR_JUMP_FACTOR``-fold
or more since the previous step, read from the optimizer's param groups at each step (no device
work). The precision report ties a NaN/Inf that begins soon after to it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from opentelemetry.trace import Span

from .. import semconv

__all__ = ["LearningRateJumps"]


class LearningRateJumps:
    """Each param group's learning rate at the previous step, against which the next is judged."""

    def __init__(self) -> None:
        self._rates: list[float | None] = []

    def watch(self, param_groups: Sequence[dict[str, Any]], step: int, span: Span, rank: int) -> None:
        """Event ``fsdp.optimizer.lr_jump`` on ``span`` for each of ``param_groups`` (the optimizer's,
        at step ``step``) whose lr rose by ``LR_JUMP_FACTOR`` or more since the previous call. A rise
        from 0 (a warm-up's first step) is none."""
        rates = [_learning_rate(group) for group in param_groups]
        previous, self._rates = self._rates, rates
        if len(previous) != len(rates):
            return  # a param group added: nothing to compare with
        for index, (before, after) in enumerate(zip(previous, rates, strict=True)):
            if before is None or after is None or before <= 0.0:
                continue
            if after >= semconv.LR_JUMP_FACTOR * before:
                span.add_event(
                    semconv.EVENT_LR_JUMP,
                    {
                        semconv.ATTR_STEP: step,
                        semconv.ATTR_RANK: rank,
                        semconv.ATTR_PARAM_GROUP: index,
                        semconv.ATTR_LR_BEFORE: before,
                        semconv.ATTR_LR_AFTER: after,
                    },
                )


def _learning_rate(group: dict[str, Any]) -> float | None:
    """A param group's lr as a number; ``None`` when it has none, or keeps it in a device tensor
    (reading that would wait for the device)."""
    lr = group.get("lr")
    if isinstance(lr, torch.Tensor):
        if lr.device.type != "cpu" or lr.numel() != 1:
            return None
        lr = lr.item()
    return float(lr) if isinstance(lr, int | float) and not isinstance(lr, bool) else None
