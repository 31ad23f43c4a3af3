"""An HF Accelerate FSDP2 script: the optimizer built before ``prepare`` shards the model.

On a CPU machine Accelerate runs DDP; the FSDP2 state a GPU machine gets is set on the
accelerator before ``prepare``, which then runs Accelerate's own FSDP2 preparation (sharding,
then the sharded parameters swapped into the optimizer's param groups).
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from tests.integration.zero_code import common

PLANTED = "model.layers.1.mlp.down_proj.weight"

accelerator = Accelerator()
accelerator.state.distributed_type = DistributedType.FSDP
accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(
    fsdp_version=2,
    mixed_precision_policy={"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32},
    auto_wrap_policy="transformer_based_wrap",
    transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
)
rank = dist.get_rank()
model = common.tiny_llama()
optimizer = torch.optim.AdamW(common.param_groups(model.named_parameters(), PLANTED), lr=common.LR)
model, optimizer = accelerator.prepare(model, optimizer)
common.print_losses(rank, common.train(model, optimizer, rank, backward=accelerator.backward))
accelerator.end_training()
