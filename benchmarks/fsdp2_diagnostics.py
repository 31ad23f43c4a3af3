"""Precision-diagnostics overhead on a ~25M-parameter model sharded by torch FSDP2.

One model (``torch.distributed.fsdp.fully_shard`` per block and the root, bf16 ``param_dtype``,
fp32 shards) and two AdamW optimizers over its parameters, both adapted with
``fully_shard_optimizer``: one with telemetry off (torch's step hooks), one with telemetry on
and the precision diagnostics on **every** step (``FSDP_PATCH_PRECISION_EVERY=1``, embedded
default exporters). Training steps alternate between them, so drift of the machine hits both
alike; the ratio is the median of on/off over adjacent pairs (target: at most 1.15).

Usage::

    python -m benchmarks.fsdp2_diagnostics [--steps 10] [--warmup 2]

Runs on one gloo rank in this process, or on the ranks of ``torchrun``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist

from fsdp_patch.demo.data import synthetic_batches
from fsdp_patch.demo.model import GPT, GPTConfig, lm_loss

from .common import paired_ratio, process_group

MODEL = GPTConfig(vocab=8192, dim=512, heads=8, layers=6, seq=64)
TARGET_RATIO = 1.15


def _fsdp2_model(config: GPTConfig) -> torch.nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = GPT(config)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def run(steps: int = 10, warmup: int = 2, batch: int = 16, config: GPTConfig = MODEL) -> dict[str, Any]:
    """Measures whole training steps and ``optimizer.step()`` alone, diagnostics on vs telemetry off.

    Runs on the caller's process group, or on a world-size-1 gloo group made for the call.

    Returns:
        Figures of rank 0 (every rank measures its own): parameter count, world size, steps,
        median step times in ms and the paired on/off ratios.
    """
    from fsdp_patch.optimizer import fully_shard_optimizer

    settings = {"FSDP_PATCH_SUMMARY": "none", "FSDP_PATCH_PRECISION_EVERY": "1"}
    with tempfile.TemporaryDirectory() as traces, process_group("cpu"), mock.patch.dict(
        os.environ, {**settings, "FSDP_PATCH_TRACE_DIR": traces}
    ):
        model = _fsdp2_model(config)
        optimizers = {}
        for telemetry_on in (False, True):
            optimizers[telemetry_on] = torch.optim.AdamW(model.parameters(), lr=1e-4)
            with mock.patch.dict(os.environ, {"FSDP_PATCH_TELEMETRY": "1" if telemetry_on else "0"}):
                fully_shard_optimizer(optimizers[telemetry_on])
        rank, world = dist.get_rank(), dist.get_world_size()
        batches = synthetic_batches(config, batch * world, steps + warmup)
        whole: dict[bool, list[float]] = {False: [], True: []}
        optimizer_only: dict[bool, list[float]] = {False: [], True: []}

        def train_step(telemetry_on: bool, tokens: torch.Tensor, record: bool) -> None:
            optimizer = optimizers[telemetry_on]
            start = time.perf_counter()
            lm_loss(model, tokens[rank * batch : (rank + 1) * batch]).backward()
            before_step = time.perf_counter()
            optimizer.step()
            end = time.perf_counter()
            optimizer.zero_grad()
            if record:
                whole[telemetry_on].append(time.perf_counter() - start)
                optimizer_only[telemetry_on].append(end - before_step)

        for index, tokens in enumerate(batches):
            # Alternate the order too, so neither side always runs on a warmer cache.
            for telemetry_on in (False, True) if index % 2 == 0 else (True, False):
                train_step(telemetry_on, tokens, record=index >= warmup)
        from fsdp_patch.telemetry import providers

        providers.uninstall()
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "world_size": world,
        "steps": steps,
        "step_ms_off": statistics.median(whole[False]) * 1e3,
        "step_ms_on": statistics.median(whole[True]) * 1e3,
        "step_ratio": paired_ratio(whole, True, False),
        "optimizer_step_ms_off": statistics.median(optimizer_only[False]) * 1e3,
        "optimizer_step_ms_on": statistics.median(optimizer_only[True]) * 1e3,
        "target_ratio": TARGET_RATIO,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16, help="sequences of 64 tokens per rank and step")
    args = parser.parse_args(argv)
    result = run(args.steps, args.warmup, args.batch)
    if not dist.is_initialized() or dist.get_rank() == 0:
        ratio = result["step_ratio"]
        print(f"FSDP2 model: {result['params'] / 1e6:.1f}M parameters, bf16 param_dtype, "
              f"{result['world_size']} rank(s), {result['steps']} steps each, diagnostics every step")
        print(f"  training step, telemetry off     : {result['step_ms_off']:9.1f} ms (median)")
        print(f"  training step, diagnostics on    : {result['step_ms_on']:9.1f} ms (median)")
        print(f"  overhead ratio on/off            : {ratio:9.4f}  ({(ratio - 1) * 100:+.1f}%, median of adjacent "
              f"pairs; target <= {TARGET_RATIO})")
        print(f"  of which optimizer.step(): off {result['optimizer_step_ms_off']:.1f} ms, "
              f"on {result['optimizer_step_ms_on']:.1f} ms")


if __name__ == "__main__":
    main()
