"""What an adapted optimizer's step checks read of its parameter groups: each group's name, and
the main weights checked before and after the update.

:class:`~.iterations.IterationWatch` makes a :class:`StepTensors` of the groups it steps and keeps
it while the groups keep their buffers; each step hands :attr:`StepTensors.before` and
:attr:`StepTensors.after` to the model watches' checks (:mod:`.model_watch`) and reads from the
main weights' version counters which groups were written between steps.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch

from fsdp_patch.module.model_units import group_prefix, user_name

from .. import semconv
from ..diagnostics.groups import main_tensors, weights_of
from ..diagnostics.probes import AFTER, BEFORE, POOL_LIST, PreparedChecks
from ..diagnostics.rows import ParamSlot

__all__ = ["StepTensors", "group_name", "tensors_key"]


def group_name(group: Any) -> str:
    """The group's unit as the module the user holds names it (as the model watch names units)."""
    if hasattr(group, "main_weights"):
        return user_name(group_prefix(group), str(getattr(group, "unit_name", "")))
    from fsdp_patch.module.shard_module import unit_name_of

    return user_name(group_prefix(group), unit_name_of(group))


class StepTensors:
    """What the step's checks read of the optimizer's groups, made once for as long as the groups
    keep their buffers (:attr:`key`: a load into new tensors, a re-sharding, makes new ones).
    Tensors a group replaced stay referenced here until the next step makes these again:
    ``fully_shard`` never replaces its main weights (loads copy into them), torch FSDP2 only where
    it resets a parameter's local shard (a load with ``assign=True``, ``to_empty``).

    Attributes:
        key: Each main weight's identity and address, group by group.
        mains: Each group's main weights as it holds them (their version counters tell writes).
        before: Each main weight, checked before the update: a parameter's own, or a flat buffer
            of several, checked as one and read as the parameter of a non-finite element.
        after: Each group's main weights, checked after it.
        accumulation: Per group, its name and the dtype its grads sum microbatches in.
        after_versions: Per group, its main weights' versions after the last update checked
            (``None``: none checked yet).
    """

    def __init__(
        self, key: tuple[int, ...], groups: Sequence[Any], names: Sequence[str], table: Sequence[ParamSlot]
    ) -> None:
        self.key = key
        self.mains = [main_tensors(group) for group in groups]
        before: list[tuple[str, torch.Tensor, str, str]] = []
        segments: list[list[tuple[int, str]] | None] = []
        after: list[tuple[str, torch.Tensor, str, str]] = []
        slots: dict[tuple[int, int], list[ParamSlot]] = {}
        for slot in table:
            slots.setdefault((slot.group, slot.tensor), []).append(slot)
        for index, group in enumerate(groups):
            mains = weights_of(group, None).mains
            for number, main in enumerate(mains):
                held = slots.get((index, number), [])
                if len(held) == 1 and held[0].start == 0 and held[0].length == main.numel():
                    before.append((held[0].name, main, BEFORE, names[index]))
                    segments.append(None)
                else:
                    # A flat buffer: one reduction, which still names the parameter of a
                    # non-finite element (probe_plans' LOCATED).
                    before.append((names[index], main, BEFORE, names[index]))
                    segments.append(sorted((slot.start, slot.name) for slot in held))
                after.append((names[index], main, AFTER, ""))
        # What the origin reads of the main weights is whether they are finite.
        self.before = PreparedChecks(semconv.ORIGIN_WEIGHT_WRITE, before, segments, pooled=POOL_LIST)
        self.after = PreparedChecks(semconv.ORIGIN_WEIGHT_WRITE, after, pooled=POOL_LIST)
        self.accumulation = [(names[index], _accumulation_dtype(group)) for index, group in enumerate(groups)]
        self.after_versions: list[list[int]] | None = None

    def record_versions(self) -> None:
        """The main weights as the update left them (after their check)."""
        self.after_versions = [list(map(_VERSION, mains)) for mains in self.mains]

    def written(self) -> list[int]:
        """The groups whose main weights were written in place since the update checked last."""
        if self.after_versions is None:
            return []
        return [
            index
            for index, (mains, versions) in enumerate(zip(self.mains, self.after_versions, strict=True))
            if list(map(_VERSION, mains)) != versions
        ]


# Read of every main weight at every step (torch FSDP2 holds one per parameter): C-level calls.
_VERSION = operator.attrgetter("_version")


def tensors_key(groups: Sequence[Any]) -> tuple[int, ...]:
    mains = [t for group in groups for t in main_tensors(group)]
    return (*map(id, mains), *map(torch.Tensor.data_ptr, mains))


def _accumulation_dtype(group: Any) -> torch.dtype | None:
    """The dtype a group's grads sum microbatches in: ``fully_shard``'s main-grad dtype, torch
    FSDP2's reduce dtype."""
    if hasattr(group, "fsdp_group"):
        # FSDP2 keeps no reduce dtype where it equals the parameters' compute dtype.
        return getattr(group.fsdp_group, "_reduce_dtype", None) or group.compute_dtype
    return getattr(group, "grads_dtype", None)
