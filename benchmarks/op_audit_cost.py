"""The operation audit's and the float32 shadow's cost: an audited, a shadowed, and an audited and
shadowed training step against a plain one, and what that costs a run at the default schedule.

An audited iteration runs every bfloat16 operation again in float32 twice over (the reference on
its inputs and the shadow), with a few reductions each; a shadowed one runs each leaf module's
forward twice more in float32 (from the gathered fp32 main weights and from its compute weights)
and gathers each unit's main weights once. Both run on the second iteration and every
``FSDP_PATCH_PRECISION_AUDIT_EVERY``-th / ``FSDP_PATCH_PRECISION_SHADOW_EVERY``-th (default 1000 each:
the same iterations). The target is at most 1% of a run at the default schedule on case 5's
27M-parameter transformer (bf16 compute, fp32 main weights, AdamW), for ``fully_shard`` and torch
FSDP2: ``(both / plain - 1) / 1000`` at most 0.01. Nothing is added to an iteration that is neither
(no mode, no hook): what the plain step costs with telemetry on is ``benchmarks.telemetry_overhead``'s.

Identical models (one seed), telemetry on for all, one audited and shadowed every iteration, one
audited, one shadowed, one neither; steps alternate between them, and each ratio is the median of
per-round ratios. An audit and a shadow are process-wide from the end of one step to the end of the
next, so a model's are started right before its step and closed right after it (through the
adapter's registry: a benchmark's way in): the other models' steps run without them, and the
measured step pays for everything its iteration does, reading the statistics back and judging them
included.

Usage::

    python -m benchmarks.op_audit_cost [--steps 6] [--world-size 2] [--device cuda] [--small] [--json out.json]

``--small``: case 5's structure at width 16 (a quick look; its ratio says little of a real model's).
"""

from __future__ import annotations

import argparse
import os
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from fsdp_patch.app.demo.data import synthetic_batches
from fsdp_patch.app.demo.launch import run_ranks
from fsdp_patch.app.demo.model import GPT, GPTConfig, lm_loss
from fsdp_patch.telemetry import env

from .common import Clock, median, paired, paired_ratio, training_steps, write_results
from .telemetry_overhead import LARGE, _device, _quiet_telemetry

KINDS = ("fully_shard", "fsdp2")
# setting -> (audited, shadowed)
MEASURED = {"both": (True, True), "audited": (True, False), "shadowed": (False, True), "plain": (False, False)}
SETTINGS = {
    name: {
        "FSDP_PATCH_TELEMETRY": "1",
        "FSDP_PATCH_PRECISION_AUDIT_EVERY": "1" if audited else "0",
        "FSDP_PATCH_PRECISION_SHADOW_EVERY": "1" if shadowed else "0",
    }
    for name, (audited, shadowed) in MEASURED.items()
}
DEFAULT_EVERY = env.DEFAULT_PRECISION_AUDIT_EVERY
SMALL = GPTConfig(vocab=64, dim=16, heads=8, layers=6, seq=8)


def _trained(kind: str, config: GPTConfig, setting: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from fsdp_patch.optimizer import fully_shard_optimizer

    torch.manual_seed(0)
    model = GPT(config).to(_device())
    if kind == "fully_shard":
        from fsdp_patch.app.demo.model import shard

        model = shard(model.bfloat16())
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    with mock.patch.dict(os.environ, SETTINGS[setting]):
        fully_shard_optimizer(optimizer)
    return model, optimizer


def _iterations(optimizer: torch.optim.Optimizer) -> Any:
    from fsdp_patch.adapter import adaptation_of

    adaptation = adaptation_of(optimizer)
    assert adaptation is not None
    return adaptation.observer._iterations  # type: ignore[attr-defined]


def _measured_step(step: Any, setting: str, optimizer: torch.optim.Optimizer) -> Any:
    """``setting``'s step with its audit and shadow started right before it and closed right after."""
    iterations = _iterations(optimizer)
    audited, shadowed = MEASURED[setting]

    def run() -> float:
        if audited:
            iterations.audits.start()
        if shadowed:
            iterations.shadows.start()
        try:
            return float(step(setting))
        finally:
            iterations.audits.close()  # the next iteration's, begun at the step's end
            iterations.shadows.close()

    return run


def run(steps: int, warmup: int, config: GPTConfig = LARGE) -> dict[str, Any]:
    out: dict[str, Any] = {"params": sum(p.numel() for p in GPT(config).parameters()), "every": DEFAULT_EVERY}
    device = _device()
    clock = Clock(device)
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = [b[rank::world].to(device) for b in synthetic_batches(config, 4 * world, steps + warmup)]
    with _quiet_telemetry():
        for kind in KINDS:
            built = {s: _trained(kind, config, s) for s in SETTINGS}
            step = training_steps(built, batches, clock, lm_loss)
            measured = {setting: _measured_step(step, setting, built[setting][1]) for setting in SETTINGS}
            times = paired(measured, steps, warmup)
            ratios = {setting: paired_ratio(times, setting, "plain") for setting in MEASURED if setting != "plain"}
            out[kind] = {
                **{f"step_s_{setting}": median(times[setting]) for setting in SETTINGS},
                **{f"ratio_{setting}_plain": ratio for setting, ratio in ratios.items()},
                "amortized_at_default": 1 + (ratios["both"] - 1) / DEFAULT_EVERY,
            }
    return out


def bench(steps: int, warmup: int, json_path: str | None, small: bool = False) -> None:
    results = run(steps, warmup, SMALL if small else LARGE)
    if dist.get_rank() != 0:
        return
    print(
        f"operation audit and float32 shadow, {results['params'] / 1e6:.1f}M-parameter transformer, bf16 compute, "
        f"{_device().type}, {dist.get_world_size()} rank(s), {steps} paired steps; target: amortized at one audited and "
        f"shadowed iteration in {DEFAULT_EVERY} <= 1.01"
    )
    print()
    print(
        "| sharding | plain step | audited / plain | shadowed / plain | both / plain | a run at the default schedule |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for kind in KINDS:
        r = results[kind]
        print(
            f"| {kind} | {r['step_s_plain'] * 1e3:.0f} ms | {r['ratio_audited_plain']:.2f} "
            f"| {r['ratio_shadowed_plain']:.2f} | {r['ratio_both_plain']:.2f} | {r['amortized_at_default']:.4f} |"
        )
    if json_path:
        write_results(json_path, "op_audit_cost", {"steps": steps, **results})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: NCCL, one GPU per rank")
    parser.add_argument("--small", action="store_true", help="case 5's structure at width 16 (a quick look)")
    parser.add_argument("--json", default=None, help="write the figures as JSON here")
    args = parser.parse_args(argv)
    run_ranks(bench, args.world_size, args.steps, args.warmup, args.json, args.small, device=args.device)


if __name__ == "__main__":
    main()
