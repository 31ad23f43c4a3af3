"""FSDP2's all-gather extension on a parameter's tensor: honored for torchao's float8 weights,
refused, before anything changes, for every other.

torch FSDP2 lets a tensor subclass shape its own all-gather: ``fsdp_pre_all_gather(mesh, ...)``
turns the sharded tensor into the all-gather's inputs and metadata (torchao's float8 weights:
the fp8 data, with the scale as metadata), and ``fsdp_post_all_gather(outputs, metadata,
param_dtype, *, out=None)`` builds the unsharded parameter from the gathered outputs (torchao's
``Float8TrainingTensor``). FSDP2 calls them on the parameter itself, or on the local tensor of a
DTensor parameter that tensor parallelism placed.

[Note: all-gather extensions]
``fully_shard`` all-gathers a group's compute copy: one flat buffer in one dtype, laid out as
the group's shards and refreshed from the main weights (:mod:`.compute_copy`), into unsharded
parameters that are views of one flat buffer (:mod:`.flat_buffer`). A general extension asks
for something else at every all-gather: inputs of the subclass's own number and dtypes,
computed by the subclass from its sharded tensor (which here would be a plain view of the main
weights, the subclass and its state dropped), and an unsharded parameter of the subclass's
making, no view of the flat buffer. Sharding such a parameter as a plain one would drop the
extension silently (as ``fully_shard`` once did with torchao's
``enable_fsdp_float8_all_gather=True``, gathering bf16).

What torchao's tensorwise float8 weight (``WeightWithDynamicFloat8CastTensor``) asks of its
all-gather is known: the weight cast to float8 with one scale for the whole tensor, and a
``Float8TrainingTensor`` over the gathered data. That fits the flat layout as a compute copy in
float8 (:mod:`.float8_copy`), so such a weight is honored by making it one: :func:`float8_weight_of`
says which, :func:`check_all_gather_extension` refuses every other tensor defining either
method, and torchao's weights where the float8 copy does not apply (placed by tensor
parallelism, or under ``compute_copy="per_gather"``), naming the parameter, the class and the
alternatives. A tensor defining the extension that replaces a sharded parameter is checked the
same way (:mod:`.replacement`).

Alternatives considered:
    - Calling any extension per parameter at each all-gather, as FSDP2 does: a second gather
      path beside the flat one (inputs per parameter, outputs of any dtype, unsharded
      parameters that are no views of the flat buffer, ``out=`` re-gathers), each part of which
      the unsharding, the reduce and the diagnostics would have to know; not built.
    - Sharding the parameter as a plain tensor with a warning: the model would train, with the
      all-gather the user turned off, and a warning in a multi-rank log is easily missed.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

__all__ = ["Float8Weight", "check_all_gather_extension", "extension_methods", "float8_weight_of"]

# FSDP2's two methods, in the order it calls them.
_METHODS = ("fsdp_pre_all_gather", "fsdp_post_all_gather")
_TORCHAO_WEIGHT = ("torchao.float8.fsdp_utils", "WeightWithDynamicFloat8CastTensor")


@dataclass(frozen=True)
class Float8Weight:
    """What a group keeps of torchao's tensorwise float8 weights (one group per kind).

    Attributes:
        dtype: The float8 dtype the weight is cast to (``cast_config_weight.target_dtype``).
        mm_config: torchao's ``LinearMMConfig`` of its ``Float8Linear``, which the unsharded
            ``Float8TrainingTensor`` carries into the matmuls.
    """

    dtype: torch.dtype
    mm_config: Any


def extension_methods(tensor: torch.Tensor) -> tuple[str, ...]:
    """Which of FSDP2's all-gather extension methods the tensor FSDP2 would call them on
    defines: ``tensor`` itself, or a DTensor's local tensor (``()``: none)."""
    inner = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
    return tuple(name for name in _METHODS if hasattr(inner, name))


def _is_torchao_weight(tensor: torch.Tensor) -> bool:
    # The tensor exists, so torchao is imported if it is one of its weights: never imported here.
    module = sys.modules.get(_TORCHAO_WEIGHT[0])
    return module is not None and isinstance(tensor, getattr(module, _TORCHAO_WEIGHT[1]))


def float8_weight_of(tensor: torch.Tensor) -> Float8Weight | None:
    """The float8 copy ``tensor`` asks for: torchao's tensorwise float8 weight (not placed by
    tensor parallelism), or ``None``."""
    if isinstance(tensor, DTensor) or not _is_torchao_weight(tensor):
        return None
    return Float8Weight(tensor._dtype, tensor._linear_mm_config)  # type: ignore[attr-defined]


