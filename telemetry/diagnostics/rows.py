"""The row of numbers one parameter contributes to a diagnosed step, and how rows travel.

No OpenTelemetry here. :mod:`~fsdp_patch.telemetry.diagnostics.param_stats` computes a float64
matrix with one row per parameter (:func:`param_table` says which parameter each row is), every
rank's rows are combined with one all-gather (:func:`gather_rows`, :func:`reduce_gathered`), and
the whole-model vector of :mod:`~fsdp_patch.telemetry.diagnostics.precision` is the sum of the
rows (:func:`totals`), so every number is computed once.

Row slots (the first :data:`WHOLE_MODEL_SLOTS` are the whole-model vector's, in its order):

* ``GRAD_NAN`` .. ``GRAD_AMAX``: the diagnostics of ``docs/conventions.md`` over this parameter's
  elements (``DIFF_SQ`` and ``MAIN_SQ``: the refresh error's squared norms; ``CHANGED`` and
  ``LOST``: the lost-update ratio's counts).
* ``UPDATE_SQ``: ``||main - main_before||²`` (finite elements): the step's update.
* ``NUMEL``: the parameter's elements on this rank.
* ``STATE_FLUSHED``: elements whose ``exp_avg_sq`` is 0 while their grad is not.
* ``STATE_NAN + 2 i``, ``STATE_INF + 2 i``: NaN and Inf elements of the parameter's i-th
  optimizer state tensor (at most :data:`MAX_STATES`).
* ``GRAD_ZERO``, ``GRAD_TINY``: grad elements that are exactly 0, and that are not 0 but below a
  dtype's smallest normal number (float16's, where a float16 backward runs without loss scaling:
  what it flushes or nearly flushes); both 0 where that is not measured.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fsdp_patch.module.model_units import group_prefix, user_name
from fsdp_patch.torch_interop.torch_compat import all_gather_flat

from .groups import weights_of

(
    GRAD_NAN,
    GRAD_INF,
    MAIN_NAN,
    MAIN_INF,
    COMPUTE_NAN,
    COMPUTE_INF,
    OVERFLOW,
    UNDERFLOW,
    DIFF_SQ,
    MAIN_SQ,
    CHANGED,
    LOST,
    GRAD_AMAX,
) = range(13)
WHOLE_MODEL_SLOTS = 13
UPDATE_SQ = 13
NUMEL = 14
STATE_FLUSHED = 15
STATE_NAN = 16
STATE_INF = 17
MAX_STATES = 4
"""State tensors per parameter whose non-finite elements are counted (Adam with amsgrad has 3)."""
STATE_END = STATE_NAN + 2 * MAX_STATES
GRAD_ZERO = STATE_END
GRAD_TINY = STATE_END + 1
ROW = STATE_END + 2

SECOND_MOMENT_KEY = "exp_avg_sq"
"""The state key whose flushed-to-zero elements are counted."""

GRAD_AMAX_NONFINITE = float(torch.finfo(torch.float32).max)
"""``GRAD_AMAX`` where some grad element is NaN or Inf: there is no finite largest value, and
OpenTelemetry gauges take finite numbers only; float32's largest finite number is off the scale
of any real gradient, so that NaN grads never read as vanishing ones."""


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter is in the diagnosed groups.

    Attributes:
        name: Its fully qualified name.
        unit: The fully qualified name of the sharded module holding it (``""``: the root).
        param: The sharded parameter (the optimizer's key for its state); ``None`` for groups
            that hold buffers only.
        group: Index of its group in the diagnosed groups.
        tensor: Index of its main tensor in that group (0 for a flat buffer).
        start: First element of its segment in that tensor.
        length: Elements of the segment on this rank (0 where this rank's shard is empty).
        compute_dtype: Dtype of its compute weight; ``None`` when that is the main weight.
        main_dtype: Dtype of its main weight.
        tp_split: Whether tensor parallelism splits it over the TP ranks (each holds other
            elements: its rows are summed over them) rather than copying it on each (counted once).
    """

    name: str
    unit: str
    param: torch.Tensor | None
    group: int
    tensor: int
    start: int
    length: int
    compute_dtype: torch.dtype | None
    main_dtype: torch.dtype
    tp_split: bool = False

    @property
    def lossy(self) -> bool:
        """Whether the compute dtype is narrower than the main dtype, so that updates can be lost."""
        return self.compute_dtype is not None and torch.finfo(self.compute_dtype).eps > torch.finfo(self.main_dtype).eps


