"""Telemetry overhead: training step time with telemetry on versus off (case 5 of the suite).

All settings run in one process, side by side: one sharded model and one AdamW optimizer per
setting over its parameters, each adapted with ``fully_shard_optimizer``: telemetry off (a
``NullObserver``), telemetry on with the embedded default exporter and diagnostics off, telemetry on
with the whole-model precision diagnostics on every step (``FSDP_PATCH_PRECISION_TOP_K=0``: no
per-parameter detail), and the same with the per-parameter attribution (the default). Steps
rotate between them so that drift in machine speed hits all alike; ratios are medians of
per-round ratios.

Part 1: a >= 20M-parameter transformer, AdamW, whole training step (forward, backward, step).
Part 2: a tiny model, plain SGD, ``optimizer.step()`` alone: the fixed per-step cost in
microseconds.

On CUDA (``--device cuda``: NCCL, one GPU per rank) every duration is a pair of CUDA events
around the measured code, read after synchronizing; on the CPU, ``time.perf_counter``.
``--json PATH`` writes the figures (with the device's name) for ``benchmarks/results/``.

Usage::

    python -m benchmarks.telemetry_overhead [--steps 12] [--tiny-steps 400] [--device cuda] [--json out.json]
        [--settings off,on,diagnostics,attribution]

``run()`` measures in the calling process (on its process group, or a world-size-1 one).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from fsdp_patch.app.demo.data import synthetic_batches
from fsdp_patch.app.demo.launch import run_ranks
from fsdp_patch.app.demo.model import GPT, GPTConfig, lm_loss, shard

from .common import Clock, median, paired, paired_ratio, process_group, write_results

LARGE = GPTConfig(vocab=8192, dim=512, heads=8, layers=6, seq=64)
SMALL = GPTConfig(vocab=1024, dim=128, heads=4, layers=2, seq=32)
TINY = GPTConfig(vocab=32, dim=16, heads=2, layers=2, seq=8)
# Setting -> the environment its optimizer is adapted under.
# The per-iteration checks watch the model, which every setting here shares: off throughout, so
# that each setting's step carries only its own cost (benchmarks/origin_checks.py measures them).
SETTINGS: dict[str, dict[str, str]] = {
    "off": {"FSDP_PATCH_TELEMETRY": "0", "FSDP_PATCH_PRECISION_EVERY": "0"},
    "on": {"FSDP_PATCH_TELEMETRY": "1", "FSDP_PATCH_PRECISION_EVERY": "0"},
    "diagnostics": {
        "FSDP_PATCH_TELEMETRY": "1",
        "FSDP_PATCH_PRECISION_EVERY": "1",
        "FSDP_PATCH_PRECISION_TOP_K": "0",
        "FSDP_PATCH_PRECISION_ORIGIN": "off",
    },
    "attribution": {
        "FSDP_PATCH_TELEMETRY": "1",
        "FSDP_PATCH_PRECISION_EVERY": "1",
        "FSDP_PATCH_PRECISION_ORIGIN": "off",
    },
}


@contextmanager
def _quiet_telemetry() -> Iterator[None]:
    """Traces to a temporary directory, no end-of-run summary."""
    with (
        tempfile.TemporaryDirectory() as traces,
        mock.patch.dict(os.environ, {"FSDP_PATCH_TRACE_DIR": traces, "FSDP_PATCH_SUMMARY": "none"}),
    ):
        try:
            yield
        finally:
            from fsdp_patch.telemetry.export import providers

            providers.uninstall()


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _build(
    config: GPTConfig, optimizer_class: type[torch.optim.Optimizer], settings: tuple[str, ...]
) -> tuple[torch.nn.Module, dict[str, torch.optim.Optimizer]]:
    """One sharded model and one optimizer per setting over its parameters.

    Sharing the model keeps memory placement, caches and the forward/backward identical for
    every setting; only the adapted step differs.
    """
    from fsdp_patch import MixedPrecisionPolicy
    from fsdp_patch.optimizer import fully_shard_optimizer

    torch.manual_seed(0)
    # fp32 compute with bf16 main grads: every step casts grads, and the step stays fast
    # (CPUs without bf16 matrix units emulate bf16 GEMMs slowly), which makes the overhead
    # ratio the harder target.
    model = shard(GPT(config).to(_device()), mp_policy=MixedPrecisionPolicy(main_grads_dtype=torch.bfloat16))
    optimizers = {}
    for setting in settings:
        optimizer = optimizer_class(model.parameters(), lr=1e-4)
        with mock.patch.dict(os.environ, SETTINGS[setting]):
            fully_shard_optimizer(optimizer)
        optimizers[setting] = optimizer
    return model, optimizers


def _training_steps(config: GPTConfig, steps: int, warmup: int, settings: tuple[str, ...]) -> dict[str, Any]:
    model, optimizers = _build(config, torch.optim.AdamW, settings)
    device = _device()
    clock = Clock(device)
    batches = [b.to(device) for b in synthetic_batches(config, 4, steps + warmup)]
    optimizer_times: dict[str, list[float]] = {setting: [] for setting in settings}
    cursor = {setting: 0 for setting in settings}

    def train_step(setting: str) -> float:
        optimizer = optimizers[setting]
        tokens = batches[cursor[setting] % len(batches)]
        cursor[setting] += 1
        start = clock.start()
        lm_loss(model, tokens).backward()
        before_step = clock.start()
        optimizer.step()
        optimizer_times[setting].append(clock.seconds_since(before_step))
        optimizer.zero_grad()
        return clock.seconds_since(start)

    times = paired({setting: (lambda s=setting: train_step(s)) for setting in settings}, steps, warmup)
    for setting in settings:
        del optimizer_times[setting][:warmup]
    result: dict[str, Any] = {"params": sum(p.numel() for p in model.parameters()), "steps": steps}
    for setting in settings:
        result[f"step_s_{setting}"] = median(times[setting])
        result[f"optimizer_step_s_{setting}"] = median(optimizer_times[setting])
        if setting != "off":
            result[f"ratio_{setting}_off"] = paired_ratio(times, setting, "off")
            result[f"optimizer_step_ratio_{setting}_off"] = paired_ratio(optimizer_times, setting, "off")
    if "attribution" in settings and "diagnostics" in settings:
        result["ratio_attribution_diagnostics"] = paired_ratio(times, "attribution", "diagnostics")
    return result


def _tiny_model(steps: int, warmup: int) -> dict[str, Any]:
    model, optimizers = _build(TINY, torch.optim.SGD, ("off", "on"))
    clock = Clock(_device())
    lm_loss(model, synthetic_batches(TINY, 2, 1)[0].to(_device())).backward()
    times = paired(
        {setting: (lambda o=optimizer: clock.time(o.step)) for setting, optimizer in optimizers.items()},
        steps,
        warmup * 10,
    )
    off, on = median(times["off"]), median(times["on"])
    params = sum(p.numel() for p in model.parameters())
    return {"params": params, "steps": steps, "step_s_off": off, "step_s_on": on, "fixed_cost_s": on - off}


def run(
    steps: int = 30,
    tiny_steps: int = 400,
    warmup: int = 2,
    *,
    config: GPTConfig = LARGE,
    settings: tuple[str, ...] = ("off", "on"),
    device: str = "cpu",
) -> dict[str, Any]:
    """Measures the training step per setting and the tiny model's fixed cost.

    Args:
        steps: Measured training steps per setting.
        tiny_steps: Measured ``optimizer.step()`` calls per setting on the tiny model.
        warmup: Unmeasured rounds first.
        config: The large model's sizes.
        settings: Which of :data:`SETTINGS` to run (``"off"`` first: ratios are against it).
        device: ``"cpu"`` or ``"cuda"`` (a world-size-1 group is made when none exists).

    Returns:
        ``{"large": ..., "tiny": ...}``: medians in seconds, paired ratios against ``off``.
    """
    with _quiet_telemetry(), process_group(device):
        return {"large": _training_steps(config, steps, warmup, settings), "tiny": _tiny_model(tiny_steps, warmup)}


def _report(results: dict[str, Any]) -> None:
    large, tiny = results["large"], results["tiny"]
    print(
        f"large model: {large['params'] / 1e6:.1f}M parameters, {dist.get_world_size()} rank(s), {large['steps']} steps each"
    )
    print(f"  step time, telemetry off: {large['step_s_off'] * 1e3:9.2f} ms (median)")
    print(f"  step time, telemetry on : {large['step_s_on'] * 1e3:9.2f} ms (median)")
    ratio = large["ratio_on_off"]
    print(
        f"  overhead ratio on/off   : {ratio:9.4f}  ({(ratio - 1) * 100:+.2f}%, median of adjacent pairs; target < +3%)"
    )
    print(
        f"  of which optimizer.step(): off {large['optimizer_step_s_off'] * 1e3:.2f} ms, "
        f"on {large['optimizer_step_s_on'] * 1e3:.2f} ms, ratio {large['optimizer_step_ratio_on_off']:.4f}"
    )
    for setting in ("diagnostics", "attribution"):
        if f"ratio_{setting}_off" in large:
            print(
                f"  step time, {setting:11}: {large[f'step_s_{setting}'] * 1e3:9.2f} ms (median), "
                f"{setting} / off {large[f'ratio_{setting}_off']:.4f}"
            )
    if "ratio_attribution_diagnostics" in large:
        print(f"  attribution / diagnostics: {large['ratio_attribution_diagnostics']:.4f}")
    print(f"tiny model: {tiny['params']} parameters, SGD optimizer.step() alone, {tiny['steps']} steps each")
    print(f"  step, telemetry off: {tiny['step_s_off'] * 1e6:9.1f} us (median)")
    print(f"  step, telemetry on : {tiny['step_s_on'] * 1e6:9.1f} us (median)")
    print(f"  fixed cost per step: {tiny['fixed_cost_s'] * 1e6:9.1f} us")


def bench(steps: int, tiny_steps: int, warmup: int, json_path: str | None, settings: tuple[str, ...]) -> None:
    """One rank's part of the command line run: measure, print on rank 0, write the JSON."""
    results = run(steps, tiny_steps, warmup, settings=settings)
    if dist.get_rank() != 0:
        return
    _report(results)
    if json_path:
        write_results(json_path, "telemetry_overhead", results)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--tiny-steps", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: NCCL, one GPU per rank")
    parser.add_argument("--json", default=None, help="write the figures as JSON here")
    parser.add_argument(
        "--settings",
        default="off,on",
        help=f"comma-separated, of {', '.join(SETTINGS)}; off first (case 5 of the suite runs them all)",
    )
    args = parser.parse_args(argv)
    settings = tuple(s.strip() for s in args.settings.split(",") if s.strip())
    if not settings or settings[0] != "off" or "on" not in settings or any(s not in SETTINGS for s in settings):
        parser.error(f"--settings {args.settings!r}: want off first, then on and any of {', '.join(SETTINGS)}")
    run_ranks(bench, args.world_size, args.steps, args.tiny_steps, args.warmup, args.json, settings, device=args.device)


if __name__ == "__main__":
    main()
