"""FSDP2's all-gather extension on a parameter's tensor: found, and refused before anything changes.

torch FSDP2 lets a tensor subclass shape its own all-gather: ``fsdp_pre_all_gather(mesh, ...)``
turns the sharded tensor into the all-gather's inputs and metadata (torchao's float8 weights:
the fp8 data, with the scale as metadata), and ``fsdp_post_all_gather(outputs, metadata,
param_dtype, *, out=None)`` builds the unsharded parameter from the gathered outputs (torchao's
``Float8TrainingTensor``). FSDP2 calls them on the parameter itself, or on the local tensor of a
DTensor parameter that tensor parallelism placed.

[Note: all-gather extensions]
``fully_shard`` all-gathers a group's compute copy: one flat buffer in one dtype, laid out as
the group's shards and cast from the fp32 main weights (:mod:`.compute_copy`), into unsharded
parameters that are plain views of one flat buffer (:mod:`.flat_buffer`). An extension asks for
something else at every all-gather: inputs of the subclass's own number and dtypes, computed by
the subclass from its sharded tensor (which here would be a plain view of the main weights, the
subclass and its state dropped), and an unsharded parameter of the subclass's making, no view of
the flat buffer. Sharding such a parameter as a plain one drops the extension: before this check
torchao's ``enable_fsdp_float8_all_gather=True`` trained with bf16 all-gathers and nothing said
so. A parameter whose tensor defines either method is therefore refused, when ``fully_shard`` is
applied (before the module is touched) and when it replaces a sharded parameter
(:mod:`.replacement`), naming the parameter, the class and the alternatives.

Alternatives considered:
    - Calling the extension per parameter at each all-gather, as FSDP2 does: a second gather
      path beside the flat one (inputs per parameter, outputs of any dtype, unsharded
      parameters that are no views of the flat buffer, ``out=`` re-gathers, grads of another
      type), each part of which the unsharding, the reduce and the diagnostics would have to
      know; not built.
    - Sharding the parameter as a plain tensor with a warning: the model would train, with the
      all-gather the user turned off, and a warning in a multi-rank log is easily missed.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

__all__ = ["EXTENSION_METHODS", "extension_methods", "refuse_all_gather_extension"]

# FSDP2's two methods, in the order it calls them.
EXTENSION_METHODS = ("fsdp_pre_all_gather", "fsdp_post_all_gather")


def extension_methods(tensor: torch.Tensor) -> tuple[str, ...]:
    """Which of FSDP2's all-gather extension methods the tensor FSDP2 would call them on
    defines: ``tensor`` itself, or a DTensor's local tensor (``()``: none)."""
    inner = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
    return tuple(name for name in EXTENSION_METHODS if hasattr(inner, name))


def _class_name(tensor: torch.Tensor) -> str:
    inner = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
    cls = type(inner)
    name = f"{cls.__module__}.{cls.__qualname__}"
    return f"a DTensor whose local tensor is a {name}" if isinstance(tensor, DTensor) else f"a {name}"


def _alternatives(tensor: torch.Tensor) -> str:
    inner = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
    fsdp2 = (
        "torch.distributed.fsdp.fully_shard calls the extension (its models get fsdp_patch's telemetry too; on gloo "
        "its all-gather of a group whose inputs are all float8 fails, 'Invalid scalar type')"
    )
    if type(inner).__module__.startswith("torchao.float8"):
        return (
            "For torchao's float8 training convert with Float8LinearConfig(enable_fsdp_float8_all_gather=False): "
            "fully_shard then gathers the weights in the compute dtype and each Float8Linear casts them to float8 "
            f"in its forward; or shard with FSDP2: {fsdp2}"
        )
    return f"Give the parameter a plain tensor, or shard the model with FSDP2: {fsdp2}"


def refuse_all_gather_extension(name: str, tensor: torch.Tensor, replacement: bool = False) -> None:
    """Raises if ``tensor``, parameter ``name`` when ``fully_shard`` is applied (or, with
    ``replacement``, the tensor that replaced the sharded parameter since), defines FSDP2's
    all-gather extension, which ``fully_shard`` does not call (see the note above).

    Raises:
        TypeError: It defines ``fsdp_pre_all_gather`` or ``fsdp_post_all_gather``.
    """
    methods = extension_methods(tensor)
    if not methods:
        return
    what, outcome = (
        ("was replaced by", "The sharded parameter was put back, its values unchanged.")
        if replacement
        else ("is", "Nothing was changed.")
    )
    raise TypeError(
        f"fully_shard: parameter '{name}' {what} {_class_name(tensor)}, which defines FSDP2's all-gather extension "
        f"({', '.join(methods)}); fully_shard does not support all-gather extensions: it all-gathers each unit's "
        "compute copy, one flat buffer in the compute dtype cast from the fp32 main weights, into plain tensors, so "
        f"the extension's own all-gather would be dropped. {outcome} fully_shard shards plain tensors and "
        f"tensor-parallel DTensors of a floating-point dtype. {_alternatives(tensor)}"
    )
