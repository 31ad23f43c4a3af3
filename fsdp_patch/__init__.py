"""fsdp_patch: a minimal Megatron-FSDP path with a mixed-precision optimizer adapter.

``fully_shard`` keeps three sharded copies per parameter group: fp32 main weights the
optimizer updates, a persistent low-precision compute copy forward and backward gather, and
main grads in their own dtype, advertised through ``Tensor.grad_dtype``.
"""

from .adapter import remove_fully_shard_optimizer
from .mixed_precision import MixedPrecisionPolicy
from .module import FSDPModule, fully_shard, parameter_groups
from .parameter_group import ParameterGroup, contained_in_parameter_group, parameter_group_of

__all__ = [
    "FSDPModule",
    "MixedPrecisionPolicy",
    "ParameterGroup",
    "contained_in_parameter_group",
    "fully_shard",
    "parameter_group_of",
    "parameter_groups",
    "remove_fully_shard_optimizer",
]
