"""A fsdp_patch ``fully_shard`` script: fp32 main weights, bf16 compute weights and grads, the adapter."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from fsdp_patch import fully_shard
from fsdp_patch.optimizer import fully_shard_optimizer

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from tests.integration.zero_code import common

PLANTED = "model.layers.1.mlp.down_proj.weight"

dist.init_process_group("gloo")
rank = dist.get_rank()
model = common.tiny_llama().bfloat16()
for layer in model.model.layers:
    fully_shard(layer)
fully_shard(model)
optimizer = torch.optim.AdamW(common.param_groups(model.named_parameters(), PLANTED), lr=common.LR)
fully_shard_optimizer(optimizer)
common.print_losses(rank, common.train(model, optimizer, rank))
dist.destroy_process_group()
