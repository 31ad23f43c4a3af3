"""Checks held until a batch of them runs: tensors a hook sees one at a time (each unit's output
in a forward), reduced together later, in their place among the iteration's checks.

A hook that checks the tensor it is handed at once pays a reduction and the Python around it per
call, in the middle of the model's own work. :meth:`~.probes.ProbeLog.hold` keeps the tensor
instead (a reference and its version counter) in a :class:`HeldBlock` that sits where the check
would have been among the log's entries; :meth:`~.probes.ProbeLog.flush` reduces every held tensor
as one list (:class:`~.prepared_checks.PreparedChecks`: one fused reduction on a GPU, a loop of ``aminmax``
with no Python per tensor around it on a CPU), whose values each read as its own, exactly as a
check made at once would. :class:`HeldPlans` keeps the prepared list of each batch's shape, so
that an iteration repeating the last one's forward plans nothing.

[Note: what a held tensor costs and when it is read]
A held tensor is kept alive until its batch is reduced. The owner flushes where holding longer
would keep memory the model has let go: a forward's unit outputs as the backward of that forward
begins (until then autograd holds them, or the next unit's inputs, itself), at the next forward
and at the step. A tensor written in place after it was held (its version counter moved) no
longer holds what its hook saw: it is not checked (:meth:`HeldBlock.current`), and the owner is
told where, so that it checks that place at once from then on. A kernel that writes into a tensor
through its memory, outside torch's in-place operations, moves no version counter: a unit output
written that way before its batch is reduced reads as what was written. Once reduced, a batch
keeps none of its tensors (``PreparedChecks.let_go``).

Alternatives considered:
    - Copying each held tensor into a staging buffer as its hook runs: a copy per call is the
      cost being saved, and the reference costs nothing while autograd keeps the tensor anyway.
    - Checking the held tensors as one concatenation on a CPU: copying unit outputs costs more
      than an ``aminmax`` over each, and each unit's value is read on its own (the headroom
      trend, the origin).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .prepared_checks import PreparedChecks

__all__ = ["HeldBlock", "HeldPlans"]

_VERSION = operator.attrgetter("_version")
_DTYPE = operator.attrgetter("dtype")


class HeldBlock:
    """Tensors of one stage and microbatch held for one batched check, in the order held.

    Attributes:
        stage: The probes' stage.
        microbatch: The backward passes of the iteration before the first was held.
        items: ``(where, tensor, when)`` each (tensors as the check reads them: plain, detached).
        versions: Each tensor's version counter when held.
    """

    __slots__ = ("stage", "microbatch", "items", "versions")

    def __init__(self, stage: str, microbatch: int) -> None:
        self.stage = stage
        self.microbatch = microbatch
        self.items: list[tuple[str, torch.Tensor, str]] = []
        self.versions: list[int] = []

    def hold(self, where: str, data: torch.Tensor, when: str) -> None:
        self.items.append((where, data, when))
        self.versions.append(data._version)

    def current(self) -> tuple[list[tuple[str, torch.Tensor, str]], list[str]]:
        """The items whose tensors were not written since held, and the places of those that were."""
        now = list(map(_VERSION, [data for _, data, _ in self.items]))
        if now == self.versions:
            return self.items, []
        kept = [item for item, held, seen in zip(self.items, self.versions, now, strict=True) if held == seen]
        written = [
            where for (where, _, _), held, seen in zip(self.items, self.versions, now, strict=True) if held != seen
        ]
        return kept, written


class HeldPlans:
    """The prepared list of each shape of batch (stage, places, dtypes, sizes, devices), kept
    across iterations and retargeted to each batch's tensors.

    Args:
        prepare: Makes the prepared list of ``(stage, items)`` (``items``: ``(where, tensor,
            when, group)`` each).
    """

    def __init__(self, prepare: Callable[[str, list[tuple[str, torch.Tensor, str, str]]], PreparedChecks]) -> None:
        self._prepare = prepare
        self._plans: dict[tuple[object, ...], PreparedChecks] = {}

    def prepared(self, stage: str, items: list[tuple[str, torch.Tensor, str]]) -> PreparedChecks:
        tensors = [data for _, data, _ in items]
        key = (
            stage,
            tuple(where for where, _, _ in items),
            tuple(when for _, _, when in items),
            tuple(map(_DTYPE, tensors)),
            tuple(map(torch.Tensor.numel, tensors)),
            tuple(t.device for t in tensors),
        )
        prepared = self._plans.get(key)
        if prepared is None:
            if len(self._plans) >= _KEPT_SHAPES:  # shapes that keep changing (variable sequence lengths)
                self._plans.clear()
            prepared = self._plans[key] = self._prepare(stage, [(where, t, when, "") for where, t, when in items])
        else:
            prepared.retarget(tensors)
        return prepared


# Batch shapes kept: a forward's, a second model's, and a few sequence lengths.
_KEPT_SHAPES = 16