@dataclass(frozen=True)
class StateTensor:
    """One optimizer state tensor of a parameter.

    Attributes:
        key: Its key in the parameter's state.
        index: Its index among the parameter's state tensors (< :data:`MAX_STATES`).
        local: This rank's local tensor, flattened.
        shows_in_weight: A NaN/Inf in it reaches the main weight within the step that wrote it
            (the optimizer's update is linear in it: Adam's ``exp_avg``, SGD's momentum), so it
            is counted only where the main weight holds NaN/Inf after the step.
    """

    key: str
    index: int
    local: torch.Tensor
    shows_in_weight: bool = False


def _unit_of_flat_group(group: Any) -> str:
    from fsdp_patch.module.shard_module import unit_name_of

    try:
        return unit_name_of(group)
    except TypeError:  # not weakly referable: a stand-in, not a ParameterGroup
        return ""


def param_table(
    groups: Sequence[Any], default_compute_dtype: torch.dtype | None = None, per_parameter: bool = True
) -> list[ParamSlot]:
    """One :class:`ParamSlot` per parameter of ``groups``, in group order, then parameter order.

    Groups with a ``layout`` (``fully_shard``'s) give one slot per parameter of their flat
    buffers, named by ``names``; tensor-list groups (FSDP2's) one per tensor, named by ``names``
    where they have them; a flat group without a layout is one slot. Stand-ins without names
    are named ``group{g}`` (and ``.{i}`` per tensor). ``per_parameter=False`` makes a flat
    group one slot (named after its first parameter): the whole-model diagnostics alone.
    """
    table: list[ParamSlot] = []
    for g, group in enumerate(groups):
        prefix = group_prefix(group)  # names as the module the user holds gives them
        w = weights_of(group, default_compute_dtype)
        dtype: torch.dtype | None = w.computes[0].dtype if w.computes is not None else w.compute_dtype
        splits: list[bool] = list(getattr(group, "tensor_parallel_split", None) or ())
        if hasattr(group, "main_weights"):
            names = list(getattr(group, "names", None) or [f"group{g}.{i}" for i in range(len(w.mains))])
            unit = getattr(group, "unit_name", "")
            params = list(getattr(group, "members", None) or [None] * len(w.mains))
            unit = user_name(prefix, unit)
            for i, main in enumerate(w.mains):
                name = user_name(prefix, names[i])
                split = bool(splits) and splits[i]
                table.append(ParamSlot(name, unit, params[i], g, i, 0, main.numel(), dtype, main.dtype, split))
            continue
        main = w.mains[0]
        layout = getattr(group, "layout", None)
        if layout is None or not per_parameter:
            names = getattr(group, "names", None) or [f"group{g}"]
            unit = "" if layout is None else user_name(prefix, _unit_of_flat_group(group))
            # fully_shard's groups hold parameters of one TP split each.
            table.append(
                ParamSlot(
                    user_name(prefix, names[0]), unit, None, g, 0, 0, main.numel(), dtype, main.dtype, any(splits)
                )
            )
            continue
        unit = user_name(prefix, _unit_of_flat_group(group))
        params = getattr(group, "params", None) or [None] * len(layout.params)
        for i, p in enumerate(layout.params):
            name = user_name(prefix, group.names[i])
            split = bool(splits) and splits[i]
            table.append(ParamSlot(name, unit, params[i], g, 0, p.offset, p.local_numel, dtype, main.dtype, split))
    return table


def slot_count(groups: Sequence[Any], per_parameter: bool = True) -> int:
    """The number of slots :func:`param_table` gives ``groups``, read from their sizes alone (so
    that a rank whose table could not be built still joins the collective with rows of that shape)."""
    count = 0
    for group in groups:
        if hasattr(group, "main_weights"):
            count += len(group.main_weights)
        else:
            layout = getattr(group, "layout", None)
            count += 1 if layout is None or not per_parameter else len(layout.params)
    return count


# -- across ranks ------------------------------------------------------------------------------


STATUS_RANK = 1
"""The column of a payload's status row that holds the global rank whose payload it is (summed,
and so meaningless, in a reduced payload)."""
STATUS_SECOND = 2
"""The column of a payload's status row that is 1 where the rank's rows need round 2 of
:mod:`~.param_stats` (a NaN/Inf to count or repair): summed, the ranks that need it."""


def payload(rows: torch.Tensor, second: torch.Tensor | None = None) -> torch.Tensor:
    """What a rank contributes to the collective: its rows and a status row (column 0: 1,
    computed; :data:`STATUS_RANK`: this rank; :data:`STATUS_SECOND`: ``second``, a device scalar,
    where given)."""
    import torch.distributed as dist

    status = torch.zeros((1, ROW), dtype=torch.float64, device=rows.device)
    status[0, 0] = 1.0
    status[0, STATUS_RANK] = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if second is not None:
        status[0, STATUS_SECOND] = second
    return torch.cat([rows, status])


