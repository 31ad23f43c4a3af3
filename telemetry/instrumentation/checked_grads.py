"""The grads an iteration has checked and not written since, which the step does not check again.

A grad checked already and not written since holds what that check saw: torch FSDP2's from its
reduce to the step, ``fully_shard``'s main grads copied from the reduce. Not checking it again saves
a pass over the grads in every iteration that writes nothing between. A grad is known by its tensor
(a weak reference: holding it would keep alive a main-grad buffer that its group frees) and "not
written" by version counters unmoved: its own (a write into the shard) and that of its parameter's
grad (a write through the DTensor: [Note: a grad written through its DTensor]). Grads are known for
one iteration only.

[Note: a grad written through its DTensor]
An in-place op on a DTensor grad (``p.grad.mul_(s)``, ``p.grad.zero_()``, ``p.grad[i] = x``) moves
the DTensor's version counter and not its local shard's, which the reduce checked; a write into
the shard moves the shard's only. So the parameters' grads are also recorded as each backward of
the model leaves them, by their own counters (:meth:`CheckedGrads.snapshot`), and a step where one
of them was written, replaced, added or dropped since checks every grad again
(:meth:`CheckedGrads.moved`), with, under ``fully_shard``, the grads that are no view of their
group's main-grad buffer (a grad replaced: what the optimizer steps with). A foreach op on DTensors moves neither counter: the clip below is the
one such write telemetry sees (it wraps the clip).

[Note: a clip that zeroes the grads]
``clip_grad_norm_`` multiplies every grad by ``min(1, max_norm / (norm + eps))`` in place: as a
foreach op (its default where foreach runs), which moves no counter, or grad by grad
(``foreach=False``), which moves the DTensors'. By a positive ``max_norm`` neither needs a check
of the grads: the clip's total norm is checked (its own probe), and where it is finite the factor
is finite and not zero, so a grad is finite after the clip exactly where it was before and the
largest elements stay non-zero; where it is not finite, the clip's probe is the first non-finite
check. So after such a clip of grads nothing else wrote since the backward, the snapshot is taken
again. A ``max_norm`` that is not a positive number zeroes every grad (or may), which
:func:`~..diagnostics.origin.zeroed_groups` finds only from the grads at the step: after such a
clip nothing is known as checked (:meth:`CheckedGrads.clear`), and the step checks every grad
again.

[Note: grads compared in C-level calls]
Torch FSDP2 holds a grad per parameter: the lists here are compared by ``map`` over C-level
getters and ``operator`` functions, not a Python frame per grad; a list with a grad not recorded,
or written, is then told apart grad by grad.
"""

from __future__ import annotations

import itertools
import operator
import weakref
from collections.abc import Sequence

import torch

__all__ = ["CheckedGrads"]

_VERSION = operator.attrgetter("_version")
_GRAD = operator.attrgetter("grad")
_REF = operator.itemgetter(0)
_HELD_VERSION = operator.itemgetter(1)
_DEREF = weakref.ref.__call__


class CheckedGrads:
    """The grads checked in the running iteration, each with its version as checked."""

    def __init__(self) -> None:
        self._versions: dict[int, tuple[weakref.ref[torch.Tensor], int]] = {}
        # The parameters' grads as the last backward left them, and their versions then.
        # By id: a grad replaced by a tensor at the address of the one gone, at its version, is
        # also a new local shard, which :meth:`written` finds.
        self._outer: tuple[list[int], list[int]] | None = None

    def record(self, tensors: Sequence[torch.Tensor]) -> None:
        """``tensors`` (plain grads: local shards) are checked as they are now."""
        held = zip(map(weakref.ref, tensors), map(_VERSION, tensors), strict=True)
        self._versions.update(zip(map(id, tensors), held, strict=True))

    def unchanged(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` was checked and not written since."""
        held = self._versions.get(id(tensor))
        return held is not None and held[0]() is tensor and held[1] == tensor._version

    def written(self, tensors: Sequence[torch.Tensor]) -> list[int]:
        """The places in ``tensors`` of those not checked, or written since."""
        held = list(map(self._versions.get, map(id, tensors)))
        if None not in held and all(map(operator.is_, map(_DEREF, map(_REF, held)), tensors)):  # type: ignore[arg-type]
            versions = list(map(_VERSION, tensors))
            if versions == list(map(_HELD_VERSION, held)):  # type: ignore[arg-type]
                return []
        return [place for place, tensor in enumerate(tensors) if not self.unchanged(tensor)]

    def snapshot(self, params: Sequence[torch.Tensor]) -> None:
        """The grads of ``params`` as they are now, by their own version counters (see [Note: a
        grad written through its DTensor])."""
        present = _present_grads(params)
        self._outer = (list(map(id, present)), list(map(_VERSION, present)))

    def moved(self, params: Sequence[torch.Tensor]) -> bool:
        """Whether a grad of ``params`` was written, replaced, added or dropped since the last
        :meth:`snapshot` (``False`` where none was taken)."""
        if self._outer is None:
            return False
        ids, versions = self._outer
        present = _present_grads(params)
        return list(map(id, present)) != ids or list(map(_VERSION, present)) != versions

    def clear(self) -> None:
        """Nothing is known as checked (the iteration ended, or a clip zeroed the grads)."""
        self._versions.clear()
        self._outer = None


def _present_grads(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    grads = list(map(_GRAD, params))
    return list(itertools.compress(grads, map(operator.is_not, grads, itertools.repeat(None))))
