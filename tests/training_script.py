"""The text of a small training script that tests run in a fresh interpreter."""

from __future__ import annotations


def one_rank_training(steps: int, *, adapt: bool = True, after: str = "") -> str:
    """A script: one gloo rank, a bf16 MLP sharded by ``fully_shard``, AdamW over it (adapted with
    ``fully_shard_optimizer`` when ``adapt``; else left to an instrumentor), ``steps`` training steps
    whose losses it keeps in ``losses``, then the lines ``after``, then the group destroyed."""
    adapting = "fully_shard_optimizer(optimizer)\n" if adapt else ""
    return (
        "import os, sys, tempfile\n"
        "import torch, torch.distributed as dist\n\n"
        'dist.init_process_group("gloo", init_method="file://" + os.path.join(tempfile.mkdtemp(), "init"), '
        "rank=0, world_size=1)\n"
        "from fsdp_patch import fully_shard\n"
        "from fsdp_patch.optimizer import fully_shard_optimizer\n\n"
        "torch.manual_seed(0)\n"
        "model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)).bfloat16()\n"
        "fully_shard(model)\n"
        "optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)\n"
        f"{adapting}"
        "x, y = torch.randn(32, 8).bfloat16(), torch.randn(32, 1).bfloat16()\n"
        "losses = []\n"
        f"for _ in range({steps}):\n"
        "    loss = torch.nn.functional.mse_loss(model(x).float(), y.float())\n"
        "    loss.backward()\n"
        "    optimizer.step()\n"
        "    optimizer.zero_grad()\n"
        "    losses.append(loss.item())\n"
        f"{after}"
        "dist.destroy_process_group()\n"
    )
