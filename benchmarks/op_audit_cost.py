"""The operation audit's cost: an audited training step against a plain one, and what that costs a
run at the default schedule.

An audited iteration runs every bfloat16 operation again in float32 twice over (the reference on
its inputs and the shadow), with a few reductions each; it runs on the second iteration, every
``FSDP_PATCH_PRECISION_AUDIT_EVERY``-th (default 1000) and every escalated one. The target is at most
1% of a run at the default schedule on case 5's 27M-parameter transformer (bf16 compute, fp32 main
weights, AdamW), for ``fully_shard`` and torch FSDP2: ``(audited / plain - 1) / 1000`` at most 0.01.
Nothing is added to an iteration that is not audited (no mode, no hook): what the plain step costs
with telemetry on is ``benchmarks.telemetry_overhead``'s.

Two identical models (one seed), telemetry on for both, one audited every iteration
(``FSDP_PATCH_PRECISION_AUDIT_EVERY=1``), one never (``0``); steps alternate between them, and the
ratio is the median of per-round ratios. An audit is process-wide from the end of one step to the
end of the next, so the audited model's audit is started right before its step and closed right
after it (through the adapter's registry: a benchmark's way in): the plain model's steps run
unaudited, and the audited step pays for everything an audited iteration does, reading its
statistics back and judging them included.

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
SETTINGS = {
    "audited": {"FSDP_PATCH_TELEMETRY": "1", "FSDP_PATCH_PRECISION_AUDIT_EVERY": "1"},
    "plain": {"FSDP_PATCH_TELEMETRY": "1", "FSDP_PATCH_PRECISION_AUDIT_EVERY": "0"},
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


def _audits(optimizer: torch.optim.Optimizer) -> Any:
    from fsdp_patch.adapter import adaptation_of

    adaptation = adaptation_of(optimizer)
    assert adaptation is not None
    return adaptation.observer._iterations.audits  # type: ignore[attr-defined]


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
            audits = _audits(built["audited"][1])

            def audited(step: Any = step, audits: Any = audits) -> float:
                audits.start()
                try:
                    return float(step("audited"))
                finally:
                    audits.close()  # the next iteration's, begun at the step's end

            times = paired({"audited": audited, "plain": lambda step=step: step("plain")}, steps, warmup)
            ratio = paired_ratio(times, "audited", "plain")
            out[kind] = {
                "step_s_plain": median(times["plain"]),
                "step_s_audited": median(times["audited"]),
                "ratio_audited_plain": ratio,
                "amortized_at_default": 1 + (ratio - 1) / DEFAULT_EVERY,
            }
    return out


def bench(steps: int, warmup: int, json_path: str | None, small: bool = False) -> None:
    results = run(steps, warmup, SMALL if small else LARGE)
    if dist.get_rank() != 0:
        return
    print(
        f"operation audit, {results['params'] / 1e6:.1f}M-parameter transformer, bf16 compute, {_device().type}, "
        f"{dist.get_world_size()} rank(s), {steps} paired steps; target: amortized at one audit in "
        f"{DEFAULT_EVERY} iterations <= 1.01"
    )
    print()
    print("| sharding | plain step | audited step | audited / plain | a run at the default schedule |")
    print("| --- | --- | --- | --- | --- |")
    for kind in KINDS:
        r = results[kind]
        print(
            f"| {kind} | {r['step_s_plain'] * 1e3:.0f} ms | {r['step_s_audited'] * 1e3:.0f} ms "
            f"| {r['ratio_audited_plain']:.2f} | {r['amortized_at_default']:.4f} |"
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
