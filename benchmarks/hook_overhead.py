"""Per-step cost of ``fully_shard``'s forward/backward hooks, where nothing else costs much.

A stack of tiny sharded units (one process, world size 1, so no collective waits on another
rank) runs forward and backward; the median step time divided by the number of units is what
the hooks, the gather copy and the grad pack/reduce cost per unit. An unsharded copy of the same
model runs alternately in the same process, so the ratio cancels the machine's drift.

    python -m benchmarks.hook_overhead

The suite (``python -m benchmarks``) runs it as part of case 4.
"""

from __future__ import annotations

import datetime
import os
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

UNITS = 32
DIM = 16
ROUNDS = 300


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for _ in range(UNITS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _step(model: nn.Module, x: torch.Tensor) -> float:
    start = time.perf_counter()
    model(x).sum().backward()
    return time.perf_counter() - start


def run(rounds: int = ROUNDS) -> dict[str, Any]:
    """Median forward+backward step of the sharded and the unsharded stack, paired.

    Args:
        rounds: Measured rounds (after 20 unmeasured ones).
    """
    from fsdp_patch import fully_shard

    owns_group = not dist.is_initialized()
    if owns_group:
        tmp = tempfile.mkdtemp()
        dist.init_process_group(
            "gloo",
            init_method=f"file://{os.path.join(tmp, 'rdv')}",
            rank=0,
            world_size=1,
            timeout=datetime.timedelta(seconds=60),
        )
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        plain, sharded = _Stack(), _Stack()
        for layer in sharded.layers:
            fully_shard(layer)
        fully_shard(sharded)
        x = torch.randn(4, DIM)
        pairs = []
        for round_index in range(rounds + 20):
            a, b = _step(sharded, x), _step(plain, x)
            for model in (plain, sharded):
                model.zero_grad(set_to_none=True)
            if round_index >= 20:  # warm-up
                pairs.append((a, b))
        sharded_s = statistics.median(a for a, _ in pairs)
        plain_s = statistics.median(b for _, b in pairs)
        return {
            "units": UNITS,
            "sharded_step_ms": sharded_s * 1e3,
            "unsharded_step_ms": plain_s * 1e3,
            "ratio": statistics.median(a / b for a, b in pairs),
            "overhead_per_unit_us": (sharded_s - plain_s) / (UNITS + 1) * 1e6,
        }
    finally:
        torch.set_num_threads(threads)
        if owns_group:
            dist.destroy_process_group()


def main() -> None:
    result = run()
    print(
        f"fully_shard hooks, {result['units']} units + root, world size 1: "
        f"{result['sharded_step_ms']:.2f} ms sharded vs {result['unsharded_step_ms']:.2f} ms unsharded per "
        f"forward+backward (ratio {result['ratio']:.2f}); {result['overhead_per_unit_us']:.0f} µs per unit"
    )


if __name__ == "__main__":
    main()
