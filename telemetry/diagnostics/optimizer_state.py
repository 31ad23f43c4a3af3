"""What the optimizer holds per diagnosed parameter: its state tensors, param group and learning rate.

No OpenTelemetry here: the observer reads these once per diagnosed step and hands them to
:func:`~fsdp_patch.telemetry.diagnostics.param_stats.local_rows` (the state tensors) and to
:class:`~fsdp_patch.telemetry.diagnostics.attribution.Attribution` (the contexts).
"""

from __future__ import annotations

import math
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
        update_bound: For Adam and AdamW, the largest update per unit of learning rate that
            moments consistent with each other allow (:func:`adam_update_bound`); ``None`` for
            other optimizers.
        decoupled_decay: AdamW's weight decay, which adds ``lr * decay * |w|`` beyond that bound.
    """

    in_optimizer: bool = True
    lr: float | None = None
    state_keys: tuple[str, ...] = ()
    update_bound: float | None = None
    decoupled_decay: float = 0.0


def adam_update_bound(beta1: float, beta2: float) -> float | None:
    """The largest ``|m̂| / sqrt(v̂)`` of one element that Adam's moments allow at any step, whatever
    the grads: ``m̂`` and ``v̂`` are weighted means of the grads and of their squares, so by
    Cauchy-Schwarz ``|m̂| <= sqrt(v̂ * sum(a_i² / b_i))``, ``a_i`` and ``b_i`` their weights; that sum
    grows with the step count to ``(1-β1)² / ((1-β2) (1 - β1²/β2))`` (7.3 at 0.9 and 0.999; 1 at the
    first step). ``None`` where ``β1² >= β2`` (no finite bound)."""
    if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0) or beta1 * beta1 >= beta2:
        return None
    return (1.0 - beta1) / math.sqrt((1.0 - beta2) * (1.0 - beta1 * beta1 / beta2))


# Optimizers whose update is Adam's (an element's update is lr * m̂ / (sqrt(v̂) + eps), plus AdamW's
# decoupled decay), for these classes exactly: a subclass may step otherwise.
_ADAM = (torch.optim.Adam, torch.optim.AdamW)


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
    """Per slot, whether the optimizer holds its parameter, at which learning rate, and the bound
    on its update where the optimizer is Adam's."""
    group_of: dict[int, dict[str, Any]] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            group_of.setdefault(id(param), group)
    adam = type(optimizer) in _ADAM
    decoupled = type(optimizer) is torch.optim.AdamW
    out = []
    for slot, state_keys in zip(table, keys, strict=True):
        held = group_of.get(id(slot.param)) if slot.param is not None else None
        lr = held.get("lr") if held is not None else None
        value = float(lr) if isinstance(lr, (int, float)) or torch.is_tensor(lr) else None
        bound, decay = None, 0.0
        if adam and held is not None:
            betas = held.get("betas")
            if isinstance(betas, (tuple, list)) and len(betas) == 2:
                bound = adam_update_bound(float(betas[0]), float(betas[1]))
            if decoupled or held.get("decoupled_weight_decay"):
                decay = float(held.get("weight_decay") or 0.0)
        out.append(ParamContext(held is not None or slot.param is None, value, state_keys, bound, decay))
    return out


def state_tensors(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> list[tuple[str, str, torch.Tensor]]:
    """``(parameter name, state key, local tensor)`` of every floating state tensor the optimizer
    holds (``names``: parameter names by identity; others are named by their place)."""
    out = []
    for index, (param, state) in enumerate(optimizer.state.items()):
        if not isinstance(state, dict):
            continue
        name = names.get(id(param), f"parameter {index}")
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                local = value.to_local() if hasattr(value, "to_local") else value
                out.append((name, str(key), local))
    return out


def resumed_at(optimizer: torch.optim.Optimizer) -> int:
    """The largest step count the optimizer's state holds (0: a state no step has written)."""
    largest = 0
    for state in optimizer.state.values():
        step = state.get("step") if isinstance(state, dict) else None
        if isinstance(step, torch.Tensor) and step.numel() == 1:
            step = step.item()
        if isinstance(step, int | float):
            largest = max(largest, int(step))
    return largest
