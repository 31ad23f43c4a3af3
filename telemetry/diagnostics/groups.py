"""What the precision diagnostics read of a parameter group, and the copy taken before a step.

No OpenTelemetry and nothing of the other diagnostics modules here: this is the bottom of the
diagnostics layer. Two kinds of groups are read:

* ``fsdp_patch``'s parameter groups (:class:`PrecisionView`): flat shard buffers of main weights,
  a materialized compute copy, and main grads;
* torch FSDP2's parameter groups (:class:`TensorListView`): lists of local shards, whose compute
  weights are what FSDP2 will cast them to at its next all-gather (``compute_dtype``); that cast
  is done by the diagnostics, per tensor, exactly as FSDP2 does it (``Tensor.to``).

Both are read through :func:`weights_of` as one :class:`GroupWeights`, so every later pass sees
main weights, compute weights (materialized, derived by a cast, or the main weights themselves)
and grads in one shape.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from fsdp_patch.torch_interop.torch_compat import foreach_clone

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


@runtime_checkable
class PrecisionView(Protocol):
    """A group of flat buffers; ``fsdp_patch``'s ``ParameterGroup`` satisfies it.

    Attributes:
        main_weight: 1-D flat shard buffer in the main dtype (fp32). Padding is zero and stays zero.
        compute_weight: 1-D flat buffer in the compute dtype, same layout and numel; may be the
            same tensor object as ``main_weight`` when the dtypes are equal. A group whose
            ``compute_per_gather`` is true keeps none between all-gathers: the diagnostics
            then derive it by casting ``main_weight``, as each all-gather does. A group whose
            ``float8`` is set keeps it in float8 with scales, which the diagnostics do not
            compare with the main weights (read as a group without a copy).
        main_grad: 1-D flat buffer in the main-grad dtype, same numel; ``None`` for frozen groups.
        process_group: Group the shards are split over; ``None`` when not distributed.
    """

    main_weight: torch.Tensor
    compute_weight: torch.Tensor
    main_grad: torch.Tensor | None
    process_group: ProcessGroup | None


@runtime_checkable
class TensorListView(Protocol):
    """A group of per-parameter shards; ``fsdp_patch.torch_interop.fsdp2.FSDP2Group`` (torch FSDP2) satisfies it.

    Attributes:
        main_weights: This rank's shards, which the optimizer updates.
        main_grads: This rank's grad shards (of the parameters that have one).
        compute_dtype: The dtype the shards are cast to for compute (FSDP2's
            ``MixedPrecisionPolicy.param_dtype``); ``None``: no cast, or not known.
        process_group: Group the shards are split over.
    """

    main_weights: Sequence[torch.Tensor]
    main_grads: Sequence[torch.Tensor]
    compute_dtype: torch.dtype | None
    process_group: ProcessGroup | None


@dataclass(frozen=True)
class GroupWeights:
    """What the diagnostics read of one group, whichever its kind.

    ``computes`` are materialized compute weights, one per main weight; ``None`` means they are
    derived by casting each main weight to ``compute_dtype``, or, when that is ``None`` too,
    that the compute weight is the main weight. ``grads`` holds one grad per main weight, in
    the same layout, ``None`` where there is none.
    """

    mains: tuple[torch.Tensor, ...]
    computes: tuple[torch.Tensor, ...] | None
    compute_dtype: torch.dtype | None
    grads: tuple[torch.Tensor | None, ...]


def _flat(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a 1-d tensor outside autograd: itself where it is one already (a diagnosed step
    flattens every parameter's tensors several times; most are plain and many 1-d)."""
    if t.requires_grad:
        t = t.detach()
    return t if t.dim() == 1 else t.reshape(-1)


