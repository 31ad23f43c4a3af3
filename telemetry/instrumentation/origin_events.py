"""The attributes of event ``fsdp.precision.origin``: where an iteration's first NaN/Inf began, as
:class:`~.iterations.IterationWatch` reports it on the step's span.

Two origins are made more precise here, from the main weights as they are when it is reported (a
sync on each parameter read: only once, for an origin):

- one in the optimizer's update names a unit: it is narrowed to the first parameter of the unit
  whose main weight holds NaN/Inf, with how many elements;
- one in a write between steps names a parameter: its detail gets how many of its elements hold
  NaN/Inf, and whether the update since spread them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from opentelemetry.util.types import AttributeValue

from .. import semconv
from ..diagnostics.groups import weights_of
from ..diagnostics.origin import Origin
from ..diagnostics.probes import Checked
from ..diagnostics.rows import param_table
from .step_tensors import group_name

__all__ = ["origin_attributes"]


def origin_attributes(
    origin: Origin,
    step: int,
    rank: int,
    refined: bool,
    groups: Callable[[], Sequence[Any]],
    checks: Sequence[Checked] = (),
) -> dict[str, AttributeValue]:
    """The attributes of event ``fsdp.precision.origin`` for ``origin``.

    Args:
        origin: Where the NaN/Inf began.
        step: The step whose iteration it began in.
        rank: This rank.
        refined: Whether a module-level check of an escalated iteration found it.
        groups: The optimizer's parameter groups (asked for only where the origin is narrowed to
            a parameter).
        checks: Everything the iteration checked, in order.
    """
    where, detail = origin.where, origin.detail
    if origin.stage == semconv.ORIGIN_OPTIMIZER:
        # Read before this step's update: the weights as the update that made them non-finite left them.
        where, detail = _locate(origin, detail, groups())
    elif origin.stage == semconv.ORIGIN_WEIGHT_WRITE:
        detail = _written_elements(origin, detail, checks, groups())
    attrs: dict[str, AttributeValue] = {
        semconv.ATTR_STEP: step,
        semconv.ATTR_RANK: rank,
        semconv.ATTR_ORIGIN_STAGE: origin.stage,
        semconv.ATTR_ORIGIN_WHERE: where,
        semconv.ATTR_ORIGIN_DTYPE: origin.dtype,
        semconv.ATTR_NONFINITE_KIND: semconv.NONFINITE_NAN if origin.nan else semconv.NONFINITE_INF,
        semconv.ATTR_MICROBATCH: origin.microbatch,
        semconv.ATTR_ORIGIN_REFINED: refined,
    }
    if detail:
        attrs[semconv.ATTR_ORIGIN_DETAIL] = detail
    return attrs


def _written_elements(origin: Origin, detail: str, checks: Sequence[Checked], groups: Sequence[Any]) -> str:
    """``detail`` with how many elements of the parameter written hold NaN/Inf on this rank.

    Counted now, after the update of the step whose checks saw the write (a count when it
    was checked would cost one more pass over every main weight at every step): when that
    iteration's grads of the parameter's group were finite (the forward ran on a copy the
    write missed), the update kept the count; when they were not (the forward gathered the
    weight written), the update spread it, and the count says so.
    """
    group = next(
        (
            c.probe.group
            for c in checks
            if c.probe.stage == semconv.ORIGIN_WEIGHT_WRITE and c.probe.where == origin.where and c.probe.group
        ),
        "",
    )
    names = [group_name(g) for g in groups]
    slots = [slot for slot in param_table(groups) if slot.name == origin.where and names[slot.group] == group]
    if not slots:
        return detail
    slot = slots[0]
    main = weights_of(groups[slot.group], None).mains[slot.tensor]
    segment = main[slot.start : slot.start + slot.length]
    count = int((~torch.isfinite(segment)).sum())
    grads_finite = all(
        c.finite
        for c in checks
        if c.probe.where == group and c.probe.stage in (semconv.ORIGIN_REDUCE, semconv.ORIGIN_GRAD_WRITE)
    )
    if grads_finite:
        counted = f"{count} of its {slot.length} element(s) on this rank"
    else:
        counted = (
            f"{count} of its {slot.length} element(s) on this rank after that step's update, which spread "
            "it (the step's grads already held NaN/Inf: the forward ran on the weight written)"
        )
    return f"{detail}; {counted}" if detail else counted


def _locate(origin: Origin, detail: str, groups: Sequence[Any]) -> tuple[str, str]:
    """The first parameter of the named unit whose main weight holds NaN/Inf now, and how many
    elements (a sync on each parameter: only once, for an origin)."""
    names = [group_name(g) for g in groups]
    wanted = [i for i, name in enumerate(names) if name == origin.where]
    table = [slot for slot in param_table(groups) if slot.group in wanted]
    bad: list[tuple[str, int]] = []
    for slot in table:
        main = weights_of(groups[slot.group], None).mains[slot.tensor]
        segment = main[slot.start : slot.start + slot.length]
        count = int((~torch.isfinite(segment)).sum())
        if count:
            bad.append((slot.name, count))
    if not bad:
        return origin.where, detail
    name, count = bad[0]
    others = f"; {len(bad) - 1} other parameter(s) of the unit too" if len(bad) > 1 else ""
    return name, f"{detail}; {count} element(s) on this rank{others}".lstrip("; ")
