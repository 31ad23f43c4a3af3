"""Sharding in layers: how ``fully_shard`` keeps a unit's parameters, from geometry to policy.

Each layer imports only the ones listed before it:

- :mod:`.all_gather_extension`: FSDP2's all-gather extension on a parameter's tensor: torchao's
  tensorwise float8 weight recognized (honored by the float8 copy below), every other refused
  before anything is sharded;
- :mod:`.layout`: where each parameter's ``Shard(0)`` rows lie in a flat buffer (pure geometry);
- :mod:`.dtensors`: cached ``DTensorSpec`` objects and the DTensor wrapper over a buffer's views;
- :mod:`.flat_buffer`: buffers whose storage is freed and re-materialized in place, with local,
  DTensor and unsharded-parameter views;
- :mod:`.collectives`: all-gather and reduce-scatter handles (issue, wait, free);
- :mod:`.main_grads`: the main-grad buffer, its ownership, and per-parameter grad presence;
- :mod:`.compute_copy`, :mod:`.float8_copy` and :mod:`.replacement`: the compute-dtype copy the
  gathers read (or torchao's float8 weights in float8 with their scales), and the values a group
  takes from tensors that replaced its parameters;
- :mod:`.unsharding` and :mod:`.grad_reduce`: the all-gathers into the unsharded parameters
  (kept, partly kept after forward, freed), and the reduces of their grads into ``main_grad``
  (reduce-scatter, HSDP's all-reduce, microbatches without sync);
- :mod:`.parameter_group`: the policy composing them (compute-copy freshness and refresh,
  when to gather, free and reduce);
- :mod:`.registry`: which group manages a sharded parameter, and which originals sharding replaced.

The unit above (:mod:`fsdp_patch.module.unit`) drives groups through an iteration; the optimizer
adapter (:mod:`fsdp_patch.adapter`) reads and lends their grads.
"""

from .parameter_group import ParameterGroup
from .registry import (
    contained_in_parameter_group,
    parameter_group_of,
    record_replaced,
    register_group,
    replaced_by_sharding,
    replaced_original,
)

__all__ = [
    "ParameterGroup",
    "contained_in_parameter_group",
    "parameter_group_of",
    "record_replaced",
    "register_group",
    "replaced_by_sharding",
    "replaced_original",
]
