"""When the float8 casts are measured, and what goes on the trace: one adapted optimizer's float8
modules on its diagnosed iterations.

:class:`~.iterations.IterationWatch` owns one :class:`Float8Watch`. Where the sharded models hold
torchao float8 modules (:func:`~..diagnostics.float8_casts.float8_modules`, ``fully_shard``'s or
FSDP2's), an iteration that ends in a diagnosed step (the diagnostics' schedule, escalated ones
included) runs with hooks on them: a forward pre-hook measures the cast of the input and of the
weight, a hook on the output's grad the cast of the grad output
(:func:`~..diagnostics.float8_casts.measure`), and a forward pre-hook on every module that holds
parameters records the forward's order (whether a float8 module is the model's first or last).
Nothing here runs a collective: each rank measures its own batch, and the report merges the ranks.

The values stay on the device until the iteration ends, are copied to the host then without
blocking (:class:`~..diagnostics.host_copies.HostCopy`), and are read at the next iteration's end
(or at a flush): events ``fsdp.precision.float8`` on the span of the step then, each carrying the
step it measured. Up to :data:`ALL_ROWS_UP_TO` casts an iteration, every cast becomes an event; past
it, per role, the ``FSDP_PATCH_PRECISION_TOP_K`` modules whose cast keeps the least (the most
elements flushed or subnormal, the lowest SQNR), every one a report check would name, the first and
last modules, and every cast shown at an earlier diagnosed step (its scale's trend goes on).

Process-wide while a measured iteration runs: those hooks, all removed, exactly, when it ends, at a
flush (:meth:`Float8Watch.flush`: the exit, ``destroy_process_group``; what runs after it is not
training) and by :meth:`Float8Watch.close`. A model with ``torch.compile``d modules is not measured
(hooks would break its graphs).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from opentelemetry.trace import Span
from opentelemetry.util.types import AttributeValue
from torch import nn
from torch.utils.hooks import RemovableHandle

from fsdp_patch.module.model_units import sharded_models, user_name

from .. import env, float8_thresholds, semconv
from ..diagnostics.float8_casts import VALUES, cast_kind, float8_modules, is_gathered_float8, measure, measure_gathered
from ..diagnostics.host_copies import HostCopy
from .op_audits import compiled

__all__ = ["CastRow", "Float8Watch", "event_attributes"]

# Up to this many casts an iteration (16 float8 modules), every one is an event; past it, the
# selection the module's docstring describes.
ALL_ROWS_UP_TO = 48


@dataclass
class CastRow:
    """One module's casts of one role in one iteration, merged (:data:`VALUES`, the worst of each)."""

    module: str
    role: str
    dtype: str
    granularity: str
    gathered: bool
    values: dict[str, float]
    calls: int
    position: str = semconv.FLOAT8_POSITION_MIDDLE

    @property
    def kept_least(self) -> float:
        """How much of the tensor the cast lost, for ranking: subnormal share, then SQNR's deficit."""
        sqnr = self.values["sqnr"]
        deficit = 0.0 if math.isinf(sqnr) else (1.0 if math.isnan(sqnr) else max(0.0, 40.0 - sqnr) / 40.0)
        return self.values["subnormal"] + self.values["flushed"] + deficit


@dataclass
class _Measured:
    """The casts of the iteration running, on the device."""

    handles: list[RemovableHandle] = field(default_factory=list)
    names: dict[int, str] = field(default_factory=dict)
    casts: dict[tuple[str, str], list[torch.Tensor]] = field(default_factory=dict)
    kinds: dict[tuple[str, str], tuple[str, str, bool]] = field(default_factory=dict)
    order: dict[str, int] = field(default_factory=dict)


@dataclass
class _Pending:
    step: int
    copy: HostCopy
    keys: list[tuple[str, str]]
    kinds: dict[tuple[str, str], tuple[str, str, bool]]
    calls: list[int]
    first_last: tuple[str, str]