def _aligned_grads(group: Any, mains: Sequence[torch.Tensor]) -> tuple[torch.Tensor | None, ...]:
    """One grad per main weight: ``local_grads`` where the group has them (FSDP2's, one per
    parameter), else ``main_grads`` (only the shards that have a grad) matched in order by size."""
    local = getattr(group, "local_grads", None)
    if local is not None:
        return tuple(None if g is None else _flat(g) for g in local)
    grads = [_flat(g) for g in group.main_grads]
    if len(grads) == len(mains):
        return tuple(grads)
    out: list[torch.Tensor | None] = []
    pending = iter(grads)
    grad = next(pending, None)
    for main in mains:
        if grad is not None and grad.numel() == main.numel():
            out.append(grad)
            grad = next(pending, None)
        else:
            out.append(None)
    return tuple(out)


def main_tensors(group: Any) -> list[torch.Tensor]:
    """A group's main weights as it holds them (no views made): whether they are the same tensors
    over the same memory tells that the group keeps its buffers."""
    if hasattr(group, "main_weights"):
        return list(group.main_weights)
    return [group.main_weight]


def present_grads(group: Any) -> list[torch.Tensor]:
    """A group's main grads as it holds them (no views made), where it has them."""
    if hasattr(group, "main_weights"):
        return list(group.main_grads)
    return [] if group.main_grad is None else [group.main_grad]


def replaced_grads(group: Any) -> list[torch.Tensor]:
    """A flat group's parameters' grads that are no view of its main-grad buffer (a grad a script
    replaced, ``p.grad = p.grad * s``: the one the optimizer steps with), as local shards; none for
    a tensor-list group, whose main grads are its parameters' own. Python per parameter: read only
    on a step where the parameters' grads moved."""
    if hasattr(group, "main_weights") or not hasattr(group, "params"):
        return []
    buffer = group.main_grad
    base = None if buffer is None else buffer.untyped_storage().data_ptr()
    out = []
    for param in group.params:
        grad = param.grad
        if grad is not None:
            local = getattr(grad, "_local_tensor", grad)
            if local.untyped_storage().data_ptr() != base:
                out.append(local)
    return out


def weights_of(group: Any, default_compute_dtype: torch.dtype | None) -> GroupWeights:
    """The tensors the diagnostics read of ``group`` (a :class:`PrecisionView` or
    :class:`TensorListView`); ``default_compute_dtype`` stands for a tensor-list group's
    ``compute_dtype`` when that is ``None``.

    Raises:
        ValueError: a flat group whose compute weight or grad has another numel than its main weight.
    """
    if hasattr(group, "main_weights"):
        mains = tuple(_flat(t) for t in group.main_weights)
        dtype = group.compute_dtype or default_compute_dtype
        if mains and dtype == mains[0].dtype:
            dtype = None
        return GroupWeights(mains, None, dtype, _aligned_grads(group, mains))
    main = _flat(group.main_weight)
    grads = (None if group.main_grad is None else _flat(group.main_grad),)
    if getattr(group, "compute_per_gather", False):
        # No copy is kept: every all-gather casts exactly this.
        return GroupWeights((main,), None, group.compute_weight.dtype, grads)
    if getattr(group, "float8", None) is not None:
        # A float8 copy holds each weight scaled (fsdp_patch.sharding.float8_copy). The refresh
        # checks' thresholds are a bf16/fp16 copy's, whose rounding, lost updates and flushed
        # small weights a float8 copy exceeds by design: its main weights and grads are read alone.
        return GroupWeights((main,), None, None, grads)
    computes: tuple[torch.Tensor, ...] | None = None
    if group.compute_weight is not group.main_weight:
        compute = _flat(group.compute_weight)
        if compute.numel() != main.numel():
            raise ValueError(
                f"precision diagnostics need equal numel: main_weight {main.numel()}, compute_weight {compute.numel()}"
            )
        computes = (compute,)
    if grads[0] is not None and grads[0].numel() != main.numel():
        raise ValueError(f"main_grad numel {grads[0].numel()} differs from main_weight numel {main.numel()}")
    return GroupWeights((main,), computes, None, grads)