def _class_name(tensor: torch.Tensor) -> str:
    inner = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
    cls = type(inner)
    name = f"{cls.__module__}.{cls.__qualname__}"
    return f"a DTensor whose local tensor is a {name}" if isinstance(tensor, DTensor) else f"a {name}"


_FSDP2 = (
    "torch.distributed.fsdp.fully_shard calls the extension (its models get fsdp_patch's telemetry too; on gloo "
    "its float8 all-gather fails where a group's inputs are all float8, 'Invalid scalar type', or its shards are "
    "uneven)"
)


def _refuse(name: str, tensor: torch.Tensor, replacement: bool, why: str, alternatives: str) -> None:
    what, outcome = (
        ("was replaced by", "The sharded parameter was put back, its values unchanged.")
        if replacement
        else ("is", "Nothing was changed.")
    )
    raise TypeError(
        f"fully_shard: parameter '{name}' {what} {_class_name(tensor)}, which defines FSDP2's all-gather extension "
        f"({', '.join(extension_methods(tensor))}); {why}. {outcome} {alternatives}"
    )


def check_all_gather_extension(
    name: str,
    tensor: torch.Tensor,
    compute_copy: str = "persistent",
    float8: Float8Weight | None = None,
    replacement: bool = False,
) -> Float8Weight | None:
    """The float8 copy parameter ``name`` asks for (``None``: a plain tensor), refusing a tensor
    whose all-gather extension ``fully_shard`` cannot honor (see the note above).

    Args:
        name: The parameter's name, for the error.
        tensor: The parameter when ``fully_shard`` is applied, or with ``replacement`` the
            tensor that replaced the sharded parameter since.
        compute_copy: The policy's compute-copy lifetime.
        float8: With ``replacement``, the float8 copy of the replaced parameter's group: torchao's
            weight of that same kind may replace it.
        replacement: Whether ``tensor`` replaced a sharded parameter.

    Raises:
        TypeError: ``tensor`` defines ``fsdp_pre_all_gather`` or ``fsdp_post_all_gather`` and is
            not torchao's tensorwise float8 weight that a float8 copy keeps here.
    """
    if not extension_methods(tensor):
        return None
    wanted = float8_weight_of(tensor)
    torchao = _is_torchao_weight(tensor._local_tensor if isinstance(tensor, DTensor) else tensor)
    torchao_alternatives = (
        "Convert with Float8LinearConfig(enable_fsdp_float8_all_gather=False) (fully_shard then gathers the weight "
        "in the compute dtype and its Float8Linear casts it to float8 in forward), or shard with FSDP2: " + _FSDP2
    )
    if wanted is None and torchao:
        _refuse(
            name,
            tensor,
            replacement,
            "fully_shard keeps torchao's float8 weights as a float8 compute copy of its own, which it shards "
            "along dim 0 of plain parameters only, not of parameters tensor parallelism placed",
            torchao_alternatives,
        )
    if wanted is None:
        _refuse(
            name,
            tensor,
            replacement,
            "fully_shard honors no all-gather extension but torchao's tensorwise float8 weight "
            "(enable_fsdp_float8_all_gather=True): it all-gathers each unit's compute copy, one flat buffer cast "
            "from the main weights, into plain tensors, so this extension's own all-gather would be dropped",
            "fully_shard shards plain tensors and tensor-parallel DTensors of a floating-point dtype. Give the "
            f"parameter a plain tensor, or shard the model with FSDP2: {_FSDP2}",
        )
    if compute_copy == "per_gather":
        _refuse(
            name,
            tensor,
            replacement,
            "its float8 compute copy is persistent, refreshed after each optimizer step with one amax all-reduce, "
            "and MixedPrecisionPolicy(compute_copy='per_gather') keeps no copy",
            "Use compute_copy='persistent' (the default) for a model with float8 all-gathers. " + torchao_alternatives,
        )
    if replacement and wanted != float8:
        _refuse(
            name,
            tensor,
            replacement,
            f"the sharded parameter's all-gather is {'a plain one' if float8 is None else 'another float8 one'}, "
            f"fixed when fully_shard was applied, and this tensor asks for a float8 all-gather in {wanted.dtype} "  # type: ignore[union-attr]
            "with its Float8Linear's config",
            "Convert the model to float8 before fully_shard, or assign the values as a plain tensor.",
        )
    return wanted
