"""Optimizers built before sharding: refused, since they step parameters the model no longer uses.

``fully_shard`` (this package's and torch FSDP2's) registers new, sharded parameters in the
modules it shards. An optimizer constructed over ``model.parameters()`` before that keeps the
originals: they get no gradient, the optimizer steps nothing, and the model never trains, with
no error (FSDP2 behaves the same). ``fully_shard_optimizer`` refuses such an optimizer before
touching it, naming the parameter and the fix.
"""

from __future__ import annotations

import torch

from ..sharding import replaced_by_sharding

__all__ = ["refuse_replaced_parameters"]


def refuse_replaced_parameters(optimizer: torch.optim.Optimizer) -> None:
    """Raises if any of ``optimizer``'s parameters is one that sharding replaced.

    Raises:
        ValueError: Names the first such parameter, what replaced it, and how many there are.
    """
    found = []
    for g, group in enumerate(optimizer.param_groups):
        for i, param in enumerate(group["params"]):
            what = replaced_by_sharding(param)
            if what is not None:
                found.append((g, i, what))
    if found:
        g, i, what = found[0]
        raise ValueError(
            f"fully_shard_optimizer: param_groups[{g}]['params'][{i}] is {what}, which sharding replaced by a "
            f"sharded parameter ({len(found)} of the optimizer's parameters are such originals): this optimizer was built before "
            "fully_shard and would step parameters the model no longer uses, so the model would never train. "
            "Expected the sharded parameters: build the optimizer after fully_shard, over the sharded model's "
            "parameters()"
        )
