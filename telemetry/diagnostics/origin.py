"""Where the first NaN/Inf of an iteration began: cheap checks in the order an iteration runs them.

The optimizer boundary sees every parameter's tensors, but only once a NaN has spread: a NaN
loss makes every grad NaN at once, and the first parameter in model order is not where it began.
So an iteration is checked as it runs, one reduction per checked tensor kept on the device
(:class:`~.probes.ProbeLog`, ``torch.aminmax``: NaN propagates through it, an Inf is its min or max), and
read once, after the optimizer step:

- ``weight_write``: a main weight non-finite before the step's update that was finite after the
  previous update (or that no update has touched yet): written outside the optimizer;
- ``forward``: a unit's (or, escalated, any module's) output;
- ``loss``: the tensor ``backward`` was called on;
- ``backward``: the grad of a unit's output (or, escalated, of any module's input and output);
- ``reduce``: a group's grads before the reduce-scatter, and its reduced shard after it;
- ``grad_write``: main grads at the step, after every backward and reduce was finite: changed in
  between (a clip whose norm was not finite, a hook); the same checks find grads that were
  non-zero after the reduce and all 0 at the step (:func:`zeroed_groups`);
- ``optimizer``: the main weights after the update, grads and weights before it finite.

:func:`find_origin` applies that order to what a log read (:mod:`.probes`: the checks and their
reading). No OpenTelemetry here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from .. import semconv
from .probes import AFTER, BEFORE, CLIP, INPUT, Checked

# [Note: the reduce's input in a wide dtype]
# A reduce-scatter in float32 (or wider) sums finite grads to a finite result unless they are
# near float32's limit (3.4e38), far past any grad a healthy or an overflowing fp16/bf16 model
# makes; its output is non-finite only when an input was. Torch FSDP2's unsharded grads reduced in
# such a dtype are therefore not checked before the reduce (a pass over world-size times a shard's
# elements on every iteration: the largest part of the always-on checks' cost): a non-finite
# reduce output whose input went unchecked is named as the backward of that unit. Grads reduced in
# fp16 or bf16 are checked before, so a reduce that overflows is named as the reduce.
WIDE_REDUCE_DTYPES = frozenset({torch.float32, torch.float64})


@dataclass(frozen=True)
class Origin:
    """Where an iteration's first NaN/Inf began.

    Attributes:
        stage: One of :data:`semconv.ORIGIN_STAGES`.
        where: The module, parameter or group named.
        dtype: The dtype of the tensor where it was seen.
        nan: Whether it was a NaN (else an Inf).
        microbatch: The backward pass it came from.
        detail: What else the checks know (the last finite value before it, the reduce dtype).
    """

    stage: str
    where: str
    dtype: str
    nan: bool
    microbatch: int
    detail: str = ""

    def at(self, where: str) -> Origin:
        """The same origin, named at ``where``."""
        return replace(self, where=where)


def _origin(checked: Checked, detail: str = "", stage: str | None = None) -> Origin:
    p = checked.probe
    return Origin(stage or p.stage, p.where, p.dtype, checked.nan, p.microbatch, detail)


def find_origin(checks: Sequence[Checked], previous_after_finite: dict[str, bool] | None = None) -> Origin | None:
    """The origin of the first NaN/Inf among ``checks`` (one iteration's, in the order they ran).

    Args:
        checks: What :meth:`~.probes.ProbeLog.read` returned.
        previous_after_finite: Per group, whether its main weights were finite after the
            previous update (absent: no update checked them yet). A group checked again before
            this update has its weights checked (a write between steps); one that is not was not
            written since.

    Returns:
        ``None`` when every check was finite.
    """
    if all(c.finite for c in checks):
        return None
    previous_after_finite = previous_after_finite or {}
    # Weights the previous update left non-finite and nothing wrote since (no check before this
    # update: the same tensors, untouched) still hold that NaN: it was reported at its own step.
    rechecked = {
        c.probe.group for c in checks if c.probe.stage == semconv.ORIGIN_WEIGHT_WRITE and c.probe.when == BEFORE
    }
    if any(not finite and group not in rechecked for group, finite in previous_after_finite.items()):
        return None
    # Weights non-finite before the update came from outside the optimizer, unless the previous
    # update left them so: then that update was the origin, reported at its own step.
    for c in checks:
        p = c.probe
        if p.stage == semconv.ORIGIN_WEIGHT_WRITE and p.when == BEFORE and not c.finite:
            if previous_after_finite.get(p.group, True):
                return _origin(c, "non-finite before the update; finite after the previous one")
            return None  # the NaN is the previous step's, already reported there
    before_step = [c for c in checks if c.probe.stage != semconv.ORIGIN_WEIGHT_WRITE]
    for index, c in enumerate(before_step):
        if c.finite:
            continue
        p = c.probe
        if p.stage == semconv.ORIGIN_REDUCE and p.when == AFTER:
            dtype = _reduce_dtype(before_step, p.where)
            if dtype is None:  # reduced in a wide dtype, unchecked before: [Note: the reduce's input in a wide dtype]
                return _origin(
                    c, f"its parameters' grads, reduced in {p.dtype}, which adds no overflow", semconv.ORIGIN_BACKWARD
                )
            # Named in the dtype it was reduced in (the input's): the output may be kept wider.
            return replace(_origin(c, f"finite before the reduce-scatter in {dtype}, non-finite after it"), dtype=dtype)
        if p.stage == semconv.ORIGIN_REDUCE:  # grads the backward left, about to be reduced
            return _origin(c, "its parameters' grads, before the reduce-scatter", semconv.ORIGIN_BACKWARD)
        if p.stage == semconv.ORIGIN_GRAD_WRITE and p.where == CLIP:
            scaled = "NaN" if c.nan else "0 (grads zeroed)"
            return _origin(
                c, f"clip_grad_norm_'s total norm was {'NaN' if c.nan else 'Inf'}: every grad was scaled by {scaled}"
            )
        if p.stage == semconv.ORIGIN_GRAD_WRITE and _reduced_without_output_check(before_step, p.where):
            return _origin(
                c,
                f"finite before the reduce-scatter in {_reduce_dtype(before_step, p.where)}, non-finite at the step",
                semconv.ORIGIN_REDUCE,
            )
        if p.stage == semconv.ORIGIN_BACKWARD and not p.when:
            # The grad of a unit's output is made by the backward of what consumed that output:
            # the unit that ran after it in the forward, or the loss after the root.
            consumer = _consumer(before_step, p.where, p.microbatch)
            if consumer is None:
                return _origin(
                    c,
                    f"the grad of the root's output ({p.where or 'the root'}) was not finite: the "
                    "loss's backward made it",
                    semconv.ORIGIN_BACKWARD,
                ).at("loss")
            return _origin(c, f"the grad of its input ({p.where}'s output) was not finite, of its output finite").at(
                consumer
            )
        if p.stage == semconv.ORIGIN_FORWARD and p.when == INPUT:
            return _origin(c, "the model's input (the batch) already held it")
        if p.stage == semconv.ORIGIN_FORWARD:
            earlier = [e for e in before_step[:index] if e.probe.stage == semconv.ORIGIN_FORWARD]
            if earlier:
                last = earlier[-1]
                return _origin(c, f"the output before it ({last.probe.where}) peaked at |x| = {last.magnitude:.4g}")
        return _origin(c)
    for c in checks:
        p = c.probe
        if p.stage == semconv.ORIGIN_WEIGHT_WRITE and p.when == AFTER and not c.finite:
            return _origin(
                c, "finite grads and weights before the update, non-finite after it", semconv.ORIGIN_OPTIMIZER
            )
    return None


def zeroed_groups(checks: Sequence[Checked]) -> list[str]:
    """The groups whose grads something zeroed between the backward and the step.

    A group's reduced grads (its reduce-scatter's output) held a non-zero element, and every
    check of its main grads at the step read exactly 0. Named only when that is true of every
    group whose reduced grads were non-zero (a whole model's grads multiplied by 0: a clip whose
    total norm was not finite, ``zero_grad`` before ``step``); one group zeroed while others kept
    theirs is a choice (a frozen part), not a finding. An iteration holding a NaN/Inf has an
    origin instead.
    """
    if not all(c.finite for c in checks):
        return []
    reduced: dict[str, bool] = {}
    at_step: dict[str, bool] = {}
    for c in checks:
        p = c.probe
        if p.stage == semconv.ORIGIN_REDUCE and p.when == AFTER:
            reduced[p.where] = reduced.get(p.where, False) or c.low != 0.0 or c.high != 0.0
        elif p.stage == semconv.ORIGIN_GRAD_WRITE and p.where != CLIP:
            at_step[p.where] = at_step.get(p.where, True) and c.low == 0.0 and c.high == 0.0
    nonzero = [where for where, held in reduced.items() if held]
    if not nonzero or not all(at_step.get(where, False) for where in nonzero):
        return []
    return nonzero


def _reduced_without_output_check(checks: Sequence[Checked], where: str) -> bool:
    """Whether ``where``'s grads were checked before a reduce-scatter whose output no check saw
    (torch FSDP2 reduces out of sight): the grads at the step are then that output."""
    stages = {c.probe.when for c in checks if c.probe.stage == semconv.ORIGIN_REDUCE and c.probe.where == where}
    return BEFORE in stages and AFTER not in stages


def _reduce_dtype(checks: Sequence[Checked], where: str) -> str | None:
    """The dtype ``where``'s grads were reduced in, as checked before the reduce (``None``: unchecked)."""
    for c in checks:
        if c.probe.stage == semconv.ORIGIN_REDUCE and c.probe.where == where and c.probe.when == BEFORE:
            return c.probe.dtype
    return None


def _consumer(checks: Sequence[Checked], unit: str, microbatch: int) -> str | None:
    """The unit whose forward ran next after ``unit``'s in ``microbatch`` (``None``: none did)."""
    order = [
        c.probe.where
        for c in checks
        if c.probe.stage == semconv.ORIGIN_FORWARD and c.probe.when != INPUT and c.probe.microbatch == microbatch
    ]
    if unit not in order:
        return None
    last = len(order) - 1 - order[::-1].index(unit)
    following = [where for where in order[last + 1 :] if where != unit]
    return following[0] if following else None