def failed_payload(count: int, device: torch.device) -> torch.Tensor:
    """A payload of ``count`` rows that marks this rank's contribution as unknown (NaN), so that
    the rank still joins the collective with the shape the others send."""
    return torch.full((count + 1, ROW), math.nan, dtype=torch.float64, device=device)


def split_status(reduced: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """The rows of a reduced payload, and whether every rank computed its part."""
    return reduced[:-1], bool(math.isfinite(reduced[-1, 0].item()))


def totals(rows: torch.Tensor) -> torch.Tensor:
    """The whole-model stats vector of :mod:`~fsdp_patch.telemetry.diagnostics.precision` from (local or
    reduced) rows: sums, and the largest ``GRAD_AMAX``."""
    if rows.shape[0] == 0:
        return torch.zeros(WHOLE_MODEL_SLOTS, dtype=torch.float64, device=rows.device)
    vector = rows[:, :WHOLE_MODEL_SLOTS].sum(dim=0)
    vector[GRAD_AMAX] = rows[:, GRAD_AMAX].max()
    return vector


def gather_rows(local: torch.Tensor, process_group: Any) -> torch.Tensor:
    """Every rank's rows, ``(world, P, ROW)``, with one all-gather (``(1, P, ROW)`` alone).

    Every rank of ``process_group`` must call this on the same steps with rows of one shape.
    """
    import torch.distributed as dist

    if process_group is None or not (dist.is_available() and dist.is_initialized()):
        return local.unsqueeze(0)
    world = dist.get_world_size(process_group)
    if world == 1:
        return local.unsqueeze(0)
    # Flat output (the concatenation form): gloo rejects the stacked form.
    flat = torch.empty(world * local.numel(), dtype=local.dtype, device=local.device)
    all_gather_flat(flat, local.contiguous().view(-1), group=process_group)
    return flat.view(world, *local.shape)


def gathered_ranks(process_group: Any) -> list[int]:
    """The global rank whose rows each block of :func:`gather_rows`' output holds, in order.

    A process group of some ranks only (a 1-D mesh cut from a larger one) orders its blocks by
    rank within the group, which is not the global rank the spans and metrics name.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return [0]
    if process_group is None or dist.get_world_size(process_group) == 1:
        return [dist.get_rank()]
    return list(dist.get_process_group_ranks(process_group))


def reduce_gathered(gathered: torch.Tensor) -> torch.Tensor:
    """The global rows from :func:`gather_rows`: sums over ranks, the largest ``GRAD_AMAX``."""
    reduced = gathered.sum(dim=0)
    if gathered.shape[1]:
        reduced[:, GRAD_AMAX] = gathered[:, :, GRAD_AMAX].amax(dim=0)
    return reduced


def tensor_parallel_group(groups: Sequence[Any]) -> Any:
    """The process group of the TP mesh of the first group that tensor parallelism placed
    parameters of, else ``None``."""
    for group in groups:
        found = getattr(group, "tensor_parallel_group", None)
        if found is not None:
            return found
    return None


def combine_over_tensor_parallel(reduced: Any, table: Sequence[ParamSlot] | None, groups: Sequence[Any]) -> Any:
    """The rows of a payload reduced over the data-parallel ranks, combined over the tensor-
    parallel ranks too (an all-gather over the TP group; the rows as they are without one).

    Reducing over the ranks that shard a parameter covers this TP rank's elements only. A
    parameter tensor parallelism splits holds other elements on each TP rank: its rows are
    summed over them; one that every TP rank holds alike (plain, ``Replicate``) is counted once,
    from the first TP rank; ``GRAD_AMAX`` is the largest over them. The status row is summed, so
    that a rank whose part failed (NaN) marks the whole as failed. Without a table (this rank's
    failed) every row is summed: the result is marked failed anyway.
    """
    process_group = tensor_parallel_group(groups)
    if process_group is None:
        return reduced
    gathered = gather_rows(reduced, process_group)
    split = [True] * reduced.shape[0] if table is None else [slot.tp_split for slot in table] + [True]
    summed = torch.tensor(split, dtype=torch.bool, device=reduced.device).unsqueeze(1)
    combined = torch.where(summed, gathered.sum(dim=0), gathered[0])
    if reduced.shape[0] > 1:
        combined[:-1, GRAD_AMAX] = gathered[:, :-1, GRAD_AMAX].amax(dim=0)
    return combined