@dataclass(frozen=True)
class PrecisionSnapshot:
    """Copies of the weights taken before the inner optimizer step.

    Attributes:
        main_weights: Per group, a clone of each main weight.
        compute_weights: Per group, a clone of each materialized compute weight; ``None`` where
            the compute weights are derived from the main weights (or are the main weights).
        default_compute_dtype: Compute dtype of tensor-list groups that name none.
    """

    main_weights: tuple[tuple[torch.Tensor, ...], ...]
    compute_weights: tuple[tuple[torch.Tensor, ...] | None, ...]
    default_compute_dtype: torch.dtype | None = None


def _same_layout(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(
        x.shape == y.shape and x.dtype == y.dtype and x.device == y.device for x, y in zip(a, b, strict=True)
    )


def take_snapshot(
    groups: Sequence[Any],
    default_compute_dtype: torch.dtype | None = None,
    reuse: PrecisionSnapshot | None = None,
) -> PrecisionSnapshot:
    """Copy the weights the lost-update ratio compares against.

    Args:
        groups: :class:`PrecisionView` or :class:`TensorListView` groups, in the order later
            passed to the diagnostics.
        default_compute_dtype: Compute dtype for tensor-list groups whose ``compute_dtype`` is
            ``None`` (given by the user, for example when the model runs under autocast).
        reuse: An earlier snapshot whose buffers are overwritten where the layout is unchanged
            (diagnostics every step: a new copy of the shards each step would fault in fresh
            pages every time, which costs more than the copy).

    Returns:
        The snapshot; it costs one extra copy of each local weight shard until released.
    """
    weights = [weights_of(g, default_compute_dtype) for g in groups]

    def copies(now: Sequence[torch.Tensor], old: Sequence[torch.Tensor] | None) -> tuple[torch.Tensor, ...]:
        if not now:
            return ()
        if old is not None and _same_layout(now, old):
            torch._foreach_copy_(list(old), list(now))
            return tuple(old)
        return tuple(foreach_clone(now))

    old_mains: tuple[tuple[torch.Tensor, ...], ...] | None = None
    old_computes: tuple[tuple[torch.Tensor, ...] | None, ...] | None = None
    if reuse is not None and len(reuse.main_weights) == len(weights):
        old_mains, old_computes = reuse.main_weights, reuse.compute_weights
    mains = tuple(copies(w.mains, old_mains[i] if old_mains else None) for i, w in enumerate(weights))
    computes = tuple(
        None if w.computes is None else copies(w.computes, old_computes[i] if old_computes else None)
        for i, w in enumerate(weights)
    )
    return PrecisionSnapshot(mains, computes, default_compute_dtype)


def first_process_group(groups: Sequence[Any]) -> ProcessGroup | None:
    """The process group of the first group that has one, else ``None``."""
    for group in groups:
        pg = getattr(group, "process_group", None)
        if pg is not None:
            return pg
    return None


def widest_mesh(groups: Sequence[Any]) -> Any:
    """The device mesh of most dimensions among the groups' sharded parameters (HSDP's
    ``(replicate, shard)``, tensor parallel x FSDP's ``(dp, tp)``), or ``None`` where no
    parameter is a DTensor. Its ranks are every rank the diagnostics' collectives join."""
    from torch.distributed.tensor import DTensor

    widest = None
    for group in groups:
        for param in getattr(group, "params", None) or ():
            if isinstance(param, DTensor) and (widest is None or param.device_mesh.ndim > widest.ndim):
                widest = param.device_mesh
    return widest


def mesh_coordinate(groups: Sequence[Any]) -> str | None:
    """This rank's place on :func:`widest_mesh`, where it has 2 or more dimensions (HSDP, tensor
    parallel x FSDP): ``name=index`` per dimension, in the mesh's order (``replicate=1,shard=0``;
    ``dim0=1,dim1=0`` where the mesh names none); ``None`` on a 1-D mesh, whose coordinate is the
    rank itself, or where no parameter is a DTensor."""
    widest = widest_mesh(groups)
    if widest is None or widest.ndim < 2:
        return None
    coordinate = widest.get_coordinate()
    if coordinate is None:
        return None
    names = widest.mesh_dim_names or tuple(f"dim{i}" for i in range(widest.ndim))
    return ",".join(f"{name}={index}" for name, index in zip(names, coordinate, strict=True))
