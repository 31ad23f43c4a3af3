"""fsdp_patch: a minimal Megatron-FSDP path with a mixed-precision optimizer adapter.

``fully_shard`` keeps three sharded copies per parameter group: fp32 main weights the
optimizer updates, a persistent low-precision compute copy forward and backward gather, and
main grads in their own dtype, advertised through ``Tensor.grad_dtype``.
"""

# FSDP2's classes that fully_shard takes as FSDP2 does (or refuses, naming why), so that a script
# moving from torch.distributed.fsdp by changing its import finds every name it imported.
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

from .adapter import cast_buffer_bytes, keep_cast_buffers, remove_fully_shard_optimizer
from .mixed_precision import MixedPrecisionPolicy
from .module.forward_methods import register_fsdp_forward_method
from .module.fsdp_module import FSDPModule, UnshardHandle, share_comm_ctx
from .module.shard_module import fully_shard, parameter_groups
from .sharding import ParameterGroup, contained_in_parameter_group, parameter_group_of

__version__ = "0.1.0"

__all__ = [
    "CPUOffloadPolicy",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "ParameterGroup",
    "UnshardHandle",
    "cast_buffer_bytes",
    "contained_in_parameter_group",
    "fully_shard",
    "keep_cast_buffers",
    "parameter_group_of",
    "parameter_groups",
    "register_fsdp_forward_method",
    "remove_fully_shard_optimizer",
    "share_comm_ctx",
]

try:  # torch 2.13 and later
    from torch.distributed.fsdp import DataParallelMeshDims  # noqa: F401
except ImportError:  # pragma: no cover - older torch
    pass
else:
    __all__.append("DataParallelMeshDims")
