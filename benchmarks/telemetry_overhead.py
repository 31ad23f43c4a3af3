"""Telemetry overhead: training step time with telemetry on (diagnostics off) versus off.

Both configurations run in one process, side by side: two identical sharded models, one
adapted with torch's step hooks (``FSDP_PATCH_TELEMETRY`` off), one with the wrapt wrapper and
OpenTelemetry on its embedded default exporter. Steps alternate between them so that drift in
machine speed hits both alike; medians are compared.

Part 1: a >= 20M-parameter transformer, AdamW, whole training step (forward, backward, step).
Part 2: a tiny model, plain SGD, ``optimizer.step()`` alone: the fixed per-step cost in
microseconds.

On CUDA (``--device cuda``: NCCL, one GPU per rank) every duration is a pair of CUDA events
around the measured code, read after synchronizing; on the CPU, ``time.perf_counter``.
``--json PATH`` writes the figures (with the device's name) for ``benchmarks/results/``.

Usage::

    python -m benchmarks.telemetry_overhead [--steps 12] [--tiny-steps 400] [--device cuda] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from fsdp_patch.demo.data import synthetic_batches
from fsdp_patch.demo.launch import run_ranks
from fsdp_patch.demo.model import GPT, GPTConfig, lm_loss, shard

LARGE = GPTConfig(vocab=8192, dim=512, heads=8, layers=6, seq=64)
TINY = GPTConfig(vocab=32, dim=16, heads=2, layers=2, seq=8)


class Clock:
    """Times a stretch of code: CUDA events on a CUDA device (read after a synchronize), else perf_counter."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def start(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds_since(self, token: Any) -> float:
        if not self.cuda:
            return time.perf_counter() - token
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        end.synchronize()
        return token.elapsed_time(end) / 1000.0


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _build(
    config: GPTConfig, optimizer_class: type[torch.optim.Optimizer]
) -> tuple[torch.nn.Module, dict[bool, torch.optim.Optimizer]]:
    """One sharded model and two optimizers over its parameters: telemetry off and on.

    Sharing the model keeps memory placement, caches and the forward/backward identical for
    both sides; only the adapted step differs.
    """
    from fsdp_patch import MixedPrecisionPolicy
    from fsdp_patch.optimizer import fully_shard_optimizer

    torch.manual_seed(0)
    # fp32 compute with bf16 main grads: every step casts grads, and the step stays fast
    # (CPUs without bf16 matrix units emulate bf16 GEMMs slowly), which makes the overhead
    # ratio the harder target.
    model = shard(GPT(config).to(_device()), mp_policy=MixedPrecisionPolicy(main_grads_dtype=torch.bfloat16))
    optimizers = {}
    for telemetry_on in (False, True):
        optimizer = optimizer_class(model.parameters(), lr=1e-4)
        os.environ["FSDP_PATCH_TELEMETRY"] = "1" if telemetry_on else "0"
        fully_shard_optimizer(optimizer)
        optimizers[telemetry_on] = optimizer
    return model, optimizers


def _alternate(steps: int, run: Callable[[bool, int], float]) -> dict[bool, list[float]]:
    """Runs ``run(telemetry_on, step)`` for both settings each step; returns the durations."""
    times: dict[bool, list[float]] = {False: [], True: []}
    for step in range(steps):
        # Alternate the order too, so neither side always runs on a warmer cache.
        order = (False, True) if step % 2 == 0 else (True, False)
        for telemetry_on in order:
            times[telemetry_on].append(run(telemetry_on, step))
    return times


def _paired_ratio(times: dict[bool, list[float]]) -> float:
    """Median of on/off ratios of steps run back to back: drift of the machine cancels out."""
    return statistics.median(on / off for on, off in zip(times[True], times[False]))


