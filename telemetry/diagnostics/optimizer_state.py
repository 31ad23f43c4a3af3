"""What the optimizer holds per diagnosed parameter: its state tensors, param group and learning rate.

No OpenTelemetry here: the observer reads these once per diagnosed step and hands them to
:func:`~fsdp_patch.telemetry.diagnostics.param_stats.local_rows` (the state tensors) and to
:class:`~fsdp_patch.telemetry.diagnostics.attribution.Attribution` (the contexts).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from . import rows
from .rows import ParamSlot


@dataclass(frozen=True)
class ParamContext:
    """What the optimizer says about one slot's parameter this step.

    Attributes:
        in_optimizer: The parameter is in one of the optimizer's param groups.
        lr: Its param group's learning rate (``None``: not in the optimizer, or none set).
        state_keys: Keys of its state tensors, by state index (:class:`~.rows.StateTensor`).
    """

    in_optimizer: bool = True
    lr: float | None = None
    state_keys: tuple[str, ...] = ()


# State whose NaN/Inf reaches the main weight within the step that wrote it, whatever the learning
# rate (the update adds a multiple of it: Adam's param.addcdiv_(exp_avg, denom), SGD's
# param.add_(momentum_buffer); 0 * Inf is NaN too), for these classes exactly (a subclass may step
# otherwise). A second moment is not among them: an Inf there makes the update 0, not NaN.
SHOWS_IN_WEIGHT: dict[type, frozenset[str]] = {
    torch.optim.Adam: frozenset({"exp_avg"}),
    torch.optim.AdamW: frozenset({"exp_avg"}),
    torch.optim.SGD: frozenset({"momentum_buffer"}),
}


class StateTensors:
    """Per slot, its optimizer state tensors (local shards, flattened; the first
    ``rows.MAX_STATES`` floating tensors that are not 0-d, in the state's order) and their keys.

    A slot's entry is reused from the previous diagnosed step while its state dict holds the very
    same tensor objects: optimizers update their state in place, and the views and records of a
    slot cost more host time (a few torch calls each) than the identity checks.
    """

    def __init__(self) -> None:
        # slot index -> (the state dict, its values, the records made of them)
        self._last: dict[int, tuple[dict[str, Any], tuple[Any, ...], list[rows.StateTensor]]] = {}

    def read(
        self, optimizer: torch.optim.Optimizer, table: Sequence[ParamSlot]
    ) -> tuple[list[list[rows.StateTensor]], list[tuple[str, ...]]]:
        shows = SHOWS_IN_WEIGHT.get(type(optimizer), frozenset())
        tensors: list[list[rows.StateTensor]] = []
        keys: list[tuple[str, ...]] = []
        for index, slot in enumerate(table):
            state = optimizer.state.get(slot.param, None) if slot.param is not None else None
            found: list[rows.StateTensor] = []
            if state:
                values = tuple(state.values())
                last = self._last.get(index)
                if (
                    last is not None
                    and last[0] is state
                    and len(last[1]) == len(values)
                    and all(a is b for a, b in zip(last[1], values, strict=True))
                ):
                    found = last[2]
                else:
                    found = _records(state, shows)
                    self._last[index] = (state, values, found)
            tensors.append(found)
            keys.append(tuple(s.key for s in found))
        return tensors, keys


def _records(state: dict[str, Any], shows: frozenset[str]) -> list[rows.StateTensor]:
    found: list[rows.StateTensor] = []
    for key, value in state.items():
        if len(found) == rows.MAX_STATES:
            break
        if torch.is_tensor(value) and value.is_floating_point() and value.dim() > 0:
            local = getattr(value, "_local_tensor", value)
            found.append(rows.StateTensor(key, len(found), local.detach().reshape(-1), key in shows))
    return found


def contexts_for(
    optimizer: torch.optim.Optimizer, table: Sequence[ParamSlot], keys: Sequence[tuple[str, ...]]
) -> list[ParamContext]:
    """Per slot, whether the optimizer holds its parameter, and at which learning rate."""
    lr_of: dict[int, Any] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            lr_of.setdefault(id(param), group.get("lr"))
    out = []
    for slot, state_keys in zip(table, keys, strict=True):
        held = slot.param is not None and id(slot.param) in lr_of
        lr = lr_of.get(id(slot.param)) if held else None
        value = float(lr) if isinstance(lr, (int, float)) or torch.is_tensor(lr) else None
        out.append(ParamContext(held or slot.param is None, value, state_keys))
    return out
