"""The grads an iteration has checked and not written since, which the step does not check again.

A grad checked already and not written since holds what that check saw: torch FSDP2's from its
reduce to the step, ``fully_shard``'s main grads copied from the reduce. Not checking it again saves
a pass over the grads in every iteration that writes nothing between. A grad is known by its tensor
(a weak reference: holding it would keep alive a main-grad buffer that its group frees) and "not
written" by its version counter unmoved: an unscale or a manual edit writes in place and moves it.
Grads are known for one iteration only.

[Note: a clip keeps checked grads checked]
``clip_grad_norm_`` writes every grad in place, at every step of most training scripts: where that
moves their version counters (a clip without foreach), the step would check them all again. It
multiplies them by ``min(1, max_norm / (norm + eps))``, and its total norm is checked (the clip's
own probe): where that norm is finite and ``max_norm`` positive the factor is finite and not zero,
and a grad is finite after the clip exactly where it was before (and the largest elements stay
non-zero: no such clip zeroes every group's grads, which
:func:`~..diagnostics.origin.zeroed_groups` looks for); where the norm is not finite, the clip's
probe is the first non-finite check, whatever the grads hold after it. So the grads checked and
unwritten as such a clip begins are recorded as checked again as it ends
(:meth:`CheckedGrads.before_clip`, :meth:`CheckedGrads.after_clip`). A clip by a ``max_norm`` that
is not a positive number zeroes the grads (or may): every grad is checked again at the step,
whatever the version counters say, for a foreach op on DTensor grads (the clip's, where foreach
runs) moves none of them. A clip that raises (its ``error_if_nonfinite``) records nothing.

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
from typing import cast

import torch

__all__ = ["CheckedGrads"]

_VERSION = operator.attrgetter("_version")
_REF = operator.itemgetter(0)
_HELD_VERSION = operator.itemgetter(1)
_DEREF = weakref.ref.__call__


class CheckedGrads:
    """The grads checked in the running iteration, each with its version as checked."""

    def __init__(self) -> None:
        self._versions: dict[int, tuple[weakref.ref[torch.Tensor], int]] = {}

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

    def unwritten(self) -> list[torch.Tensor]:
        """The grads checked and not written since (see [Note: a clip keeps checked grads checked])."""
        held = list(self._versions.values())
        found: list[torch.Tensor | None] = list(map(_DEREF, map(_REF, held)))
        if any(map(operator.is_, found, itertools.repeat(None))):
            alive = [(tensor, version) for tensor, (_, version) in zip(found, held, strict=True) if tensor is not None]
            tensors, versions = [tensor for tensor, _ in alive], [version for _, version in alive]
        else:
            tensors, versions = cast(list[torch.Tensor], found), list(map(_HELD_VERSION, held))
        return list(itertools.compress(tensors, map(operator.eq, map(_VERSION, tensors), versions)))

    def before_clip(self) -> list[torch.Tensor]:
        """What a clip by a positive factor keeps checked: the grads checked and unwritten as it
        begins ([Note: a clip keeps checked grads checked])."""
        return self.unwritten()

    def after_clip(self, unwritten: list[torch.Tensor] | None) -> None:
        """A clip has ended: the grads :meth:`before_clip` gave are checked again; ``None``, a clip
        by a factor that may be 0, leaves no grad checked."""
        if unwritten is None:
            self.clear()
        else:
            self.record(unwritten)

    def clear(self) -> None:
        self._versions.clear()
