"""Precision-diagnostics overhead on a ~25M-parameter model sharded by torch FSDP2.

One model (``torch.distributed.fsdp.fully_shard`` per block and the root, bf16 ``param_dtype``,
fp32 shards) and three AdamW optimizers over its parameters, all adapted with
``fully_shard_optimizer``: one with telemetry off (a ``NullObserver``), one with telemetry on and
the whole-model precision diagnostics on **every** step (``FSDP_PATCH_PRECISION_EVERY=1``,
``FSDP_PATCH_PRECISION_TOP_K=0``, embedded default exporters), one with the per-parameter
attribution too (the default). Training steps rotate between them, so drift of the machine hits
all alike; ratios are medians over rounds (targets: attribution at most 1.15x telemetry off and
1.05x the whole-model diagnostics).

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
from fsdp_patch.app.demo.data import synthetic_batches
from fsdp_patch.app.demo.model import GPT, GPTConfig, lm_loss

from .common import paired_ratio, process_group

MODEL = GPTConfig(vocab=8192, dim=512, heads=8, layers=6, seq=64)
TARGET_RATIO = 1.15
TARGET_RATIO_WHOLE_MODEL = 1.05
# Setting -> the environment its optimizer is adapted under (FSDP_PATCH_PRECISION_EVERY=1 for all).
SETTINGS: dict[str, dict[str, str]] = {
    "off": {"FSDP_PATCH_TELEMETRY": "0"},
    "diagnostics": {"FSDP_PATCH_TELEMETRY": "1", "FSDP_PATCH_PRECISION_TOP_K": "0"},
    "attribution": {"FSDP_PATCH_TELEMETRY": "1"},
}


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
        median step times in ms per setting and the paired ratios (``step_ratio``: attribution
        over off).
    """
    from fsdp_patch.optimizer import fully_shard_optimizer

    # The per-iteration checks watch the shared model: off, so that each setting carries its own cost.
    settings = {"FSDP_PATCH_SUMMARY": "none", "FSDP_PATCH_PRECISION_EVERY": "1", "FSDP_PATCH_PRECISION_ORIGIN": "off"}
    with (
        tempfile.TemporaryDirectory() as traces,
        process_group("cpu"),
        mock.patch.dict(os.environ, {**settings, "FSDP_PATCH_TRACE_DIR": traces}),
    ):
        model = _fsdp2_model(config)
        optimizers = {}
        for setting, environment in SETTINGS.items():
            optimizers[setting] = torch.optim.AdamW(model.parameters(), lr=1e-4)
            with mock.patch.dict(os.environ, environment):
                fully_shard_optimizer(optimizers[setting])
        rank, world = dist.get_rank(), dist.get_world_size()
        batches = synthetic_batches(config, batch * world, steps + warmup)
        whole: dict[str, list[float]] = {setting: [] for setting in SETTINGS}
        optimizer_only: dict[str, list[float]] = {setting: [] for setting in SETTINGS}

        def train_step(setting: str, tokens: torch.Tensor, record: bool) -> None:
            optimizer = optimizers[setting]
            start = time.perf_counter()
            lm_loss(model, tokens[rank * batch : (rank + 1) * batch]).backward()
            before_step = time.perf_counter()
            optimizer.step()
            end = time.perf_counter()
            optimizer.zero_grad()
            if record:
                whole[setting].append(time.perf_counter() - start)
                optimizer_only[setting].append(end - before_step)

        names = list(SETTINGS)
        for index, tokens in enumerate(batches):
            # Rotate the order too, so that no setting always runs on a warmer cache.
            shift = index % len(names)
            for setting in names[shift:] + names[:shift]:
                train_step(setting, tokens, record=index >= warmup)
        from fsdp_patch.telemetry.export import providers

        providers.uninstall()
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "world_size": world,
        "steps": steps,
        **{f"step_ms_{setting}": statistics.median(whole[setting]) * 1e3 for setting in SETTINGS},
        **{f"optimizer_step_ms_{setting}": statistics.median(optimizer_only[setting]) * 1e3 for setting in SETTINGS},
        "step_ratio": paired_ratio(whole, "attribution", "off"),
        "step_ratio_diagnostics": paired_ratio(whole, "diagnostics", "off"),
        "step_ratio_attribution_diagnostics": paired_ratio(whole, "attribution", "diagnostics"),
        "target_ratio": TARGET_RATIO,
        "target_ratio_whole_model": TARGET_RATIO_WHOLE_MODEL,
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
        print(
            f"FSDP2 model: {result['params'] / 1e6:.1f}M parameters, bf16 param_dtype, "
            f"{result['world_size']} rank(s), {result['steps']} steps each, diagnostics every step"
        )
        for setting in SETTINGS:
            print(
                f"  training step, {setting:<12}: {result[f'step_ms_{setting}']:9.1f} ms (median), "
                f"optimizer.step() {result[f'optimizer_step_ms_{setting}']:.1f} ms"
            )
        print(f"  attribution / off            : {ratio:9.4f}  (median over rounds; target <= {TARGET_RATIO})")
        print(
            f"  attribution / whole-model    : {result['step_ratio_attribution_diagnostics']:9.4f}  "
            f"(target <= {TARGET_RATIO_WHOLE_MODEL})"
        )


if __name__ == "__main__":
    main()
