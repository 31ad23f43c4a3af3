"""The main job: mixed-precision FSDP training with the adapter's telemetry, on one machine.

Runs 2 gloo ranks on the CPU (or the ranks torchrun started) training a small transformer with
bf16 compute weights, fp32 main weights and bf16 main grads, through ``fully_shard`` and
``fully_shard_optimizer`` with ``FSDP_PATCH_TELEMETRY=1``. With no exporter configured,
telemetry uses its embedded default: one Chrome-trace file per rank (open it in
https://ui.perfetto.dev or chrome://tracing, or the Jaeger JSON in Jaeger's "JSON File" upload)
and a metric summary printed at exit. Set ``OTEL_*`` variables to send to a collector instead
(see dashboards/README.md).

A scenario plants a real numeric bug, so the precision diagnostics have something to find:

- ``healthy``: nothing planted; lost-update ratio stays low, no non-finite values.
- ``tiny-lr``: a learning rate too small for bf16 compute weights; lost-update ratio near 1.
- ``nan``: one NaN in a gradient on rank 0 halfway through; counted in main_grad, then in
  the weights it poisons.
- ``fp16-overflow``: fp16 compute weights; halfway through, a main weight grows past fp16's
  range and the refresh overflows to inf.

Usage::

    python -m examples.main_job [--scenario healthy] [--steps 30] [--world-size 2]
    torchrun --nproc-per-node 2 -m examples.main_job
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from examples.launch import run_ranks
from examples.model import GPT, GPTConfig, lm_loss, shard, synthetic_batches


@dataclass(frozen=True)
class Scenario:
    compute_dtype: torch.dtype
    lr: float
    plant: str | None = None


SCENARIOS = {
    "healthy": Scenario(torch.bfloat16, 3e-3),
    "tiny-lr": Scenario(torch.bfloat16, 1e-7),
    "nan": Scenario(torch.bfloat16, 3e-3, plant="nan"),
    "fp16-overflow": Scenario(torch.float16, 3e-3, plant="overflow"),
}

DEFAULT_ENV = {
    "FSDP_PATCH_TELEMETRY": "1",
    "FSDP_PATCH_PRECISION_EVERY": "5",
    "FSDP_PATCH_TRACE_DIR": os.path.join("runs", "main_job", "traces"),
    "OTEL_SERVICE_NAME": "fsdp_patch_main_job",
}


def train(scenario_name: str, steps: int, batch: int) -> None:
    from fsdp_patch import MixedPrecisionPolicy
    from fsdp_patch.optimizer import fully_shard_optimizer

    scenario = SCENARIOS[scenario_name]
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    config = GPTConfig()
    torch.manual_seed(0)
    model = GPT(config).to(device=device, dtype=scenario.compute_dtype)
    shard(model, mp_policy=MixedPrecisionPolicy(main_params_dtype=torch.float32))
    optimizer = torch.optim.AdamW(model.parameters(), lr=scenario.lr, weight_decay=0.0)
    fully_shard_optimizer(optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 5))

    per_rank = batch // world_size
    plant_at = steps // 2
    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        print(
            f"main job: scenario={scenario_name} ranks={world_size} params={params:,} "
            f"compute={scenario.compute_dtype} main=torch.float32 grads={scenario.compute_dtype} steps={steps}",
            flush=True,
        )
    for step, tokens in enumerate(synthetic_batches(config, batch, steps), start=1):
        local = tokens[rank * per_rank : (rank + 1) * per_rank].to(device)
        loss = lm_loss(model, local)
        loss.backward()
        if scenario.plant == "nan" and step == plant_at and rank == 0:
            with torch.no_grad():
                model.head.weight.grad.to_local().view(-1)[0] = float("nan")
        if scenario.plant == "overflow" and step == plant_at:
            with torch.no_grad():
                model.pos.to_local().mul_(0).add_(7.0e4)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        if rank == 0 and (step == 1 or step % 5 == 0 or step == steps):
            print(f"step {step:4d}  loss {loss.item():.4f}", flush=True)

    import fsdp_patch.telemetry as telemetry

    telemetry.shutdown()
    dist.barrier()
    if rank == 0:
        trace_dir = os.environ.get("FSDP_PATCH_TRACE_DIR", "")
        if trace_dir and os.path.isdir(trace_dir):
            print(f"\ntraces in {trace_dir}/ :", flush=True)
            for name in sorted(os.listdir(trace_dir)):
                if name.endswith(".json"):
                    print(f"  {os.path.join(trace_dir, name)}", flush=True)
            print("open a *.json trace in https://ui.perfetto.dev or chrome://tracing; see dashboards/README.md", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), default="healthy")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=8, help="global batch, split across ranks")
    parser.add_argument("--world-size", type=int, default=2, help="local ranks when not under torchrun")
    args = parser.parse_args(argv)
    if args.batch % args.world_size:
        parser.error(f"--batch {args.batch} must be divisible by --world-size {args.world_size}")
    for key, value in DEFAULT_ENV.items():
        os.environ.setdefault(key, value)
    run_ranks(train, args.world_size, args.scenario, args.steps, args.batch)


if __name__ == "__main__":
    main()
