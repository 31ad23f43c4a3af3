"""A plain torch FSDP2 script: bf16 compute, fp32 reduce, AdamW built after sharding."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from tests.integration.zero_code import common

PLANTED = "model.layers.1.mlp.down_proj.weight"

dist.init_process_group("gloo")
rank = dist.get_rank()
model = common.tiny_llama()
policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
for layer in model.model.layers:
    fully_shard(layer, mp_policy=policy)
fully_shard(model, mp_policy=policy)
optimizer = torch.optim.AdamW(common.param_groups(model.named_parameters(), PLANTED), lr=common.LR)
common.print_losses(rank, common.train(model, optimizer, rank))
dist.destroy_process_group()