def _large_model(steps: int, warmup: int) -> dict[str, Any]:
    model, optimizers = _build(LARGE, torch.optim.AdamW)
    device = _device()
    clock = Clock(device)
    batches = [b.to(device) for b in synthetic_batches(LARGE, 4, steps + warmup)]
    optimizer_times: dict[bool, list[float]] = {False: [], True: []}

    def train_step(telemetry_on: bool, tokens: torch.Tensor) -> float:
        optimizer = optimizers[telemetry_on]
        start = clock.start()
        lm_loss(model, tokens).backward()
        before_step = clock.start()
        optimizer.step()
        optimizer_times[telemetry_on].append(clock.seconds_since(before_step))
        optimizer.zero_grad()
        return clock.seconds_since(start)

    for tokens in batches[:warmup]:
        for on in (False, True):
            train_step(on, tokens)
    for times in optimizer_times.values():
        times.clear()
    large = _alternate(steps, lambda on, step: train_step(on, batches[warmup + step]))

    params = sum(p.numel() for p in model.parameters())
    off, on = statistics.median(large[False]), statistics.median(large[True])
    ratio = _paired_ratio(large)
    soff, son = statistics.median(optimizer_times[False]), statistics.median(optimizer_times[True])
    if dist.get_rank() == 0:
        print(f"large model: {params / 1e6:.1f}M parameters, {dist.get_world_size()} rank(s), {steps} steps each")
        print(f"  step time, telemetry off: {off * 1e3:9.2f} ms (median)")
        print(f"  step time, telemetry on : {on * 1e3:9.2f} ms (median)")
        print(f"  overhead ratio on/off   : {ratio:9.4f}  ({(ratio - 1) * 100:+.2f}%, median of adjacent pairs; target < +3%)")
        print(
            f"  of which optimizer.step(): off {soff * 1e3:.2f} ms, on {son * 1e3:.2f} ms, "
            f"ratio {_paired_ratio(optimizer_times):.4f}"
        )
    return {
        "params": params,
        "steps": steps,
        "step_s_off": off,
        "step_s_on": on,
        "ratio_on_off": ratio,
        "optimizer_step_s_off": soff,
        "optimizer_step_s_on": son,
        "optimizer_step_ratio_on_off": _paired_ratio(optimizer_times),
    }


def _tiny_model(steps: int, warmup: int) -> dict[str, Any]:
    model, optimizers = _build(TINY, torch.optim.SGD)
    clock = Clock(_device())
    lm_loss(model, synthetic_batches(TINY, 2, 1)[0].to(_device())).backward()

    def run(telemetry_on: bool, step: int = 0) -> float:
        optimizer = optimizers[telemetry_on]
        start = clock.start()
        optimizer.step()
        return clock.seconds_since(start)

    for _ in range(warmup * 10):
        for on in (False, True):
            run(on)
    small = _alternate(steps, run)

    off, on = statistics.median(small[False]), statistics.median(small[True])
    params = sum(p.numel() for p in model.parameters())
    if dist.get_rank() == 0:
        print(f"tiny model: {params} parameters, SGD optimizer.step() alone, {steps} steps each")
        print(f"  step, telemetry off: {off * 1e6:9.1f} us (median)")
        print(f"  step, telemetry on : {on * 1e6:9.1f} us (median)")
        print(f"  fixed cost per step: {(on - off) * 1e6:9.1f} us")
    return {"params": params, "steps": steps, "step_s_off": off, "step_s_on": on, "fixed_cost_s": on - off}


def device_name() -> str:
    """The GPU's name on CUDA (``NVIDIA H200``), else the CPU's architecture (``cpu-x86_64``)."""
    if dist.get_backend() == "nccl":
        return torch.cuda.get_device_name(torch.cuda.current_device())
    return f"cpu-{platform.machine()}"


def bench(steps: int, tiny_steps: int, warmup: int, json_path: str | None) -> None:
    results = {"large": _large_model(steps, warmup), "tiny": _tiny_model(tiny_steps, warmup)}
    if json_path and dist.get_rank() == 0:
        document = {
            "benchmark": "telemetry_overhead",
            "device": device_name(),
            "world_size": dist.get_world_size(),
            "torch": torch.__version__,
            "timer": "cuda_events" if dist.get_backend() == "nccl" else "perf_counter",
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            **results,
        }
        os.makedirs(os.path.dirname(json_path) or ".", exist_ok=True)
        with open(json_path, "w", encoding="utf-8") as f:
            json.dump(document, f, indent=1)
            f.write("\n")
        print(f"wrote {json_path}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--tiny-steps", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: NCCL, one GPU per rank")
    parser.add_argument("--json", default=None, help="write the figures as JSON here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("FSDP_PATCH_TRACE_DIR", tmp)
        os.environ.setdefault("FSDP_PATCH_PRECISION_EVERY", "0")
        os.environ.setdefault("FSDP_PATCH_SUMMARY", "none")
        run_ranks(bench, args.world_size, args.steps, args.tiny_steps, args.warmup, args.json, device=args.device)


if __name__ == "__main__":
    main()