class Float8Watch:
    """The float8 casts of one optimizer's diagnosed iterations (see the module).

    Args:
        optimizer: The adapted optimizer (its parameters find the models).
        on: Whether the diagnostics are on (off: nothing is measured).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, on: bool) -> None:
        self.on = on
        self._params = [p for group in optimizer.param_groups for p in group["params"]]
        self._running: _Measured | None = None
        self._pending: _Pending | None = None
        self._top_k = max(env.precision_top_k(), 1)
        self._followed: set[tuple[str, str]] = set()
        # The float8 modules and the modules holding parameters, found at the first measured
        # iteration: the model's structure does not change in training, and the walk costs a
        # diagnosed step of a model without float8 modules more than anything else here.
        self._found: tuple[list[tuple[str, nn.Module]], list[tuple[str, nn.Module]]] | None = None
        self.rows: list[tuple[int, CastRow]] = []  # what was reported, in order (tests read it)

    @property
    def running(self) -> bool:
        return self._running is not None

    @property
    def pending(self) -> bool:
        """Whether a flush has something to do: values waiting to be read, or hooks on the models."""
        return self._pending is not None or self._running is not None

    def start(self) -> None:
        """Measure the iteration that starts now, where the models hold float8 modules."""
        if not self.on or self._running is not None:
            return
        if self._found is None:
            self._found = _watched(self._params)
        float8, holders = self._found
        if not float8:
            return
        measured = _Measured()
        for name, module in float8:
            measured.names[id(module)] = name
            measured.handles.append(module.register_forward_pre_hook(self._forward_hook(measured, name)))
            measured.handles.append(module.register_forward_hook(self._output_hook(measured, name)))
        for name, module in holders:
            measured.handles.append(module.register_forward_pre_hook(_order_hook(measured.order, name)))
        self._running = measured

    def finish(self, step: int, span: Span | None, rank: int) -> list[CastRow]:
        """End the iteration measured (step ``step`` ended it): its values on their way to the host;
        the previous one's read and reported on ``span``."""
        reported = self._report(span, rank)
        measured, self._running = self._running, None
        if measured is None:
            return reported
        for handle in measured.handles:
            handle.remove()
        keys = [key for key, casts in measured.casts.items() if casts]
        if keys:
            merged = [torch.stack(measured.casts[key]) for key in keys]
            order = sorted(measured.order, key=measured.order.__getitem__)
            self._pending = _Pending(
                step,
                HostCopy([torch.cat(merged)]),
                keys,
                measured.kinds,
                [len(measured.casts[key]) for key in keys],
                (order[0], order[-1]) if order else ("", ""),
            )
        return reported

    def flush(self, span: Span | None, rank: int) -> list[CastRow]:
        """Report the last iteration measured (a flush, the exit), and remove the hooks of one
        running: what the process does after the flush is not training's."""
        self.close()
        return self._report(span, rank)

    def close(self) -> None:
        """Remove the hooks of a running measurement without reading it."""
        measured, self._running = self._running, None
        if measured is not None:
            for handle in measured.handles:
                handle.remove()

    # -- hooks ---------------------------------------------------------------------------------

    def _forward_hook(self, measured: _Measured, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            if not torch.is_grad_enabled():
                return  # an evaluation between steps is no part of the training iteration measured
            if args and isinstance(args[0], torch.Tensor):
                hp = args[0]
                if torch.is_autocast_enabled():  # as Float8Linear's forward casts it
                    hp = hp.to(torch.get_autocast_gpu_dtype())
                _record(measured, module, name, semconv.FLOAT8_ROLE_INPUT, hp)
            weight = module.weight
            if isinstance(weight, torch.Tensor):
                _record(measured, module, name, semconv.FLOAT8_ROLE_WEIGHT, weight)

        return hook

    def _output_hook(self, measured: _Measured, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(
                    lambda grad: _record(measured, module, name, semconv.FLOAT8_ROLE_GRAD_OUTPUT, grad)
                )

        return hook

    # -- the report ----------------------------------------------------------------------------

    def _report(self, span: Span | None, rank: int) -> list[CastRow]:
        pending, self._pending = self._pending, None
        if pending is None:
            return []
        values = pending.copy.tensors(wait=True)[0].tolist()
        rows: list[CastRow] = []
        at = 0
        for key, calls in zip(pending.keys, pending.calls, strict=True):
            dtype, granularity, gathered = pending.kinds[key]
            merged = _merge(values[at : at + calls])
            at += calls
            position = semconv.FLOAT8_POSITION_MIDDLE
            if key[0] == pending.first_last[0]:
                position = semconv.FLOAT8_POSITION_FIRST
            elif key[0] == pending.first_last[1]:
                position = semconv.FLOAT8_POSITION_LAST
            rows.append(CastRow(key[0], key[1], dtype, granularity, gathered, merged, calls, position))
        shown = self._shown(rows)
        self.rows.extend((pending.step, row) for row in shown)
        if span is not None:
            for row in shown:
                span.add_event(semconv.EVENT_FLOAT8_CAST, event_attributes(row, pending.step, rank))
        return shown

    def _shown(self, rows: list[CastRow]) -> list[CastRow]:
        if len(rows) <= ALL_ROWS_UP_TO:
            return rows
        chosen: dict[tuple[str, str], CastRow] = {}
        for role in semconv.FLOAT8_ROLES:
            ranked = sorted((r for r in rows if r.role == role), key=lambda r: r.kept_least, reverse=True)
            for row in ranked[: self._top_k]:
                chosen[(row.module, row.role)] = row
        for row in rows:
            key = (row.module, row.role)
            if (
                key in self._followed
                or row.position != semconv.FLOAT8_POSITION_MIDDLE
                or float8_thresholds.fired(row.role, row.values)
            ):
                chosen[key] = row
        # A cast shown once is shown at every later diagnosed step: its scale's trend goes on.
        self._followed.update(chosen)
        return [row for row in rows if (row.module, row.role) in chosen]


def _watched(params: list[torch.Tensor]) -> tuple[list[tuple[str, nn.Module]], list[tuple[str, nn.Module]]]:
    """The float8 modules of the sharded models holding ``params`` (none compiled), and every
    module of them holding parameters of its own, each with its user's name."""
    models = [m for m in sharded_models(params) if not compiled(m.root)]
    float8 = [(user_name(m.prefix, name), module) for m in models for name, module in float8_modules(m.root)]
    if not float8:
        return [], []
    holders = [
        (user_name(m.prefix, name), module)
        for m in models
        for name, module in m.root.named_modules()
        if any(True for _ in module.parameters(recurse=False))
    ]
    return float8, holders


def _record(measured: _Measured, module: nn.Module, name: str, role: str, tensor: torch.Tensor) -> None:
    kind = cast_kind(module, role)
    if kind is None:
        return
    gathered = role == semconv.FLOAT8_ROLE_WEIGHT and is_gathered_float8(tensor)
    values = measure_gathered(tensor) if gathered else measure(module, role, tensor)
    if values is None:
        return
    key = (name, role)
    measured.casts.setdefault(key, []).append(values)
    dtype = getattr(tensor, "_data").dtype if gathered else kind.dtype  # noqa: B009 (torchao's private field)
    measured.kinds.setdefault(key, (str(dtype).removeprefix("torch."), kind.granularity, gathered))


def _order_hook(order: dict[str, int], name: str) -> Callable[..., None]:
    def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
        order.setdefault(name, len(order))

    return hook


def _merge(calls: list[list[float]]) -> dict[str, float]:
    return {key: float8_thresholds.worst(key, [call[index] for call in calls]) for index, key in enumerate(VALUES)}


def event_attributes(row: CastRow, step: int, rank: int) -> dict[str, AttributeValue]:
    """The attributes of one ``fsdp.precision.float8`` event."""
    values = row.values
    return {
        semconv.ATTR_STEP: step,
        semconv.ATTR_RANK: rank,
        semconv.ATTR_FLOAT8_MODULE: row.module,
        semconv.ATTR_FLOAT8_ROLE: row.role,
        semconv.ATTR_FLOAT8_DTYPE: row.dtype,
        semconv.ATTR_FLOAT8_GRANULARITY: row.granularity,
        semconv.ATTR_FLOAT8_GATHERED: row.gathered,
        semconv.ATTR_FLOAT8_AMAX: values["amax"],
        semconv.ATTR_FLOAT8_SCALE: values["scale"],
        semconv.ATTR_FLOAT8_SCALE_MAX: values["scale_max"],
        semconv.ATTR_FLOAT8_AMAX_RATIO: values["amax_ratio"],
        semconv.ATTR_FLOAT8_FLUSHED: values["flushed"],
        semconv.ATTR_FLOAT8_SUBNORMAL: values["subnormal"],
        semconv.ATTR_FLOAT8_SATURATED: values["saturated"],
        semconv.ATTR_FLOAT8_SQNR: values["sqnr"],
        semconv.ATTR_FLOAT8_NONFINITE: int(values["nonfinite"]) if math.isfinite(values["nonfinite"]) else 0,
        semconv.ATTR_FLOAT8_ROWWISE_FLUSHED: values["rowwise_flushed"],
        semconv.ATTR_FLOAT8_CALLS: row.calls,
        semconv.ATTR_FLOAT8_POSITION: row.position,
    }
