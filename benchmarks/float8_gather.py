"""The float8 compute copy against the bf16 one: bytes all-gathered, memory, step time.

A stack of torchao ``Float8Linear`` layers (tensorwise scaling; fp8 matmuls emulated on a CPU,
real on a GPU), sharded layer by layer by ``fully_shard`` with fp32 main weights, trained with
AdamW on every rank's rows. Two models built alike from one seed differ in one setting of torchao's
conversion, ``enable_fsdp_float8_all_gather``:

- ``bf16``: off: the compute copy is bf16 and each forward gathers it, torchao casting to float8
  after the gather;
- ``float8``: on: the compute copy is float8 with one scale per weight (``fsdp_patch`` keeps it,
  :mod:`fsdp_patch.sharding.float8_copy`), gathered as bytes;
- on CUDA also ``fsdp2_float8``: the same model under torch FSDP2 with torchao's float8 all-gather
  (fp32 parameters, bf16 compute, ``precompute_float8_dynamic_scale_for_fsdp`` after each step),
  the step time to hold ``float8`` to (FSDP2's float8 all-gather does not run on gloo).

Per model, over one training step after warm-up: the bytes every all-gather of the step moved (the
gathered outputs, on this rank), the live bytes of storages at the step's peak and before it
(:class:`~benchmarks.memory.StorageMeter`: the persistent copy shows in the latter), and the step's
time, paired (median of per-round ratios).

Usage::

    python -m benchmarks.float8_gather [--layers 4] [--width 1024] [--steps 6] [--world-size 2] [--device cuda] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from fsdp_patch.app.demo.launch import run_ranks
from torch import nn

from .common import Clock, median, paired, paired_ratio, write_results
from .memory import StorageMeter

SETTINGS = ("bf16", "float8")
# torch FSDP2 with torchao's float8 all-gather, on NCCL only (its float8 all-gather fails on gloo).
FSDP2 = "fsdp2_float8"
BATCH = 32


def _model(setting: str, layers: int, width: int, device: torch.device) -> nn.Module:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(layers)])
    model = model.to(device=device, dtype=torch.bfloat16)
    native = device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)
    config = Float8LinearConfig(emulate=not native, enable_fsdp_float8_all_gather=setting != "bf16")
    convert_to_float8_training(model, config=config)
    if setting == FSDP2:
        # torch FSDP2 with torchao's float8 all-gather: fp32 parameters, bf16 compute.
        from torch.distributed.fsdp import MixedPrecisionPolicy
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        model.float()
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        for block in model:
            torch_fully_shard(block, mp_policy=policy)
        torch_fully_shard(model, mp_policy=policy)
        return model
    from fsdp_patch import fully_shard

    for block in model:
        fully_shard(block)
    fully_shard(model)
    return model


@contextlib.contextmanager
def _gathered_bytes() -> Iterator[list[int]]:
    """Each all-gather's output bytes while active: the flat collective every group issues
    (``all_gather_single`` where torch has it, else ``all_gather_into_tensor``)."""
    seen: list[int] = []
    name = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    original = getattr(dist, name)

    def counting(output: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        seen.append(output.numel() * output.element_size())
        return original(output, *args, **kwargs)

    setattr(dist, name, counting)
    try:
        yield seen
    finally:
        setattr(dist, name, original)


def bench(layers: int, width: int, steps: int, json_path: str | None, device_kind: str) -> None:
    from fsdp_patch.optimizer import fully_shard_optimizer

    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if device_kind == "cuda" else torch.device("cpu")
    settings = (*SETTINGS, FSDP2) if device_kind == "cuda" else SETTINGS
    meters: dict[str, StorageMeter] = {}
    built: dict[str, tuple[nn.Module, torch.optim.Optimizer]] = {}
    for setting in settings:
        meters[setting] = meter = StorageMeter()
        with meter:
            model = _model(setting, layers, width, device)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
            fully_shard_optimizer(optimizer)
        built[setting] = (model, optimizer)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, width, generator=generator).chunk(world)[rank].to(device, torch.bfloat16)
    y = torch.randn(BATCH, width, generator=generator).chunk(world)[rank].to(device)
    clock = Clock(device_kind)

    def step(setting: str) -> float:
        model, optimizer = built[setting]
        start = clock.start()
        F.mse_loss(model(x).float(), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        if setting == FSDP2:
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            precompute_float8_dynamic_scale_for_fsdp(model)  # the scales, once per step, as torchao advises
        return clock.seconds_since(start)

    for setting in settings:
        step(setting)
    results: dict[str, Any] = {"layers": layers, "width": width, "params": layers * (width * width + width)}
    for setting in settings:
        meter = meters[setting]
        with meter, _gathered_bytes() as seen:
            before = meter.live
            meter.reset_peak()
            step(setting)
        results[setting] = {
            "gathered_bytes": sum(seen),
            "gathers": len(seen),
            "live_bytes": before,
            "peak_bytes": meter.peak,
        }
    times = paired({s: (lambda s=s: step(s)) for s in settings}, rounds=steps)
    for setting in settings:
        results[setting]["step_s"] = median(times[setting])
    if FSDP2 in settings:
        results["ratio_step_against_fsdp2"] = paired_ratio(times, "float8", FSDP2)
    results["ratio_gathered"] = results["float8"]["gathered_bytes"] / results["bf16"]["gathered_bytes"]
    results["ratio_peak"] = results["float8"]["peak_bytes"] / results["bf16"]["peak_bytes"]
    results["ratio_step"] = paired_ratio(times, "float8", "bf16")
    if rank == 0:
        for setting in settings:
            r = results[setting]
            print(
                f"{setting:>7}: {r['gathered_bytes'] / 2**20:.2f} MiB gathered in {r['gathers']} all-gathers, "
                f"live {r['live_bytes'] / 2**20:.1f} MiB, peak {r['peak_bytes'] / 2**20:.1f} MiB, "
                f"step {r['step_s'] * 1e3:.1f} ms",
                flush=True,
            )
        print(
            f"float8 / bf16: gathered {results['ratio_gathered']:.3f}, peak {results['ratio_peak']:.3f}, "
            f"step {results['ratio_step']:.3f}"
            + (
                f"; float8 / FSDP2's float8: step {results['ratio_step_against_fsdp2']:.3f}"
                if FSDP2 in settings
                else ""
            ),
            flush=True,
        )
        if json_path:
            write_results(json_path, "float8_gather", {"steps": steps, **results})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.float8_gather", description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4, help="Float8Linear layers (default 4)")
    parser.add_argument("--width", type=int, default=1024, help="each layer's width, a multiple of 16 (default 1024)")
    parser.add_argument("--steps", type=int, default=6, help="paired measured steps (default 6)")
    parser.add_argument("--world-size", type=int, default=2, help="local ranks (default 2)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    if args.layers < 1 or args.steps < 1 or args.world_size < 1:
        parser.error(f"--layers {args.layers}, --steps {args.steps}, --world-size {args.world_size}: expected >= 1")
    if args.width < 16 or args.width % 16:
        parser.error(f"--width {args.width}: expected a multiple of 16 (float8 matmuls need it)")
    run_ranks(bench, args.world_size, args.layers, args.width, args.steps, args.json, args.device, device=args.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
