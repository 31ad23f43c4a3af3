"""The multi-node recipe of docs/multi-node.md: HSDP, the mesh built from the node layout torchrun gives.

Run on every node (``torchrun --nnodes N --node-rank i --nproc-per-node G ...``): each node's G
ranks shard the model among them, the N nodes replicate it. ``--mesh R S`` sets the mesh's shape
instead, so that one node can run the same job (the tests compare the two).
"""

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from fsdp_patch import MixedPrecisionPolicy, fully_shard
from fsdp_patch.optimizer import fully_shard_optimizer

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from tests.integration.zero_code import common

parser = argparse.ArgumentParser()
parser.add_argument("--mesh", type=int, nargs=2, metavar=("REPLICAS", "SHARDS"))
args = parser.parse_args()

dist.init_process_group("gloo")
per_node = int(os.environ["LOCAL_WORLD_SIZE"])
shape = tuple(args.mesh) if args.mesh else (dist.get_world_size() // per_node, per_node)
mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))

model = common.tiny_llama()
policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
for layer in model.model.layers:
    fully_shard(layer, mesh=mesh, mp_policy=policy)
fully_shard(model, mesh=mesh, mp_policy=policy)
optimizer = torch.optim.AdamW(model.parameters(), lr=common.LR)
fully_shard_optimizer(optimizer)

rank = dist.get_rank()
common.print_losses(rank, common.train(model, optimizer, rank))
dist.barrier()
dist.destroy_process_group()
